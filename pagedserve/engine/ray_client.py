"""Engine cores as Ray actors (``--data-parallel-backend ray``): the replicas of a
data-parallel server placed on whatever nodes a Ray cluster has.

Each replica is an :class:`EngineCoreActor` scheduled into one bundle (``{"CPU": threads}``)
of a placement group with the ``SPREAD`` strategy (replicas on different nodes when the
cluster has them). The actor runs the same busy loop as the engine-core process
(:func:`pagedserve.engine.core_proc.serve_core`) and talks to the front over ZeroMQ PUSH/PULL
on TCP, msgpack-encoded as on one host; Ray only places, starts and kills it. The front binds
its sockets on loopback when it started a local Ray head, and on this node's IP only when it
joined a cluster (``--ray-address``); those sockets are unauthenticated, like Ray's own ports,
so a cluster must sit on a trusted network.

An actor is owned by the server's Ray driver: if the server dies, Ray stops its actors.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import STARTUP_TIMEOUT_S, MPClient
from pagedserve.messages import EngineCoreRequestType as Req

logger = logging.getLogger("pagedserve")

PLACEMENT_TIMEOUT_S = 60.0


class EngineCoreActor:
    """The Ray actor hosting one engine core (``ray.remote`` is applied at start-up)."""

    def where(self) -> tuple[int, str]:
        import ray

        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, input_address: str, output_address: str, config: dict, kv_events: bool, log_level: str) -> int:
        """The busy loop; returns when the front sends shutdown (0) or a step fails (1)."""
        from pagedserve.engine.core_proc import serve_core

        logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(levelname)s %(asctime)s %(name)s[core]: %(message)s")
        return serve_core(input_address, output_address, config, parent_alive=lambda: True, kv_events=kv_events)


def init_ray(address: Optional[str], num_cpus: int) -> bool:
    """Connect this process to Ray: to the cluster at ``address`` ("auto", "host:port"), or
    to a new local head with at least ``num_cpus`` logical CPUs when ``address`` is None.
    Returns True when this call started a head (the caller stops it with ``ray.shutdown()``).
    Reuses a connection this process already has (returns False)."""
    # Ray's C++ failure-signal handler takes SIGTERM from the server's drain and aborts the
    # process at exit (status -6 after a clean shutdown); it is read when ray is first imported.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError:
        raise ValueError("--data-parallel-backend ray needs the ray package: pip install 'pagedserve[ray]'") from None

    if ray.is_initialized():
        return False
    # Workers import the same pagedserve as this process (a checkout run from its folder).
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}}
    if address is None:
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, num_cpus),
            include_dashboard=False,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
        )
        return True
    ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    return False


def bind_host(started_local: bool) -> str:
    """Where the front's sockets listen: loopback for a local head, else this node's IP."""
    import ray

    return "127.0.0.1" if started_local else ray.util.get_node_ip_address()


def placement_group(num_replicas: int, threads: int) -> Any:
    """A placement group of one ``{"CPU": threads}`` bundle per replica, once it is ready.

    Raises:
        RuntimeError: the cluster cannot place it within ``PLACEMENT_TIMEOUT_S``.
    """
    import ray
    from ray.util.placement_group import placement_group as make_pg
    from ray.util.placement_group import remove_placement_group

    pg = make_pg([{"CPU": threads}] * num_replicas, strategy="SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not place {num_replicas} replicas of {threads} CPUs each within {PLACEMENT_TIMEOUT_S:.0f} s "
            f"(cluster resources: {ray.cluster_resources()})"
        )
    return pg


class _ActorProcess:
    """The part of ``subprocess.Popen`` that :class:`MPClient` uses, over a running actor."""

    def __init__(self, actor: Any, run_ref: Any, pid: int) -> None:
        self.actor, self._ref, self.pid = actor, run_ref, pid
        self.returncode: Optional[int] = None
        self.death: Optional[str] = None

    def poll(self) -> Optional[int]:
        import ray

        if self.returncode is None and ray.wait([self._ref], timeout=0)[0]:
            try:
                self.returncode = int(ray.get(self._ref))
            except Exception as e:  # ray.exceptions.RayActorError: killed, or its node died
                self.returncode, self.death = -1, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        import ray

        if self.poll() is None:
            if not ray.wait([self._ref], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired("ray actor", timeout or 0)
        return self.poll()  # type: ignore[return-value]

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayCoreClient(MPClient):
    """:class:`MPClient`'s interface over an engine core in a Ray actor (bundle
    ``bundle_index`` of ``pg``), its sockets on TCP at ``host``. Start-up waits as MPClient's
    (``wait_ready``); ``node_ip`` says where the actor runs."""

    def __init__(
        self,
        config: EngineConfig,
        pg: Any,
        bundle_index: int,
        host: str,
        log_level: str = "info",
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        *,
        kv_events: bool = False,
        wait_ready: bool = True,
    ) -> None:
        import ray
        import zmq
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedserve import messages

        self._messages, self._zmq = messages, zmq
        self._dir = None
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        in_port = self._input.bind_to_random_port(f"tcp://{host}")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        out_port = self._output.bind_to_random_port(f"tcp://{host}")
        self._send_lock = threading.Lock()
        self._startup_timeout_s = startup_timeout_s
        threads = config.num_threads or 1
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index)
        try:
            actor = ray.remote(EngineCoreActor).options(num_cpus=threads, scheduling_strategy=strategy, max_restarts=0).remote()
            pid, self.node_ip = ray.get(actor.where.remote(), timeout=startup_timeout_s)
            run_ref = actor.run.remote(f"tcp://{host}:{in_port}", f"tcp://{host}:{out_port}", config.to_dict(), kv_events, log_level)
        except BaseException:
            self._close_sockets()
            raise
        self.proc = _ActorProcess(actor, run_ref, pid)  # type: ignore[assignment]
        if wait_ready:
            self.wait_ready()

    def _close_sockets(self) -> None:
        with self._send_lock:
            if not self._ctx.closed:
                self._input.close(linger=0)
                self._output.close(linger=0)
                self._ctx.term()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait up to ``timeout_s``, then kill the actor; idempotent."""
        import ray

        if self.proc.poll() is None:
            self.send((Req.SHUTDOWN, None))
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            ray.kill(self.proc.actor, no_restart=True)  # frees its bundle's worker process now
        except Exception:  # already gone, or Ray is shutting down
            pass
        self._close_sockets()


