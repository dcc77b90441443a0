"""HTTP plumbing of the OpenAI server shared by its routes: the front's :class:`APIError` and
the one mapping of every refusal to an OpenAI error body (:func:`api_error`, used by the
exception handlers and by streams that fail late), request ids (:func:`request_ids`), the
API-key middleware, and disconnect handling.

Statuses are decided here, in the front: the engine's :class:`RequestError` (a field it
refused, named in ``param``) is a 400; a dead engine a 503; an overloaded server a 503 with
``Retry-After``, an unknown model a 404 (both raised as :class:`APIError` where they are found).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import uuid
from typing import Any, Awaitable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagedserve.sampling_params import RequestError

logger = logging.getLogger("pagedserve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_REQUEST_ID_CHARS = 256  # it is repeated in every streamed chunk


def error_body(message: str, status_code: int = 400, err_type: str = "BadRequestError", param: Optional[str] = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status_code)).model_dump()


def error_response(message: str, status_code: int = 400, err_type: str = "BadRequestError", param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, err_type, param), status_code=status_code)


class APIError(Exception):
    """A refusal of the HTTP front, with its status: a check only the front can make (the
    request's HTTP shape, tools, the chat template, the served model, the server's load), with
    the request field at fault in ``param``.

    Attributes:
        message: the error body's ``message``.
        param: the request field at fault, or None.
        status_code / err_type: the HTTP status and the body's ``type`` (400 / BadRequestError).
        headers: extra response headers (``Retry-After`` of a 503).
    """

    def __init__(
        self,
        message: str,
        *,
        param: Optional[str] = None,
        status_code: int = 400,
        err_type: str = "BadRequestError",
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.status_code, self.err_type, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers or None)


def api_error(exc: BaseException) -> APIError:
    """How the front answers ``exc``, the one mapping of refusals to statuses: an
    :class:`APIError` as it is; the engine's :class:`RequestError` 400 with its ``param``; any
    other ``ValueError`` 400 (no field named); a dead engine 503; anything else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(exc.message, param=exc.param)
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), status_code=503, err_type="ServiceUnavailableError")
    return APIError(str(exc), status_code=500, err_type="InternalServerError")


def random_id(prefix: str = "") -> str:
    """``prefix`` and 32 random hex digits: the ids the server makes (responses, items, calls)."""
    return prefix + uuid.uuid4().hex


def request_ids(prefix: str, request: Request, body_id: Optional[str]) -> tuple[str, str]:
    """``(response id, engine id)`` of a generating request (every such route takes its ids
    here), as vLLM names them: the ``X-Request-Id`` header, else the body's ``request_id``,
    else a random hex, after ``prefix`` and a dash (an underscore after ``resp``, as OpenAI's
    Responses ids). A client's id gets a random suffix in the engine, so two requests that send
    the same id never collide there (vLLM v1 does the same). The engine request of prompt ``i``
    of several is ``{engine id}-{i}`` (:func:`prompt_request_ids`); the children of ``n > 1``
    are the engine's.

    Raises:
        APIError: an empty id, one over ``MAX_REQUEST_ID_CHARS`` characters, or one with
            control characters (it is logged); ``param`` ``request_id`` for the body's.
    """
    header = request.headers.get("x-request-id")
    if header is not None:  # HTTP hands headers over as latin-1; clients send UTF-8
        try:
            header = header.encode("latin-1").decode("utf-8")
        except UnicodeError:
            pass
    base, field = (header, "X-Request-Id header") if header is not None else (body_id, "request_id")
    prefix += "_" if prefix == "resp" else "-"
    if base is None:
        base = random_id()
        request.state.request_id = base  # the X-Request-Id of the answer (--enable-request-id-headers)
        return prefix + base, prefix + base
    if not base or len(base) > MAX_REQUEST_ID_CHARS or not base.isprintable():
        raise APIError(f"{field} must be 1 to {MAX_REQUEST_ID_CHARS} printable characters.", param="request_id" if header is None else None)
    request.state.request_id = base
    return f"{prefix}{base}", f"{prefix}{base}-{secrets.token_hex(4)}"


def prompt_request_ids(engine_id: str, num_prompts: int) -> list[str]:
    """The engine request id of each prompt of a request (:func:`request_ids`' engine id)."""
    return [f"{engine_id}-{i}" for i in range(num_prompts)] if num_prompts > 1 else [engine_id]


