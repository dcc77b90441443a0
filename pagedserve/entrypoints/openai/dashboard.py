"""The live view of the engine at ``/dashboard``: who ran each step and where the KV cache lives.

The page (``static/dashboard.html`` + ``.js`` + ``.css``, plain HTML/JS/SVG, no build step and
no CDN) is public even with ``--api-key``; its data is not. It reads one stream:

``GET /dashboard/api/stream`` (``text/event-stream``; needs the key like any other route, which
the page sends as a header on a ``fetch`` stream, since ``EventSource`` cannot send headers).
Every ``interval`` seconds (0.25 by default) one event ``data: {...}`` with:

* ``steps``: the engine's step records since the last event (fields in
  :mod:`pagedserve.core.trace`), oldest first, at most ``MAX_STEPS_PER_EVENT``;
* ``blocks``: the block map (:func:`pagedserve.core.trace.block_map`), in every
  ``BLOCK_MAP_EVERY``-th event only (it walks every block);
* ``stats``: running / waiting, KV usage, prefix-cache queries and hits (cumulative tokens),
  preemptions, and the engine's token budget and block size.

``GET /dashboard/api/snapshot`` answers the same object once (for scripts and tests), and the
public ``GET /dashboard/api/auth`` says whether a key is needed (``{"api_key_required": bool}``).
"""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pagedserve.entrypoints.openai.http_common import error_body, error_response

STATIC_DIR = pathlib.Path(__file__).parent / "static"
PUBLIC_PREFIX = "/dashboard/static/"
PUBLIC_PATHS = ("/dashboard", "/dashboard/api/auth")
MAX_STEPS_PER_EVENT = 512
BLOCK_MAP_EVERY = 2
MIN_INTERVAL_S = 0.1
MAX_STEP_INDEX = 2**62  # larger since_step values (or negative ones) are clamped: msgpack carries int64


def _stats(llm: Any) -> dict[str, Any]:
    s = llm.get_stats()
    return {
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "kv_cache_usage": s.kv_cache_usage,
        "num_total_blocks": s.num_total_blocks,
        "num_free_blocks": s.num_free_blocks,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "num_preemptions": s.num_preemptions,
        "num_prompt_tokens": s.num_prompt_tokens,
        "num_generation_tokens": s.num_generation_tokens,
        "spec_decode_num_draft_tokens": s.spec_decode_num_draft_tokens,
        "spec_decode_num_accepted_tokens": s.spec_decode_num_accepted_tokens,
        "token_budget": llm.config.max_num_batched_tokens,
        "block_size": llm.config.block_size,
        "model": llm.model_name,
    }


async def snapshot(llm: Any, since_step: Optional[int], with_blocks: bool) -> dict[str, Any]:
    """One dashboard event: step records with ``step >= since_step``, the block map when
    ``with_blocks``, and the engine's counters.

    Raises:
        EngineDeadError: the engine core is not running.
    """
    steps = await llm.get_step_trace(since_step, MAX_STEPS_PER_EVENT)
    blocks = await llm.get_block_map() if with_blocks else None
    return {"steps": steps, "blocks": blocks, "stats": _stats(llm)}


async def event_stream(llm: Any, interval: float, draining: Callable[[], bool] = lambda: False) -> AsyncIterator[str]:
    """Server-sent events of :func:`snapshot`, forever (the response ends when the client goes
    away; Starlette cancels the generator on disconnect). An engine that dies ends the stream
    with an ``error`` event."""
    from pagedserve.engine.async_llm import EngineDeadError

    since: Optional[int] = None
    n = 0
    while not draining():  # a shutdown ends the stream (it is no request to wait for)
        try:
            event = await snapshot(llm, since, n % BLOCK_MAP_EVERY == 0)
        except EngineDeadError as e:
            yield "data: " + json.dumps(error_body(str(e), 503, "ServiceUnavailableError")) + "\n\n"
            return
        if event["steps"]:
            since = event["steps"][-1]["step"] + 1
        yield "data: " + json.dumps(event, separators=(",", ":")) + "\n\n"
        n += 1
        await asyncio.sleep(interval)


def add_dashboard(app: FastAPI, llm: Any, api_key_required: bool) -> None:
    """Register ``/dashboard``, its static files and its data routes on ``app``."""
    app.mount(PUBLIC_PREFIX.rstrip("/"), StaticFiles(directory=str(STATIC_DIR)), name="dashboard-static")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/api/auth", include_in_schema=False)
    async def dashboard_auth() -> JSONResponse:  # public: lets the page ask for the key before it fetches data
        return JSONResponse({"api_key_required": api_key_required})

    @app.get("/dashboard/api/snapshot", include_in_schema=False)
    async def dashboard_snapshot(since_step: Optional[int] = None) -> JSONResponse:
        if since_step is not None:
            since_step = min(max(since_step, 0), MAX_STEP_INDEX)
        return JSONResponse(await snapshot(llm, since_step, True))

    @app.get("/dashboard/api/stream", include_in_schema=False)
    async def dashboard_stream(interval: float = 0.25) -> Response:
        if llm.errored or not llm.is_running:
            return error_response("engine is not running", 503, "ServiceUnavailableError")
        interval = min(max(interval, MIN_INTERVAL_S), 10.0) if math.isfinite(interval) else 0.25
        admission = getattr(app.state, "admission", None)
        draining = (lambda: admission.draining) if admission is not None else (lambda: False)
        return StreamingResponse(
            event_stream(llm, interval, draining), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
