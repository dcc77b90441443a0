"""What the engine core runs its steps on: the in-process :class:`Worker` itself when
``tensor_parallel_size`` is 1 (nothing in between), else a :class:`TPExecutor`.

The TP executor hosts rank 0 in the engine core's process and starts ranks ``1..N-1`` with a
launcher (``mp`` subprocesses or ``ray`` actors, :mod:`pagedserve.executor.launchers`). Every
step is a collective call (vLLM's ``execute_model``): the same :class:`SchedulerOutput` goes to
every rank over a ZeroMQ ROUTER socket (:mod:`pagedserve.messages`, never pickle), then rank 0
runs its share; the ranks meet in the model's collectives, rank 0 samples, returns the
:class:`ModelRunnerOutput` and broadcasts the tokens to the others.
Start-up: ``hello`` from each rank, ``init`` (config and the torch.distributed store's address),
the group forms, every rank loads and shards its weights and reports the KV blocks it can hold;
rank 0 takes the smallest and every rank allocates that many. The control socket and the store
bind to ``distributed_host`` (default 127.0.0.1) on free ports.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any, Optional, Union

from pagedserve import messages
from pagedserve.config import EngineConfig
from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.sched.output import SchedulerOutput
from pagedserve.distributed.parallel_state import DEFAULT_HOST, TPGroup, create_store, remove_store
from pagedserve.distributed.tensor_parallel import verify_tp_size
from pagedserve.executor.launchers import default_threads, make_launcher
from pagedserve.executor.worker_proc import device_for_rank
from pagedserve.messages import InitCache, WorkerError, WorkerInit
from pagedserve.messages import WorkerMessageType as W
from pagedserve.model import loader
from pagedserve.worker.worker import Worker

logger = logging.getLogger("pagedserve")

START_TIMEOUT_S = 180.0  # for every rank's hello (process start and imports, or Ray placement)
STOP_TIMEOUT_S = 5.0
_ERRORS = {"ValueError": ValueError, "ModelFileError": ValueError, "FileNotFoundError": FileNotFoundError}


def create_executor(config: EngineConfig) -> Union[Worker, "TPExecutor"]:
    """The executor for ``config``. Raises ValueError for a tensor-parallel size the model's head
    counts do not divide (before any process starts), and the Worker's errors."""
    if config.tensor_parallel_size == 1:
        return Worker(config)
    return TPExecutor(config)


