"""The tensor-parallel group of one engine: rank, world size and the collectives the sharded
model needs, over torch.distributed (gloo on CPU, NCCL on CUDA).

The group is a process-group object of its own (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a
``FileStore`` when every rank is on this machine, a ``TCPStore`` when ``--distributed-host`` is
given), not torch.distributed's global default group, so one process can hold several engines
(and a user's own default group is left alone). Rank 0 hosts the store; gloo binds to loopback
unless a host is given.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_HOST = "127.0.0.1"
# Bounds a collective's wait for a peer that hangs; a peer that dies fails it at once (the
# socket closes), so this only matters for a stuck process.
COLLECTIVE_TIMEOUT_S = 300.0


def create_store(host: Optional[str], world_size: int, timeout_s: float = 120.0) -> tuple[dist.Store, list]:
    """Rank 0's rendezvous store and how the other ranks reach it (``["file", path]`` or
    ``["tcp", host, port]``). With no host (every rank on this machine) it is a ``FileStore`` in
    a private folder, so nothing listens on the network: torch's ``TCPStore`` master listens on
    every interface whatever host it is given. With a host (ranks on other nodes), a
    ``TCPStore`` on a free port."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if host is None:
        path = os.path.join(tempfile.mkdtemp(prefix="pagedserve-tp-"), "store")
        store = dist.FileStore(path, world_size)
        store.set_timeout(timeout)
        return store, ["file", path]
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    return store, ["tcp", host, store.port]


def connect_store(spec: list, world_size: int, timeout_s: float = 120.0) -> dist.Store:
    """A non-zero rank's client of rank 0's store (``spec`` from :func:`create_store`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if spec[0] == "file":
        store = dist.FileStore(spec[1], world_size)
        store.set_timeout(timeout)
        return store
    return dist.TCPStore(spec[1], spec[2], world_size, is_master=False, timeout=timeout)


def remove_store(spec: list) -> None:
    """Delete a file store's private folder (no-op for a TCP store)."""
    if spec and spec[0] == "file":
        shutil.rmtree(os.path.dirname(spec[1]), ignore_errors=True)


class TPGroup:
    """Collectives of the ranks of one tensor-parallel engine.

    Args:
        store: the rendezvous store (``create_store`` on rank 0, ``connect_store`` elsewhere).
        rank, world_size: this process's rank in ``[0, world_size)``.
        device: the model's device; CUDA selects NCCL, anything else gloo.
        host: the address gloo's sockets bind to (default 127.0.0.1).
    Raises:
        RuntimeError: the rendezvous failed or timed out (from torch.distributed).
    """

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, device: torch.device, host: Optional[str] = None, timeout_s: float = COLLECTIVE_TIMEOUT_S
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        timeout = datetime.timedelta(seconds=timeout_s)
        # A prefix per group: a store could be shared by several groups.
        store = dist.PrefixStore("tp/", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host or DEFAULT_HOST)]
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, opts)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (contiguous) across ranks, in place; returns ``t``."""
        self.pg.allreduce([t]).wait()
        return t

    def gather_last_dim(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Rank 0: every rank's ``t [n, d]`` concatenated along the last dim, ``[n, world * d]``;
        other ranks: None. Every rank's ``t`` must have the same shape."""
        t = t.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self.pg.gather([parts], [t], _gather_options(0)).wait()
            return torch.cat(parts, dim=-1)
        self.pg.gather([], [t], _gather_options(0)).wait()
        return None

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Rank ``root``'s ``t`` copied into every rank's ``t`` (same shape and dtype), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([t], opts).wait()
        return t

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))


def _gather_options(root: int) -> dist.GatherOptions:
    opts = dist.GatherOptions()
    opts.rootRank = root
    return opts
