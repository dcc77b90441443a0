"""NetworkConnector, scheduler side: decides what a decode instance loads and what a prefill
instance holds (torch-free; runs in the engine core). See the package docstring for the path
of one request."""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable, Optional

from pagedserve.config import KVTransferConfig
from pagedserve.distributed.kv_transfer import params as kvp
from pagedserve.distributed.kv_transfer.base import (
    WAIT_FOR_OTHER_LOAD,
    HoldSpec,
    KVConnectorMetadata,
    KVConnectorScheduler,
    LoadSpec,
    ReleaseSpec,
)

logger = logging.getLogger("pagedserve")


class NetworkConnectorScheduler(KVConnectorScheduler):
    """Args:
    config: the instance's KV transfer config (role, address, lease).
    block_size: tokens per block.
    block_hashes: ``request -> list of 16-byte chained hashes of its full blocks`` (the
        prefix cache's, computed even when prefix caching is off).
    max_blocks: most blocks one request can have (caps client-supplied block lists).
    """

    def __init__(self, config: KVTransferConfig, block_size: int, block_hashes: Callable[[Any], list[bytes]], max_blocks: int) -> None:
        self.config = config
        self.block_size = block_size
        self.block_hashes = block_hashes
        self.max_blocks = max_blocks
        self.allowed_hosts = kvp.allowed_hosts_of(config)
        self._meta = KVConnectorMetadata()
        self._loading: dict[tuple[str, str], str] = {}  # (engine id, transfer id) -> the local request loading it
        self._load_key: dict[str, tuple[str, str]] = {}  # local request -> its load's key
        self._waiters: dict[tuple[str, str], list[str]] = {}  # requests waiting on another's load
        self._consumed: set[str] = set()  # local requests whose remote KV was used (or failed): never again

    # -- consumer ----------------------------------------------------------------------------
    def _remote(self, request: Any) -> Optional[dict]:
        if not self.config.is_consumer or request.request_id in self._consumed:
            return None
        params = request.kv_transfer_params
        if not kvp.wants_remote_prefill(params):
            return None
        try:
            return kvp.check_params(params, self.max_blocks, self.allowed_hosts)
        except kvp.KVParamsError as e:  # the front checks first; never let a bad value reach a socket
            logger.warning("pagedserve: %s: ignoring kv_transfer_params: %s", request.request_id, e)
            self._consumed.add(request.request_id)
            return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        params = self._remote(request)
        if params is None:
            return 0
        key = (params["remote_engine_id"], params["remote_request_id"])
        if key in self._loading:  # an n > 1 sibling is loading the same KV: its blocks will be cached
            self._waiters.setdefault(key, []).append(request.request_id)
            return WAIT_FOR_OTHER_LOAD
        B = self.block_size
        # Full blocks only, and never the last token: it must run here to give logits.
        num_blocks = min(len(params["remote_block_ids"]), params.get("remote_num_tokens", 0) // B, (request.num_tokens - 1) // B)
        num_external = num_blocks * B - num_computed_tokens
        if num_external <= 0:
            self._consumed.add(request.request_id)
            if params["remote_block_ids"]:  # the producer holds something: let it go now
                self._meta.releases.append(ReleaseSpec(key[0], params["remote_host"], params["remote_port"], key[1]))
            return 0
        return num_external

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        B = self.block_size
        first, last = num_computed_tokens // B, (num_computed_tokens + num_external_tokens) // B
        hashes = self.block_hashes(request)
        key = (params["remote_engine_id"], params["remote_request_id"])
        self._loading[key] = request.request_id
        self._load_key[request.request_id] = key
        self._consumed.add(request.request_id)
        self._meta.loads.append(
            LoadSpec(
                request.request_id,
                key[0],
                params["remote_host"],
                params["remote_port"],
                key[1],
                list(range(first, last)),
                hashes[first:last],
                params["remote_block_ids"][first:last],
                block_ids[first:last],
                num_external_tokens,
            )
        )

    def load_finished(self, request_id: str) -> list[str]:
        key = self._load_key.pop(request_id, None)
        if key is None:
            return []
        self._loading.pop(key, None)
        waiters = self._waiters.pop(key, [])
        self._consumed.update(waiters)  # the hold is gone: they use the cache or compute
        return waiters

    def request_dropped(self, request_id: str) -> None:
        self._consumed.discard(request_id)
        for waiters in self._waiters.values():
            if request_id in waiters:
                waiters.remove(request_id)

    def forget(self, request_id: str) -> None:
        """The request is gone for good (its id may be used again)."""
        self._consumed.discard(request_id)

    # -- producer ----------------------------------------------------------------------------
    def release_remote(self, params: Any) -> None:
        """A request carrying ``params`` will never load them (refused, aborted or finished
        before admission): tell the producer to drop its hold now instead of at its lease."""
        if not self.config.is_consumer or not kvp.wants_remote_prefill(params):
            return
        try:
            kvp.check_params(params, self.max_blocks, self.allowed_hosts)
        except kvp.KVParamsError:
            return
        if not params["remote_block_ids"] or (params["remote_engine_id"], params["remote_request_id"]) in self._loading:
            return  # nothing held, or a sibling is reading it (its load ends the hold)
        self._meta.releases.append(ReleaseSpec(params["remote_engine_id"], params["remote_host"], params["remote_port"], params["remote_request_id"]))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        if request.request_id not in self._consumed:
            self.release_remote(request.kv_transfer_params)
        self.forget(request.request_id)
        if not self.config.is_producer or not kvp.wants_remote_decode(request.kv_transfer_params):
            return False, None
        if request.status.finish_reason not in ("stop", "length"):
            return False, None  # aborted, failed or timed out: nothing for a decode instance
        B = self.block_size
        num_blocks = min(request.num_prompt_tokens // B, len(block_ids))
        transfer_id = uuid.uuid4().hex
        cfg = self.config
        host = cfg.kv_connector_extra_config.get("advertise_host") or cfg.kv_ip
        out = kvp.producer_params(cfg.engine_id, host, cfg.kv_port, transfer_id, block_ids[:num_blocks], num_blocks * B)
        if num_blocks == 0:  # shorter than one block: the decode instance computes it all
            return False, out
        hashes = self.block_hashes(request)[:num_blocks]
        self._meta.holds.append(HoldSpec(request.request_id, transfer_id, block_ids[:num_blocks], hashes, cfg.kv_lease_s))
        return True, out

    # -- both ------------------------------------------------------------------------------
    def build_connector_meta(self) -> Optional[KVConnectorMetadata]:
        if self._meta.is_empty:
            return None
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def has_pending_meta(self) -> bool:
        return not self._meta.is_empty
