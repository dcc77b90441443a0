"""The scheduler's side of a KV connector, as the engine core sees it (torch-free): the
interface it calls (:class:`KVConnectorScheduler`, after vLLM's ``KVConnectorBase_V1``) and the
plain-value plan that travels to the worker side inside the ``SchedulerOutput``. The connectors
themselves live in :mod:`pagedserve.distributed.kv_transfer` (see its ``base`` for the whole
contract and the worker side).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

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
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int) -> None:
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