class TPExecutor:
    """Rank 0's :class:`Worker` plus ranks ``1..N-1`` elsewhere, behind the Worker's interface
    (``kv_spec``, ``initialize_cache``, ``execute_model``, ``model_runner`` of rank 0 ...).

    Raises:
        ValueError / FileNotFoundError: a bad config or model, from any rank.
        RuntimeError: a rank failed or died (at start-up, or in a step: the engine then fails).
    """

    def __init__(self, config: EngineConfig) -> None:
        import zmq

        n = config.tensor_parallel_size
        verify_tp_size(loader.load_config(loader.resolve_model(config.model)), n)
        if device_for_rank(config.device, 0).type == "cuda":
            import torch

            if n > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (one per rank), {torch.cuda.device_count()} visible")
        self.world_size = n
        threads = default_threads(config.num_threads, n)
        rank_config = dataclasses.replace(config, num_threads=threads)
        host = config.distributed_host or DEFAULT_HOST
        self._launcher = make_launcher(config.distributed_executor_backend, threads)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._finalizer = weakref.finalize(self, _stop, self._launcher, self._sock, self._ctx)
        self._idents = [f"rank{r}".encode() for r in range(1, n)]
        self.worker: Worker = None  # type: ignore[assignment]  # set below, or the constructor raises
        t0 = time.monotonic()
        try:
            self._launcher.start(f"tcp://{host}:{port}", n)
            self._pids = {r: hello.pid for r, hello in self._wait_all(W.HELLO, START_TIMEOUT_S).items()}
            store, spec = create_store(config.distributed_host, n)
            weakref.finalize(self, remove_store, spec)
            self._broadcast(W.INIT, WorkerInit(rank_config, host, spec))
            group = TPGroup(store, 0, n, device_for_rank(config.device, 0), host)
            self.worker = Worker(rank_config, group)
            blocks = {r: ready.num_blocks for r, ready in self._wait_all(W.READY, None).items()}
            remove_store(spec)  # every rank has joined: the group needs its store no more
            num_blocks = min([self.worker.kv_spec.num_blocks, *blocks.values()])
            self.worker.kv_spec = self.worker.kv_spec_for(num_blocks)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "pagedserve: tensor parallel x%d (%s backend), %d torch threads per rank, started in %.1fs",
            n,
            config.distributed_executor_backend,
            threads,
            time.monotonic() - t0,
        )

    # -- the Worker's interface (rank 0's values) -------------------------------------------
    model_dir = property(lambda self: self.worker.model_dir)
    hf_config = property(lambda self: self.worker.hf_config)
    dtype = property(lambda self: self.worker.dtype)
    device = property(lambda self: self.worker.device)
    model_identity = property(lambda self: self.worker.model_identity)
    kv_spec = property(lambda self: self.worker.kv_spec)
    model_runner = property(lambda self: self.worker.model_runner)

    def initialize_cache(self, config: EngineConfig) -> None:
        num_blocks = self.worker.kv_spec.num_blocks
        self._broadcast(W.INIT_CACHE, InitCache(config, num_blocks))
        self.worker.initialize_cache(config, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's sampled tokens.

        Raises:
            RuntimeError: a rank has died or failed (its error message when it sent one).
        """
        self._launcher.check_alive()
        self._broadcast(W.STEP, scheduler_output)
        try:
            return self.worker.execute_model(scheduler_output)
        except RuntimeError as e:  # a collective failed: say which rank and why, if it told us
            raise RuntimeError(f"tensor-parallel step failed: {self._worker_error(1.0) or e}") from e

    def worker_pids(self) -> dict[int, int]:
        """Process ids of ranks 1..N-1 (as each reported at start)."""
        return dict(self._pids)

    def shutdown(self) -> None:
        """Stop every rank (a shutdown message, then a kill after a few seconds) and, with the
        ray backend, Ray itself if this executor started it. Idempotent."""
        if self._finalizer.alive:
            try:
                self._broadcast(W.SHUTDOWN, None)
            except RuntimeError:
                pass
            self._finalizer()

    # -- control socket -------------------------------------------------------------------
    def _broadcast(self, kind: W, payload: object) -> None:
        data = messages.encode((kind, payload))
        for ident in self._idents:
            try:
                self._sock.send_multipart([ident, data], copy=False)
            except self._zmq.ZMQError as e:  # EHOSTUNREACH: the rank's socket is gone
                raise RuntimeError(f"tensor-parallel worker {ident.decode()} is unreachable: {e}") from e

    def _wait_all(self, kind: W, timeout_s: Optional[float]) -> dict[int, Any]:
        """Each rank's first ``kind`` message's payload, by rank; raises the error a rank sent,
        RuntimeError when a rank dies or the timeout passes."""
        got: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(got) < self.world_size - 1:
            if self._sock.poll(200):
                _, data = self._sock.recv_multipart()
                got_kind, payload = messages.check(messages.decode(data), W)
                if isinstance(payload, WorkerError):
                    raise _ERRORS.get(payload.kind, RuntimeError)(f"tensor-parallel worker rank {payload.rank}: {payload.message}")
                if got_kind is kind:
                    got[payload.rank] = payload
                continue
            self._launcher.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world_size)) - set(got))
                raise RuntimeError(f"tensor-parallel workers {missing} did not start within {timeout_s:.0f}s")
        return got

    def _worker_error(self, wait_s: float) -> Optional[str]:
        if self._sock.poll(int(wait_s * 1000)):
            _, payload = messages.check(messages.decode(self._sock.recv_multipart()[1]), W)
            if isinstance(payload, WorkerError):
                return f"worker rank {payload.rank}: {payload.kind}: {payload.message}"
        try:
            self._launcher.check_alive()
        except RuntimeError as e:
            return str(e)
        return None


def _stop(launcher, sock, ctx) -> None:
    try:
        launcher.stop(STOP_TIMEOUT_S)
    finally:
        sock.close(linger=0)
        ctx.term()
