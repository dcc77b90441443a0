"""The scheduler's part in prefill/decode disaggregation (a mixin of :class:`Scheduler`).

A decode instance's request whose prompt KV can come from a prefill instance is admitted in
two stages: first its blocks are allocated (after its local prefix-cache hit) and it waits in
``WAITING_FOR_REMOTE_KVS``, holding them without running while the connector's worker side
fills them; when the load is reported, it goes back to the front of the waiting queue with
``num_computed_tokens`` covering the loaded blocks and computes only the rest. A request
aborted mid-load keeps its blocks until the worker reports the load over (its cancelled
transfer may still be writing them). On a prefill instance, a finished ``do_remote_decode``
request's blocks are kept (``held_for_transfer``) until the worker side reports the hold over.
vLLM v1's scheduler does the same with ``WAITING_FOR_REMOTE_KVS`` and ``finished_sending``.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from pagedserve.core.outputs import EngineCoreOutput, KVConnectorOutput
from pagedserve.core.request import Request, RequestStatus

logger = logging.getLogger("pagedserve")

KV_LOAD_POLL_S = 0.002  # how often an otherwise idle core checks for finished loads
KV_HOLD_POLL_S = 0.05  # ... and for holds the decode side released


class RemoteKVMixin:
    """Needs ``self.connector``, ``self.kv_cache_manager``, ``self.waiting``, ``self.requests``,
    ``self.stats``, ``self.config`` and ``self._free`` / ``self._release`` of the Scheduler."""

    def _init_remote_kv(self, connector) -> None:
        self.connector = connector
        self.waiting_for_remote: dict[str, Request] = {}
        self.held_for_transfer: dict[str, Request] = {}
        self.kv_failed: list[Request] = []  # failed with kv_load_failure_policy "fail" (reported at once)

    def _id_in_use_remotely(self, request_id: str) -> bool:
        return request_id in self.waiting_for_remote or request_id in self.held_for_transfer

    def _try_remote_admission(self, req: Request, hit_blocks: list, num_hit: int) -> Optional[bool]:
        """For the request at the head of the waiting queue: None = no remote KV (admit it as
        usual); True = it now waits for remote KV (popped from the queue); False = no blocks
        for it now (stop admitting this step)."""
        from pagedserve.core.kv_connector import WAIT_FOR_OTHER_LOAD

        num_external = self.connector.get_num_new_matched_tokens(req, num_hit)
        if num_external == 0:
            return None
        kv = self.kv_cache_manager
        if num_external != WAIT_FOR_OTHER_LOAD:
            if kv.allocate_slots(req, num_external, hit_blocks, num_hit, register_new=False) is None:
                self.connector.request_dropped(req.request_id)
                return False
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id), num_hit, num_external)
        self.waiting.pop()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[req.request_id] = req
        return True

    def _finish_waiting_for_remote(self, req: Request, status: RequestStatus) -> None:
        """Abort/timeout of a request that waits for remote KV."""
        rid = req.request_id
        req.status = status
        if rid in self.kv_cache_manager.req_to_blocks:  # its load may still write the blocks: free them when it reports
            req.finished_time = time.monotonic()
            if req.deadline is not None:
                self.num_with_deadline -= 1
            del self.requests[rid]
            self.finished_req_ids.append(rid)  # the worker side cancels the load
        else:  # waited on a sibling's load: holds nothing
            del self.waiting_for_remote[rid]
            self.connector.request_dropped(rid)
            self._free(req)

    def _hold_or_free(self, req: Request) -> None:
        """A finished request's blocks: kept for a remote reader, or freed now."""
        if self.connector is not None and req.kv_transfer_params is not None:
            delay, req.kv_transfer_params_out = self.connector.request_finished(req, self.kv_cache_manager.get_block_ids(req.request_id))
            if delay:
                self.held_for_transfer[req.request_id] = req
                self.kv_cache_manager.free_tail(req, len(req.kv_transfer_params_out["remote_block_ids"]))
                return
        self.kv_cache_manager.free(req)

    def _update_from_kv_output(self, kvo: Optional[KVConnectorOutput]) -> list[EngineCoreOutput]:
        """Apply what the worker side finished; outputs of requests that failed for good."""
        if kvo is None:
            return []
        kv = self.kv_cache_manager
        for rid in kvo.finished_sending:
            req = self.held_for_transfer.pop(rid, None)
            if req is not None:
                kv.free(req)
        resumed: list[Request] = []
        failed = dict(kvo.failed_recving)
        for rid in list(kvo.finished_recving) + list(failed):
            req = self.waiting_for_remote.pop(rid, None)
            if req is None:  # a repeated report
                continue
            waiters = [self.waiting_for_remote.pop(w) for w in self.connector.load_finished(rid) if w in self.waiting_for_remote]
            if req.is_finished():  # aborted while loading: the blocks are free to go now
                kv.free(req)
                self.connector.request_dropped(rid)
            elif rid not in failed:
                req.num_computed_tokens = len(kv.req_to_blocks[rid]) * self.config.block_size
                kv.cache_loaded_blocks(req, req.num_computed_tokens)  # siblings and later requests hit them
                req.status = RequestStatus.WAITING
                resumed.append(req)
            elif self.connector.config.kv_load_failure_policy == "recompute":
                logger.warning("pagedserve: %s: KV transfer failed (%s); computing its prompt here", rid, failed[rid])
                kv.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                resumed.append(req)
            else:
                req.status = RequestStatus.FINISHED_ERROR
                req.error = f"KV transfer from the prefill instance failed ({failed[rid]})"
                self._free(req)
                self.kv_failed.append(req)
            for w in waiters:
                w.status = RequestStatus.WAITING
                resumed.append(w)
        for req in reversed(resumed):
            self.waiting.prepend(req)
        s = self.stats
        s.kv_transfer_sent_tokens += kvo.sent_tokens
        s.kv_transfer_received_tokens += kvo.received_tokens
        for reason, n in kvo.failures.items():
            s.kv_transfer_failures[reason] = s.kv_transfer_failures.get(reason, 0) + n
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason="error", error=r.error, num_cached_tokens=max(0, r.num_cached_tokens),
                                    first_scheduled_time=r.first_scheduled_time) for r in self.kv_failed]
        self.kv_failed = []
        return outputs

    def _release_loaded_waiting(self) -> bool:
        """Nothing runs and the head of the waiting queue cannot get blocks: the waiting
        requests behind it that hold loaded KV give their blocks back (they stay in the prefix
        cache, so those requests usually hit them again). True when any did."""
        kv = self.kv_cache_manager
        freed = False
        for req in list(self.waiting)[1:]:
            if req.request_id in kv.req_to_blocks:
                kv.free(req)
                req.num_computed_tokens = 0
                freed = True
        return freed

    def kv_poll_interval(self) -> Optional[float]:
        """Seconds between checks for KV transfers that finished while nothing else runs, or
        None when none is outstanding."""
        if self.connector is None:
            return None
        if self.waiting_for_remote or self.connector.has_pending_meta():
            return KV_LOAD_POLL_S
        return KV_HOLD_POLL_S if self.held_for_transfer else None
