"""``pagedserve serve``: bind the port, start the engine in the background, serve.

The port is bound before the model loads, so a busy port fails at once; until the engine core is
ready every request (``/health`` included) is answered 503. If the engine core dies later, the
server keeps answering 503 for ``ENGINE_DEAD_GRACE_S`` and then exits with status 1, for a
supervisor to restart it.

SIGTERM (to the server, or to its whole process group, as a supervisor sends it) drains: new
requests get 503, running ones get ``--shutdown-timeout`` seconds to finish, then the engine
core is stopped and the server exits 0. The engine core ignores SIGTERM and Ctrl-C itself: the
front stops it. A second signal exits at once.

``--frontend-nice``: once the engine's processes have started, the front's threads yield the
cores to the engine's compute threads (:func:`lower_thread_priority`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from pagedserve.entrypoints.openai.http_common import error_response
from pagedserve.entrypoints.openai.server_args import ServerArgs

logger = logging.getLogger("pagedserve")

ENGINE_DEAD_GRACE_S = 2.0


class LoadingApp:
    """ASGI app that answers 503 until :meth:`ready` hands it the real app, then forwards to it.
    It owns the lifespan: at shutdown it stops the engine (the real app's own lifespan does not
    run)."""

    def __init__(self) -> None:
        self.app: Any = None
        self.llm: Any = None
        self.draining = False  # graceful shutdown: every request gets 503

    def ready(self, app: Any, llm: Any) -> None:
        self.app, self.llm = app, llm

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self.llm is not None:
                        self.llm.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if self.app is not None and not self.draining:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            why = "the server is shutting down" if self.draining else "the engine is loading"
            await error_response(why, 503, "ServiceUnavailableError")(scope, receive, send)


def draining_server(config: Any, loading: LoadingApp, shutdown_timeout: float) -> Any:
    """A uvicorn server whose first SIGTERM drains (see the module docstring)."""
    import signal
    import time

    import uvicorn

    class DrainingServer(uvicorn.Server):
        draining_started = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig != signal.SIGTERM or self.draining_started:
                return super().handle_exit(sig, frame)
            self.draining_started = True
            loading.draining = True
            if loading.llm is not None:
                loading.app.state.admission.draining = True  # ends the dashboard's streams, which are no requests
            logger.info("pagedserve: SIGTERM: refusing new requests, letting running ones finish (up to %.0f s)", shutdown_timeout)

            def drain() -> None:
                deadline = time.monotonic() + shutdown_timeout
                while time.monotonic() < deadline and loading.llm is not None and loading.llm.num_unfinished_requests() > 0:
                    time.sleep(0.05)
                if loading.llm is not None and loading.llm.num_unfinished_requests() > 0:
                    # Past --shutdown-timeout: end what still runs with a 503 body or stream event
                    # (uvicorn's own cancel would answer a plain-text 500 or cut a stream mid-chunk).
                    logger.warning("pagedserve: --shutdown-timeout passed; ending %d unfinished requests", loading.llm.num_unfinished_requests())
                    loading.llm.fail_all_requests("the server is shutting down (--shutdown-timeout passed)")
                    time.sleep(0.2)
                self.should_exit = True

            threading.Thread(target=drain, name="pagedserve-drain", daemon=True).start()

    return DrainingServer(config)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``. Raises ValueError (one line) when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def lower_thread_priority(nice: int) -> int:
    """Set every thread of this process to a nice value of at least ``nice`` (Linux, where a
    nice value is per thread and new threads inherit their creator's; elsewhere, or with
    ``nice <= 0``, nothing). Never makes a thread's priority higher. Passes again until no
    thread changes, so that threads started meanwhile are caught. Returns how many threads
    changed. A refusal (a sandbox forbidding ``setpriority``) is logged, never raised: the
    server runs as before.

    Why: on cores the engine saturates, each wake-up of a front thread (HTTP, tokenizing,
    detokenizing, the output thread) preempted one of the engine core's OpenMP threads mid
    step, and its partner then waited for it at the next barrier: W1 over HTTP on 2 cores ran
    ~8 % slower steps than offline although the front used ~0.3 s of CPU in 13 s. At nice 10
    the scheduler lets the front run when a compute thread yields instead (docs/perf-history.md,
    "the front yields to the engine": 1.02-1.11x in 7 of 8 pairs). Where a core is free, a nice
    value has no effect.

    Processes the front forks afterwards inherit the value: call this after the engine's
    processes have started. The chat template render process (``chat_template.py``), started
    on first use, runs at it; its time bound starts once it is ready.
    """
    if nice <= 0 or not os.path.isdir("/proc/self/task"):
        return 0
    total = 0
    while True:
        changed = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                if os.getpriority(os.PRIO_PROCESS, int(tid)) < nice:
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                    changed += 1
            except ProcessLookupError:  # the thread has ended
                pass
            except OSError as e:
                logger.warning("pagedserve: --frontend-nice %d not applied: %s", nice, e)
                return total + changed
        total += changed
        if not changed:
            return total


def engine_pids(llm: Any) -> str:
    """Where the engine runs, for the start-up log: its core's pid, or with data parallelism
    every replica's (and its node when not this host)."""
    replicas = llm.replica_status()
    if not replicas:
        return f"engine core pid {llm.engine_pid}"
    where = [f"{r['engine']}: pid {r['pid']}" + (f" on {r['node']}" if r.get("node") not in (None, "localhost") else "") for r in replicas]
    return f"{len(replicas)} engine replicas, " + ", ".join(where)


