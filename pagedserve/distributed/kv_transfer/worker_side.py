"""NetworkConnector, worker side: the producer's :class:`KVServer` and the consumer's
:class:`KVLoader` beside the KV pool, driven by the metadata of each step."""

from __future__ import annotations

from typing import Optional

import torch

from pagedserve.config import KVTransferConfig
from pagedserve.core.outputs import KVConnectorOutput
from pagedserve.distributed.kv_transfer.base import KVConnectorMetadata, KVConnectorWorker
from pagedserve.distributed.kv_transfer.consumer import PEER_DOWN_S, KVLoader
from pagedserve.distributed.kv_transfer.producer import KVServer


class NetworkConnectorWorker(KVConnectorWorker):
    """Args:
        config: the instance's KV transfer config.
        kv_cache: the pool, ``[layers, 2, num_blocks, kv_heads, block_size, head_dim]`` (int8:
            ``[layers, 2, num_blocks, kv_heads, cell_bytes]``, see :mod:`pagedserve.ops.kv_int8`).
        layout: :func:`pagedserve.distributed.kv_transfer.wire.kv_layout` of this instance.
    Raises:
        ValueError: a producer's transfer port cannot be bound.
    """

    def __init__(self, config: KVTransferConfig, kv_cache: torch.Tensor, layout: dict) -> None:
        self.server = KVServer(kv_cache, layout, config.engine_id, config.kv_ip, config.kv_port) if config.is_producer else None
        peer_down_s = float(config.kv_connector_extra_config.get("peer_down_s", PEER_DOWN_S))
        self.loader = KVLoader(kv_cache, layout, config.kv_transfer_timeout_s, peer_down_s) if config.is_consumer else None

    def start_load_kv(self, metadata: Optional[KVConnectorMetadata], finished_req_ids: list[str]) -> None:
        if self.loader is not None and finished_req_ids:
            self.loader.cancel(finished_req_ids)
        if metadata is None:
            return
        if self.server is not None:
            for hold in metadata.holds:
                self.server.add_hold(hold)
        if self.loader is not None:
            for load in metadata.loads:
                self.loader.submit(load)
            for release in metadata.releases:
                self.loader.release(release)

    def get_finished(self) -> Optional[KVConnectorOutput]:
        out = KVConnectorOutput()
        if self.server is not None:
            out.finished_sending, out.sent_tokens, failures = self.server.take_finished()
            out.failures.update(dict(failures))
        if self.loader is not None:
            out.finished_recving, out.failed_recving, out.received_tokens, out.transfer_seconds, failures = self.loader.take_finished()
            for k, v in failures.items():
                out.failures[k] = out.failures.get(k, 0) + v
        return None if out.is_empty else out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        if self.loader is not None:
            self.loader.shutdown()
