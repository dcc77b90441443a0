"""The real server app over a tiny random model, served by uvicorn on a loopback port from a
thread of the test process (the engine core in another thread): for tests that need many apps
with different flags, fault injection, or the engine's internals after a run."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.entrypoints.openai.server_args import ServerArgs
from server_utils import free_port  # noqa: F401  (re-exported: tests import it from here too)


def tiny_async_llm(model_dir: str, **overrides) -> AsyncLLM:
    kw = dict(model=model_dir, dtype="float32", kv_cache_memory_bytes=8_000_000, max_model_len=512, num_threads=1,
              served_model_name=["tiny"])
    kw.update(overrides)
    return AsyncLLM(EngineConfig(**kw), engine_process=False)


@contextlib.contextmanager
def serve(llm: AsyncLLM, server: Optional[ServerArgs] = None, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``build_app(llm, server)`` on a free loopback port; yields the base URL. The app's
    lifespan is off, so ``llm`` outlives the server (the caller shuts it down)."""
    import uvicorn

    server = server or ServerArgs()
    app = build_app(llm, server)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                       h11_max_incomplete_event_size=max(server.max_header_bytes * 4, 1 << 20)))
    thread = threading.Thread(target=uv.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout_s)


def kv_idle(llm: AsyncLLM, timeout_s: float = 10.0) -> None:
    """Wait until the in-thread engine core has no request and every KV block is free; then
    check the scheduler's own bookkeeping."""
    core = llm.client.core
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.get_stats()
        if (llm.num_unfinished_requests() == 0 and stats.num_running == 0 and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_total_blocks):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout_s}s: {stats}, {llm.num_unfinished_requests()} unfinished")
        time.sleep(0.05)
    sched = core.scheduler
    assert not sched.requests and not sched.kv_cache_manager.req_to_blocks, list(sched.requests)
