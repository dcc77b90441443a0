"""The KV connector interface: a scheduler side (in the engine core, torch-free) and a worker
side (beside the KV cache), and the plain-value metadata that travels between them inside the
``SchedulerOutput`` (after vLLM's ``KVConnectorBase_V1``; the method names are vLLM's).

Scheduler side, per request:
- ``get_num_new_matched_tokens(request, num_computed_tokens)``: how many tokens after the
  local prefix-cache hit can be loaded from outside (or :data:`WAIT_FOR_OTHER_LOAD`);
- ``update_state_after_alloc(request, block_ids, num_computed_tokens, num_external_tokens)``:
  the scheduler allocated blocks for them; the connector plans the load;
- ``build_connector_meta()``: everything planned since the last step, for the worker side;
- ``request_finished(request, block_ids)``: ``(delay_free, kv_transfer_params)``: keep the
  blocks for a remote reader, and what to hand back to the client;
- ``load_finished(request_id)``: a load ended (either way); the ids of requests that waited on it.

Worker side, per step: ``start_load_kv(metadata, finished_req_ids)`` (start loads, register
holds, cancel the loads of finished requests), ``wait_for_layer_load(layer)`` and
``save_kv_layer(layer)`` (per-layer hooks for connectors that overlap transfer with compute),
``get_finished()`` (a :class:`KVConnectorOutput` of what completed since the last call) and
``shutdown()``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedserve.core.outputs import KVConnectorOutput

WAIT_FOR_OTHER_LOAD = -1  # another local request is loading the same remote KV: wait for it


@dataclass
class LoadSpec:
    """One load for the consumer's worker side.

    Attributes:
        req_id: the local request the blocks are for.
        engine_id, host, port: the producer (its engine id is checked in the handshake).
        transfer_id: the producer's name for the hold (``remote_request_id``).
        block_indices: which of the request's blocks (0 = the first ``block_size`` tokens).
        block_hashes: the consumer's chained hash of each of those blocks (16 bytes each); the
            producer refuses a block whose own hash differs.
        remote_block_ids, local_block_ids: where each block lives on either side.
        num_tokens: tokens the load covers (``len(block_indices) * block_size``).
    """

    req_id: str
    engine_id: str
    host: str
    port: int
    transfer_id: str
    block_indices: list[int]
    block_hashes: list[bytes]
    remote_block_ids: list[int]
    local_block_ids: list[int]
    num_tokens: int


@dataclass
class HoldSpec:
    """A producer's finished request whose blocks stay until read or ``lease_s`` seconds pass.

    Attributes:
        req_id, transfer_id: the local request and the name consumers read it by.
        block_ids: its full prompt blocks, in order; block_hashes: their chained hashes.
        lease_s: seconds from registration after which the hold is dropped.
    """

    req_id: str
    transfer_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    lease_s: float


@dataclass
class ReleaseSpec:
    """A consumer needs none of a hold's blocks (its own prefix cache had them all): it only
    tells the producer to free them."""

    engine_id: str
    host: str
    port: int
    transfer_id: str


@dataclass
class KVConnectorMetadata:
    """What the scheduler side planned in one step (plain values: it crosses processes)."""

    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.holds or self.releases)


class KVConnectorScheduler(ABC):
    """Scheduler side (engine core, torch-free)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens after ``num_computed_tokens`` that can be loaded (0 = none), or
        ``WAIT_FOR_OTHER_LOAD``. Called when a request without blocks is about to be admitted."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """Blocks are allocated for ``num_external_tokens`` tokens after ``num_computed_tokens``."""

    @abstractmethod
    def build_connector_meta(self) -> Optional[KVConnectorMetadata]:
        """The plan since the last call, for the worker side (None when there is none)."""

    @abstractmethod
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """``(delay_free, kv_transfer_params)`` for a request that just finished."""

    @abstractmethod
    def load_finished(self, request_id: str) -> list[str]:
        """A load ended; returns the local requests that waited for it (to be admitted now)."""

    def request_dropped(self, request_id: str) -> None:
        """A request waiting on another's load was aborted (forget it)."""

    def has_pending_meta(self) -> bool:
        return False


class KVConnectorWorker(ABC):
    """Worker side (next to the KV cache)."""

    @abstractmethod
    def start_load_kv(self, metadata: Optional[KVConnectorMetadata], finished_req_ids: list[str]) -> None:
        """Start this step's loads and holds; cancel the loads of ``finished_req_ids``."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s KV of this step's requests is loaded (no-op when
        loads complete before a request is scheduled, as in NetworkConnector)."""

    def save_kv_layer(self, layer_idx: int) -> None:
        """Offer layer ``layer_idx``'s new KV for sending (no-op for a pull connector: the
        producer serves reads from its block pool)."""

    @abstractmethod
    def get_finished(self) -> Optional[KVConnectorOutput]:
        """What completed since the last call (None when nothing did)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop threads and close sockets (bounded time)."""