class RequestIdHeaderMiddleware:
    """Pure ASGI middleware (``--enable-request-id-headers``, vLLM's): every HTTP response
    carries ``X-Request-Id``: the id a completion route chose (:func:`request_ids`: the header,
    the body's ``request_id`` or its random hex), else the request's own header, else a new
    random hex."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        fallback = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), None) or random_id().encode()

        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                chosen = scope.get("state", {}).get("request_id")
                rid = chosen.encode() if chosen is not None else fallback
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # a bug: Starlette's 500 would be made outside this middleware
            if started:
                raise
            await internal_error(scope.get("path", ""), exc)(scope, receive, send_with_id)


class APIKeyMiddleware:
    """Pure ASGI middleware: with an API key, every route but ``public_paths`` (``/health``,
    ``/metrics`` with ``--metrics-public``, and the files under ``public_prefixes``: the
    dashboard page's static files, not its data) needs ``Authorization: Bearer KEY`` or
    ``X-Api-Key: KEY``; anything else is a 401 with an OpenAI error body. CORS preflights
    (``OPTIONS``) pass, as browsers send them without credentials. (Not BaseHTTPMiddleware,
    which would get between handlers and ``receive`` and so hide client disconnects.)"""

    def __init__(self, app: Any, api_key: str, public_paths: frozenset = frozenset({"/health"}), public_prefixes: tuple = ()) -> None:
        self.app = app
        self.key = api_key.encode()
        self.public_paths = public_paths
        self.public_prefixes = public_prefixes

    def _authorized(self, headers: list) -> bool:
        for k, v in headers:
            if k == b"authorization" and v[:7].lower() == b"bearer " and hmac.compare_digest(v[7:].strip(), self.key):
                return True
            if k == b"x-api-key" and hmac.compare_digest(v.strip(), self.key):
                return True
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or path in self.public_paths
            or (path.startswith(self.public_prefixes) and ".." not in path)
        ):
            return await self.app(scope, receive, send)
        if self._authorized(scope.get("headers", [])):
            return await self.app(scope, receive, send)
        resp = error_response("Unauthorized: a valid API key is required (Authorization: Bearer KEY, or X-Api-Key: KEY).", 401, "AuthenticationError")
        await resp(scope, receive, send)


class RequestLimitsMiddleware:
    """Pure ASGI middleware: request headers over ``max_header_bytes`` get 431, a body over
    ``max_body_bytes`` (by Content-Length, or counted as it arrives) gets 413, both with an
    OpenAI error body."""

    def __init__(self, app: Any, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.max_headers = max_header_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers", [])
        if sum(len(k) + len(v) for k, v in headers) > self.max_headers:
            return await error_response(f"request headers are larger than {self.max_headers} bytes", 431, "RequestHeaderFieldsTooLargeError")(
                scope, receive, send
            )
        for k, v in headers:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body:
                return await error_response(f"request body is larger than {self.max_body} bytes", 413, "RequestEntityTooLargeError")(
                    scope, receive, send
                )
        # Read the whole body here (the app would anyway), counting it as it arrives, then
        # replay it; later receive() calls (disconnect detection) go to the server.
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            more = message.get("more_body", False)
            if seen > self.max_body:
                return await error_response(f"request body is larger than {self.max_body} bytes", 413, "RequestEntityTooLargeError")(
                    scope, receive, send
                )
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


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


def field_path(loc: list, body: Any) -> str:
    """OpenAI's name of the field at a pydantic error's ``loc`` (``messages[2].tool_call_id``),
    found by walking the request body: parts that do not lead into it (a union member's tag, such
    as ``str`` or a message's role) are left out."""
    path, node = "", body
    for k, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
        elif isinstance(part, str) and isinstance(node, dict) and (part in node or k == len(loc) - 1):
            path, node = f"{path}.{part}" if path else part, node.get(part)
    return path


def install_error_handlers(app: FastAPI) -> None:
    """Every error becomes ``{"error": {"message", "type", "param", "code"}}``: pydantic's
    schema errors 400 naming the field; refusals as :func:`api_error` maps them (invalid input
    400, unknown model 404, overload or a dead engine 503); an unknown route 404; a bug 500."""

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts, param = [], None
        for e in errors:
            if e.get("type") == "json_invalid":
                parts.append(f"Invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
                continue
            where = field_path([x for x in e.get("loc", ()) if x != "body"], exc.body)
            if e.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # a message's role
                where += "." + str(e.get("ctx", {}).get("discriminator", "")).strip("'")
            if param is None and where:
                param = where
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return error_response("; ".join(parts) or "Invalid request.", 400, "BadRequestError", param)

    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response()

    for cls in (APIError, ValueError, EngineDeadError):  # RequestError is a ValueError
        app.add_exception_handler(cls, _refused)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        names = {404: "NotFoundError", 405: "MethodNotAllowedError"}
        return error_response(str(exc.detail), exc.status_code, names.get(exc.status_code, "BadRequestError"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(request.url.path, exc)


def internal_error(path: str, exc: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered with a 500."""
    logger.exception("unhandled error in %s", path, exc_info=exc)
    return error_response(f"Internal server error: {exc!r}", 500, "InternalServerError")