def run_server(args: Any) -> int:
    """Entry point of ``pagedserve serve``. Returns 1 when the engine core died.

    Raises:
        ValueError / FileNotFoundError: bad flags, model or port (the CLI prints one line).
    """
    import uvicorn

    from pagedserve import platform

    platform.block_torch_import()  # the engine core (its own process) has torch; this front needs none
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.core_proc import freeze_gc_heap
    from pagedserve.entrypoints.openai.api_server import build_app
    from pagedserve.entrypoints.openai.lora_routes import check_runtime_updating
    from pagedserve.model.files import load_tokenizer, resolve_model

    config = EngineConfig.from_cli_args(args, model=getattr(args, "model_tag", None))
    server_args = ServerArgs.from_cli_args(args)
    check_runtime_updating(server_args, config.enable_lora)  # before the engine loads
    server_args.chat_template_text()  # a missing template file fails now, not at the first request
    if server_args.reasoning_parser:  # a tokenizer without think tokens fails now, not after the engine loaded
        from pagedserve.entrypoints.openai.reasoning import ReasoningParser

        ReasoningParser.load(server_args.reasoning_parser, load_tokenizer(config.tokenizer or resolve_model(config.model)))
    log_level = str(getattr(args, "log_level", "info")).lower()
    sock = bind(server_args.host, server_args.port)
    loading = LoadingApp()
    config_uv = uvicorn.Config(
        loading,
        log_level=server_args.uvicorn_log_level,
        timeout_graceful_shutdown=2,
        h11_max_incomplete_event_size=max(server_args.max_header_bytes * 4, 1 << 20),
    )  # our 431 decides
    uv = draining_server(config_uv, loading, server_args.shutdown_timeout)
    engine_dead = threading.Event()
    failure: list[BaseException] = []

    def on_engine_dead() -> None:
        engine_dead.set()
        timer = threading.Timer(ENGINE_DEAD_GRACE_S, lambda: setattr(uv, "should_exit", True))
        timer.daemon = True
        timer.start()

    def load() -> None:
        try:
            t0 = time.monotonic()
            model_dir = resolve_model(config.model)  # a GGUF file is converted into the cache on first use (the loader logs it)
            if (config.model is None or str(config.model).endswith(".gguf")) and time.monotonic() - t0 > 1.0:
                logger.info("pagedserve: model ready in %.0fs: %s", time.monotonic() - t0, model_dir)
            logger.info(
                "pagedserve: starting the engine core%s: CPU kernels (compiled on the first start only, which takes minutes), weights, KV cache",
                f" ({config.data_parallel_size} replicas)" if config.data_parallel_size > 1 else "",
            )
            llm = AsyncLLM(config, on_engine_dead=on_engine_dead, log_level=log_level)
            try:
                app = build_app(llm, server_args)
            except BaseException:
                llm.shutdown()
                raise
            freeze_gc_heap()  # start-up objects out of the collector's walks (see core_proc.freeze_gc_heap)
            if lower_thread_priority(server_args.frontend_nice):  # after the engine's processes forked
                logger.info("pagedserve: the front's threads run at nice %d (--frontend-nice)", server_args.frontend_nice)
            loading.ready(app, llm)
            logger.info(
                "pagedserve: serving %s on http://%s:%d%s (%s)",
                ", ".join(llm.served_model_names),
                server_args.host,
                server_args.port,
                " (API key required)" if server_args.api_key else "",
                engine_pids(llm),
            )
        except BaseException as e:
            failure.append(e)
            uv.should_exit = True

    logger.info("pagedserve: listening on http://%s:%d; loading the engine", server_args.host, server_args.port)
    threading.Thread(target=load, name="pagedserve-load", daemon=True).start()
    try:
        uv.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
        if loading.llm is not None:
            loading.llm.shutdown()
    if failure:
        raise failure[0]
    if engine_dead.is_set():
        logger.error("pagedserve: exiting because the engine core died")
        return 1
    return 0
