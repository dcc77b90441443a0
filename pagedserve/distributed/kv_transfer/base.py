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
from typing import Optional

from pagedserve.core.kv_connector import (  # noqa: F401  (the scheduler side's half of the contract)
    WAIT_FOR_OTHER_LOAD,
    HoldSpec,
    KVConnectorMetadata,
    KVConnectorScheduler,
    LoadSpec,
    ReleaseSpec,
)
from pagedserve.core.outputs import KVConnectorOutput


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
