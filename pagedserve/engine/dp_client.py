"""DPClient: N engine-core replicas behind one front (``--data-parallel-size N``), with the
interface of :class:`pagedserve.engine.core_client.MPClient`, so :class:`AsyncLLM` sees one core.

* Replicas: :class:`MPClient` processes on this host (``--data-parallel-backend mp``), each
  pinned to its own ``threads_per_replica`` cores when they fit, or :class:`RayCoreClient`
  actors (``ray``). Each runs with ``data_parallel_size=1`` and, under the ``kv-aware``
  router, publishes its prefix-cache events with every outputs message.
* ADD asks the :class:`DPRouter` for a replica (the request's block hashes computed here with
  the replicas' seed), records request id -> replica and sends it there; ABORT goes to each
  id's replica; ``reset_prefix_cache`` goes to every
  replica (True when all reset), the other utility calls to the first live replica.
* ``recv()`` polls every replica's output socket; each outputs message gets its replica's
  ``engine_index`` (AsyncLLM keeps stats and metrics per engine) and its KV events go to the
  router.
* A replica that dies (process exit, SIGKILL, a dead actor, or a failed step) is taken out of
  rotation: its requests that have produced no output yet are sent again to another replica;
  the others end with an error naming the replica (a FAILED message, which AsyncLLM turns into
  :class:`EngineDeadError` for those requests only); its gauges go to zero. When none is left,
  recv returns an ERROR message and AsyncLLM fails as when its one core dies.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedserve.distributed.dp_router import DPRouter
from pagedserve.engine.dp_utility import UtilityFanout
from pagedserve.messages import (
    AbortRequests,
    AddRequest,
    CoreError,
    SequencesFailed,
)
from pagedserve.messages import (
    EngineCoreEventType as Event,
)
from pagedserve.messages import (
    EngineCoreRequestType as Req,
)

logger = logging.getLogger("pagedserve")

DEATH_CHECK_INTERVAL_S = 0.1


# -- placement: threads per replica and disjoint core sets, so N replicas on one host do not
# fight over cores (each torch/OpenMP pool spins on its own cores)
def threads_per_replica(config: EngineConfig) -> int:
    """``threads_per_replica``, else ``num_threads``, else the usable cores / replicas (>= 1)."""
    if config.threads_per_replica:
        return config.threads_per_replica
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.data_parallel_size)


def plan_cpus(num_replicas: int, threads: int) -> Optional[list[list[int]]]:
    """Disjoint core sets, ``threads`` cores each, from the cores this process may use; None
    (no pinning) when they do not fit."""
    cores = sorted(os.sched_getaffinity(0))
    if num_replicas * threads > len(cores):
        logger.warning(
            "pagedserve: %d replicas x %d threads > %d usable cores: replicas are not pinned and will share cores", num_replicas, threads, len(cores)
        )
        return None
    return [cores[i * threads : (i + 1) * threads] for i in range(num_replicas)]


@dataclass
class _Group:
    """The sequences of one request (they go to one replica together)."""

    children: list[EngineCoreRequest]
    replica: int
    unfinished: set[str]
    hashes: Optional[dict] = None  # the prompt's block hashes per replica seed (kv-aware)
    started: bool = False  # some output came back: it can no longer move to another replica

    def routed_hashes(self, router: DPRouter) -> list[bytes]:
        return self.hashes.get(router.seeds[self.replica], []) if self.hashes else []


class DPClient:
    """Starts ``config.data_parallel_size`` replicas and routes between them.

    Raises (from the constructor): what a replica's start-up raises (ValueError /
    FileNotFoundError for a bad config or model, RuntimeError when it dies or cannot be
    placed); every replica started so far is stopped first.
    """

    def __init__(self, config: EngineConfig, log_level: str = "info") -> None:
        import zmq

        n = config.data_parallel_size
        threads = threads_per_replica(config)
        self.backend = config.data_parallel_backend
        replica_cfg = dataclasses.replace(config, data_parallel_size=1, num_threads=threads)
        kv_events = config.router == "kv-aware" and config.enable_prefix_caching
        self.replicas: list[Any] = []
        self.cpus: list[Optional[list[int]]] = [None] * n
        self._ray = None  # a RayCluster with the ray backend
        self._closed = False
        try:
            if self.backend == "mp":
                from pagedserve.engine.core_client import MPClient

                # A tensor-parallel replica's ranks are its subprocesses and would share its cores.
                plan = plan_cpus(n, threads) if config.pin_replica_cores and config.tensor_parallel_size == 1 else None
                for i in range(n):
                    self.cpus[i] = plan[i] if plan else None
                    self.replicas.append(
                        MPClient(
                            replica_cfg,
                            log_level,
                            kv_events=kv_events,
                            cpus=self.cpus[i],
                            extra_env={"OMP_NUM_THREADS": str(threads)},
                            wait_ready=False,
                        )
                    )
            else:
                from pagedserve.engine import ray_client

                self._ray = ray_client.RayCluster(config.ray_address, n, threads)
                for i in range(n):
                    self.replicas.append(self._ray.start_replica(replica_cfg, i, log_level, kv_events))
            infos: list[EngineCoreInfo] = [r.wait_ready() for r in self.replicas]
        except BaseException:
            self.shutdown()
            raise
        policy = config.router
        if policy == "kv-aware" and not config.enable_prefix_caching:
            logger.warning("pagedserve: --router kv-aware needs prefix caching; routing least-loaded")
            policy = "least-loaded"
        self.router = DPRouter(n, policy, infos[0].config.block_size, seeds=[i.block_hash_seed for i in infos])
        front_cfg = dataclasses.replace(
            infos[0].config,
            data_parallel_size=n,
            num_threads=config.num_threads,
            threads_per_replica=threads,
            max_model_len=min(i.config.max_model_len for i in infos),
        )
        self.info = dataclasses.replace(infos[0], config=front_cfg, num_blocks=sum(i.num_blocks for i in infos))
        self._zmq = zmq
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}  # sequence id -> its request's group
        self._utility = UtilityFanout()
        self._pending: collections.deque = collections.deque()  # messages made here, returned first
        self.replica_stats = [SchedulerStats(num_total_blocks=i.num_blocks, num_free_blocks=i.num_blocks) for i in infos]
        self.dead_reason: list[Optional[str]] = [None] * n
        self._poller = zmq.Poller()
        self._socket_of: dict[Any, int] = {}
        for i, r in enumerate(self.replicas):
            self._poller.register(r._output, zmq.POLLIN)
            self._socket_of[r._output] = i
        self._last_check = 0.0
        self._recv_lock = threading.Lock()  # held by recv: shutdown waits for it, then recv is a no-op
        logger.info("pagedserve: %d engine replicas (%s backend, %d threads each, router %s)", n, self.backend, threads, policy)

    # -- the MPClient interface ------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.replicas[0].pid

    def is_alive(self) -> bool:
        return any(self.router.alive)

    def engine_of(self, request_id: str) -> int:
        """The replica a live sequence runs on (0 when unknown)."""
        g = self._groups.get(request_id)
        return g.replica if g is not None else 0

    def send(self, msg: tuple) -> None:
        kind, payload = msg
        if kind is Req.ADD:
            children = list(payload.requests)
            first = children[0]
            hashes = self.router.request_hashes(first.prompt_token_ids, first.cache_salt, first.lora_key) if self.router.wants_hashes() else None
            with self._lock:
                self._route(_Group(children, -1, {c.request_id for c in children}, hashes))
        elif kind is Req.ABORT:
            by_replica: dict[int, list[str]] = collections.defaultdict(list)
            with self._lock:
                for rid in payload.request_ids:
                    g = self._groups.pop(rid, None)
                    if g is not None and rid in g.unfinished:
                        self._finish_sequence(g, rid)
                        by_replica[g.replica].append(rid)
                for i, ids in by_replica.items():
                    self.replicas[i].send((Req.ABORT, AbortRequests(ids)))
        elif kind is Req.UTILITY:
            with self._lock:
                targets = self._utility.targets(payload.name, self.router.alive)
                for i in targets:
                    self.replicas[i].send(msg)
                self._pending.extend(self._utility.start(payload.call_id, payload.name, targets))
        else:
            for i, ok in enumerate(self.router.alive):
                if ok:
                    self.replicas[i].send(msg)

    def _route(self, g: _Group) -> None:
        """Send a group to the router's choice (under the lock)."""
        i = self.router.choose(g.hashes)
        g.replica = i
        for rid in g.unfinished:
            self._groups[rid] = g
        self.router.load[i] += len(g.unfinished)
        self.router.note_routed(i, g.routed_hashes(self.router))
        self.replicas[i].send((Req.ADD, AddRequest(g.children)))

    def _finish_sequence(self, g: _Group, rid: str) -> None:
        """One sequence of ``g`` ended (finished or aborted; under the lock)."""
        g.unfinished.discard(rid)
        self._groups.pop(rid, None)
        self.router.load[g.replica] -= 1
        if not g.unfinished:
            self.router.note_done(g.replica, g.routed_hashes(self.router))

    def recv(self, timeout_s: Optional[float]) -> Optional[tuple]:
        """The next message for AsyncLLM (only one thread may call this)."""
        with self._recv_lock:
            if self._closed:
                return None
            return self._recv(timeout_s)

    def _recv(self, timeout_s: Optional[float]) -> Optional[tuple]:
        if self._pending:
            return self._pending.popleft()
        try:
            ready = self._poller.poll(None if timeout_s is None else int(timeout_s * 1000))
        except self._zmq.ZMQError:  # closed by shutdown
            return None
        for sock, _ in ready:
            i = self._socket_of.get(sock)
            if i is not None and self.router.alive[i]:
                msg = self.replicas[i].recv(0)
                if msg is not None:
                    self._on_message(i, msg)
        # Every 0.1 s, even while other replicas keep sending (a busy one hid a dead one).
        if time.monotonic() - self._last_check >= DEATH_CHECK_INTERVAL_S:
            self._last_check = time.monotonic()
            for i, r in enumerate(self.replicas):
                if self.router.alive[i] and not r.is_alive():
                    while (msg := r.recv(0)) is not None:  # what it sent before dying comes first
                        self._on_message(i, msg)
                    if self.router.alive[i]:
                        self._replica_died(i, f"engine replica {i} died ({self._describe(i)})")
        return self._pending.popleft() if self._pending else None

    def _describe(self, i: int) -> str:
        proc = self.replicas[i].proc
        return getattr(proc, "death", None) or f"exit status {proc.returncode}"

    def _on_message(self, i: int, msg: tuple) -> None:
        kind, payload = msg
        if kind is Event.OUTPUTS:
            out: EngineCoreOutputs = payload
            out.engine_index = i
            with self._lock:
                if out.kv_events:
                    self.router.apply_events(i, out.kv_events)
                    out.kv_events = None
                if out.scheduler_stats is not None:
                    self.replica_stats[i] = out.scheduler_stats
                for o in out.outputs:
                    g = self._groups.get(o.request_id)
                    if g is None:
                        continue
                    g.started, g.children = True, []  # no retry once anything came back
                    if o.finish_reason is not None and o.request_id in g.unfinished:
                        self._finish_sequence(g, o.request_id)
            self._pending.append(msg)
        elif kind is Event.UTILITY:
            with self._lock:
                self._pending.extend(self._utility.answer(i, payload.call_id, payload.result, payload.error))
        elif kind is Event.ERROR:
            self._replica_died(i, f"engine replica {i} failed: {payload.kind}: {payload.message}")

    def _replica_died(self, i: int, reason: str) -> None:
        logger.error("pagedserve: %s; taking it out of rotation", reason)
        with self._lock:
            self.router.mark_dead(i)
            self.dead_reason[i] = reason
            failed: list[str] = []
            moved = 0
            for g in {id(g): g for g in self._groups.values() if g.replica == i}.values():
                if not g.started and any(self.router.alive):
                    self._route(g)
                    moved += 1
                else:
                    failed.extend(g.unfinished)
                    for rid in g.unfinished:
                        self._groups.pop(rid, None)
            self._pending.extend(self._utility.replica_died(i, reason))
            s = self.replica_stats[i]  # its gauges to zero, its counters kept, no per-step values
            per_step = {f.name: [] for f in dataclasses.fields(s) if isinstance(getattr(s, f.name), list)}
            self.replica_stats[i] = dataclasses.replace(s, num_running=0, num_waiting=0, num_free_blocks=s.num_total_blocks, **per_step)
        if moved:
            logger.warning("pagedserve: %d requests that had produced nothing yet were sent to another replica", moved)
        if failed:
            self._pending.append((Event.FAILED, SequencesFailed(failed, reason)))
        self._pending.append((Event.OUTPUTS, EngineCoreOutputs([], time.monotonic(), self.replica_stats[i], engine_index=i)))
        if not any(self.router.alive):
            self._pending.append((Event.ERROR, CoreError("EngineDeadError", f"every engine replica died (last: {reason})")))
        try:
            self._poller.unregister(self.replicas[i]._output)
        except KeyError:
            pass
        self._stop_replica(self.replicas[i], 1.0)

    def _stop_replica(self, replica: Any, timeout_s: float) -> None:
        if self._ray is not None:  # Ray calls on Ray's thread
            self._ray.call(replica.shutdown, timeout_s)
        else:
            replica.shutdown(timeout_s)

    def replica_status(self) -> list[dict[str, Any]]:
        """Per replica: engine index, alive, pid, where it runs, pinned cores, in-flight
        sequences, cached blocks the router knows of, and why it died."""
        with self._lock:
            return [
                {
                    "engine": i,
                    "alive": self.router.alive[i],
                    "backend": self.backend,
                    "pid": r.pid,
                    "node": getattr(r, "node_ip", "localhost"),
                    "cpus": self.cpus[i],
                    "in_flight": self.router.load[i],
                    "cached_blocks": len(self.router.cached[i]),
                    "error": self.dead_reason[i],
                }
                for i, r in enumerate(self.replicas)
            ]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every replica (side by side, each within ``timeout_s``), then the placement
        group and a Ray head this client started; idempotent."""
        if self._closed:
            return
        self._closed = True
        recv_lock = getattr(self, "_recv_lock", None)
        if recv_lock is not None and recv_lock.acquire(timeout=timeout_s):  # a recv in progress finishes first
            recv_lock.release()  # later ones see _closed and return None
        threads = [threading.Thread(target=self._stop_replica, args=(r, timeout_s), daemon=True) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 10)
        if self._ray is not None:
            self._ray.shutdown()