class RayCluster:
    """Ray for one data-parallel front: the connection (or a local head), the placement group
    and the replicas' actors.

    Every Ray control call (init, placement, actor start and kill, shutdown) runs on one
    thread of its own (``call``), which lives as long as this object: Ray's driver crashes in
    ``remove_placement_group`` when the thread that called ``ray.init`` has exited (the server
    starts its engine on a loading thread that ends once it is up).

    Raises (from the constructor): ValueError when ray is not installed; RuntimeError when
    the cluster cannot place the replicas.
    """

    def __init__(self, address: Optional[str], num_replicas: int, threads: int) -> None:
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-ray")
        self._closed = False
        self.started_local = False
        self.pg = None
        try:
            self.started_local = self.call(init_ray, address, num_replicas * threads)
            self.host = self.call(bind_host, self.started_local)
            self.pg = self.call(placement_group, num_replicas, threads)
        except BaseException:
            self.shutdown()
            raise

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the Ray thread; its result or its exception."""
        return self._exec.submit(fn, *args, **kwargs).result()

    def start_replica(self, config: EngineConfig, index: int, log_level: str, kv_events: bool) -> RayCoreClient:
        """Start replica ``index`` in its bundle (call its ``wait_ready`` next)."""
        return self.call(RayCoreClient, config, self.pg, index, self.host, log_level, kv_events=kv_events, wait_ready=False)

    def shutdown(self) -> None:
        """Remove the placement group and stop a head this object started; idempotent."""

        def stop() -> None:
            import ray
            from ray.util.placement_group import remove_placement_group

            if self.pg is not None:
                try:
                    remove_placement_group(self.pg)
                except Exception:  # Ray already gone
                    pass
                self.pg = None
            if self.started_local:
                ray.shutdown()
                self.started_local = False

        if not self._closed:
            self._closed = True
            self.call(stop)
            self._exec.shutdown(wait=True)
