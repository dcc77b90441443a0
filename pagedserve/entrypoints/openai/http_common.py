"""HTTP plumbing of the OpenAI server shared by its routes: OpenAI-shaped error bodies and the
exception handlers that produce them, the API-key middleware, and disconnect handling."""
from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, Awaitable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.engine.input_processor import RequestError, param_of
from pagedserve.entrypoints.openai.serving_common import error_body

logger = logging.getLogger("pagedserve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(message: str, status_code: int = 400, err_type: str = "BadRequestError", param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, err_type, param), status_code=status_code)


class APIKeyMiddleware:
    """Pure ASGI middleware: /v1 routes need ``Authorization: Bearer <key>`` (401 otherwise).
    (Not BaseHTTPMiddleware, which would get between handlers and ``receive`` and so hide
    client disconnects.)"""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                auth = v
                break
        if hmac.compare_digest(auth, self.expected):
            return await self.app(scope, receive, send)
        resp = error_response("Unauthorized: a valid API key is required (Authorization: Bearer KEY).", 401, "AuthenticationError")
        await resp(scope, receive, send)


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client goes away first; then cancel it (which aborts its
    engine requests) and return a 499 nobody will read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    logger.info("client disconnected; request aborted")
    return Response(status_code=499)


def install_error_handlers(app: FastAPI) -> None:
    """Every error becomes ``{"error": {"message", "type", "param", "code"}}``: invalid input
    400, unknown model or route 404, a dead engine 503, a bug 500."""

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts, param = [], None
        for e in errors:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            if e.get("type") == "json_invalid":
                parts.append(f"Invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
                continue
            where = ".".join(loc)
            if param is None and loc:
                param = loc[0]
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return error_response("; ".join(parts) or "Invalid request.", 400, "BadRequestError", param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.message, exc.status_code, exc.err_type, exc.param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400, "BadRequestError", param_of(str(exc)))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(str(exc), 503, "ServiceUnavailableError")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        names = {404: "NotFoundError", 405: "MethodNotAllowedError"}
        return error_response(str(exc.detail), exc.status_code, names.get(exc.status_code, "BadRequestError"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        return error_response(f"Internal server error: {exc!r}", 500, "InternalServerError")
