"""How the tensor-parallel executor starts and stops its ranks > 0: as subprocesses (``mp``) or
as Ray actors (``ray``). Both run :func:`pagedserve.executor.worker_proc.run_worker`, which
talks to rank 0 over the same ZeroMQ control socket; only the process launcher differs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Optional

logger = logging.getLogger("pagedserve")


class MpLauncher:
    """Ranks ``1..N-1`` as ``python -m pagedserve.executor.worker_proc`` children of this process
    (they exit when it does: they check their parent pid)."""

    def __init__(self, threads_per_rank: int) -> None:
        self.threads = threads_per_rank
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, control_address: str, world_size: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        for rank in range(1, world_size):
            cmd = [
                sys.executable,
                "-m",
                "pagedserve.executor.worker_proc",
                "--control-address",
                control_address,
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--parent-pid",
                str(os.getpid()),
                "--log-level",
                logging.getLevelName(logger.getEffectiveLevel()).lower(),
            ]
            self.procs[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    def check_alive(self) -> None:
        """Raises RuntimeError naming the first rank whose process has exited."""
        for rank, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with status {rc}")

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the ranks to exit (after their shutdown message), then kill them."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
        self.procs.clear()


class RayLauncher:
    """Ranks ``1..N-1`` as Ray actors (one CPU each for placement). Connects to the running Ray
    instance when this process has one (``ray.init`` called before), else ``ray.init()`` (which
    honours ``RAY_ADDRESS``; without it, a local instance) and shuts that down in :meth:`stop`.
    Ray kills the actors if this process (their owner) dies."""

    def __init__(self, threads_per_rank: int) -> None:
        try:
            import ray
        except ImportError as e:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedserve[ray]' (ray==2.60.0)") from e
        self.ray = ray
        self.threads = threads_per_rank
        self.owns_ray = False
        self.actors: dict[int, object] = {}
        self.runs: dict[int, object] = {}

    def start(self, control_address: str, world_size: int) -> None:
        ray = self.ray
        if not ray.is_initialized():
            kwargs = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(os.cpu_count() or 1, world_size - 1)}
            ray.init(include_dashboard=False, log_to_driver=True, **kwargs)
            self.owns_ray = True
        from pagedserve.executor.worker_proc import RayWorker

        # Ray's workers import pagedserve from where this process does (an editable checkout too).
        root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["pagedserve"].__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {"PYTHONPATH": path, "OMP_NUM_THREADS": str(self.threads)}
        actor_cls = ray.remote(num_cpus=1)(RayWorker)
        for rank in range(1, world_size):
            actor = actor_cls.options(name=None, runtime_env={"env_vars": env}).remote()
            self.actors[rank] = actor
            self.runs[rank] = actor.run.remote(control_address, rank, world_size)

    def check_alive(self) -> None:
        """Raises RuntimeError naming the first rank whose actor has stopped."""
        done, _ = self.ray.wait(list(self.runs.values()), num_returns=1, timeout=0)
        if not done:
            return
        rank = next(r for r, ref in self.runs.items() if ref == done[0])
        try:
            status = self.ray.get(done[0], timeout=1.0)
        except Exception as e:  # the actor died (RayActorError) or raised
            status = f"{type(e).__name__}: {e}"
        raise RuntimeError(f"tensor-parallel worker rank {rank} (Ray actor) stopped: {status}")

    def stop(self, timeout_s: float) -> None:
        ray = self.ray
        if not ray.is_initialized():  # shut down already (e.g. by Ray's own exit handler)
            self.actors.clear()
            self.runs.clear()
            return
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception as e:  # already gone
                logger.debug("ray.kill: %s", e)
        self.actors.clear()
        self.runs.clear()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False


def make_launcher(backend: str, threads_per_rank: int):
    """``mp`` or ``ray``; raises ValueError for anything else."""
    if backend == "mp":
        return MpLauncher(threads_per_rank)
    if backend == "ray":
        return RayLauncher(threads_per_rank)
    raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")


def default_threads(num_threads: Optional[int], world_size: int) -> int:
    """Torch threads of each rank: ``num_threads`` (default: the cores this process may use)
    split across the ranks, at least 1."""
    total = num_threads if num_threads is not None else len(os.sched_getaffinity(0))
    return max(1, total // world_size)
