"""A tensor-parallel worker of rank > 0: ``python -m pagedserve.executor.worker_proc`` (started
by the ``mp`` launcher), or :func:`run_worker` inside a Ray actor (the ``ray`` launcher).

It connects a DEALER socket to rank 0's control socket (ZeroMQ, the typed messages of
:mod:`pagedserve.messages`, :class:`WorkerMessageType`; never pickle) and follows rank 0:

- out HELLO (rank, pid); in INIT (config, host, the torch.distributed store's address): join the
  group, load and shard the model, size the KV cache; out READY (rank, the most KV blocks this
  rank can hold);
- in INIT_CACHE (config, num_blocks): allocate the pool rank 0 decided;
- in STEP (a ``SchedulerOutput``): run it (the collectives pair it with the other ranks' step;
  rank 0 samples and sends the tokens);
- in SHUTDOWN: exit 0.

Any exception is sent as ERROR (rank, type name, message) and the worker exits 1. While
idle it checks every second that its parent (the engine core) is alive and exits when not;
under Ray the actor shares its owner's fate instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from typing import Optional

logger = logging.getLogger("pagedserve")

IDLE_POLL_MS = 1000


def device_for_rank(device: str, rank: int):
    """The torch device of ``rank``: CUDA ranks take one GPU each (``cuda:i`` counts from i)."""
    from pagedserve.worker.worker import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        return dev
    import torch

    return torch.device("cuda", ((dev.index or 0) + rank) % torch.cuda.device_count())


def run_worker(control_address: str, rank: int, world_size: int, parent_pid: Optional[int] = None) -> int:
    """Serve rank ``rank`` of ``world_size`` until shutdown (0), a failure (1, reported to rank
    0) or the death of ``parent_pid`` (0). Returns the exit status."""
    import zmq

    from pagedserve import messages
    from pagedserve.messages import InitCache, WorkerError, WorkerHello, WorkerReady
    from pagedserve.messages import WorkerMessageType as W

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(control_address)

    def send(kind: W, payload: object) -> None:
        sock.send(messages.encode((kind, payload)), copy=False)

    def recv() -> Optional[tuple]:
        """The next (type, payload), or None when the parent is gone. Raises ValueError on a
        message that is not rank 0's."""
        while not sock.poll(IDLE_POLL_MS):
            if parent_pid is not None and os.getppid() != parent_pid:
                logger.warning("pagedserve TP worker %d: the engine core is gone; exiting", rank)
                return None
        return messages.check(messages.decode(sock.recv(copy=False).buffer), W)

    try:
        send(W.HELLO, WorkerHello(rank, os.getpid()))
        msg = recv()
        if msg is None:
            return 0
        kind, init = msg
        if kind is not W.INIT:
            raise RuntimeError(f"expected an init message, got {kind.name}")
        from pagedserve.distributed.parallel_state import TPGroup, connect_store
        from pagedserve.worker.worker import Worker

        config = init.config
        group = TPGroup(connect_store(init.store_spec, world_size), rank, world_size, device_for_rank(config.device, rank), init.host)
        worker = Worker(config, group)
        send(W.READY, WorkerReady(rank, worker.kv_spec.num_blocks))
        while True:
            msg = recv()
            if msg is None or msg[0] is W.SHUTDOWN:
                return 0
            kind, payload = msg
            if kind is W.STEP:
                worker.execute_model(payload)
            elif kind is W.INIT_CACHE:
                assert isinstance(payload, InitCache)
                worker.initialize_cache(payload.config, payload.num_blocks)
            else:
                raise RuntimeError(f"unexpected control message {kind.name}")
    except BaseException as e:
        logger.error("pagedserve TP worker %d failed:\n%s", rank, traceback.format_exc())
        try:
            send(W.ERROR, WorkerError(rank, type(e).__name__, str(e)))
        except Exception:
            pass
        return 1
    finally:
        sock.close()
        ctx.term()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="pagedserve tensor-parallel worker (started by the engine core)")
    ap.add_argument("--control-address", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    # Ctrl-C or a supervisor's SIGTERM reaches the whole process group: the engine core stops
    # its workers itself (a shutdown message, then a kill after a timeout).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO), format=f"%(levelname)s %(asctime)s %(name)s[tp{args.rank}]: %(message)s"
    )
    return run_worker(args.control_address, args.rank, args.world_size, args.parent_pid)


class RayWorker:
    """The same worker as a Ray actor (wrapped by ``ray.remote`` in the executor)."""

    def run(self, control_address: str, rank: int, world_size: int) -> int:
        return run_worker(control_address, rank, world_size, None)


if __name__ == "__main__":
    sys.exit(main())
