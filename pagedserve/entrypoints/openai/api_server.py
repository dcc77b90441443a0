"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`AsyncLLM`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /version.

``pagedserve serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]`` starts it; with an API
key (or ``PAGEDSERVE_API_KEY``) every /v1 route requires ``Authorization: Bearer KEY``.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: invalid input is
HTTP 400 (``BadRequestError``), a missing/wrong key 401, an unknown route 404, a bug 500.
A client that disconnects (streaming or not) aborts its request at once.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from pagedserve.engine.input_processor import RequestError, param_of
from pagedserve.metrics import CONTENT_TYPE, EngineMetrics
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    random_id,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import error_body
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion

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


def build_app(llm: AsyncLLM, api_key: Optional[str] = None, trust_request_chat_template: bool = False) -> FastAPI:
    """The FastAPI app over ``llm`` (its ``metrics`` are created here when it has none). A
    ``chat_template`` in a request is refused unless ``trust_request_chat_template`` (templates
    are code that runs in the server). Shutting the app down shuts ``llm`` down."""
    if llm.metrics is None:
        llm.metrics = EngineMetrics(llm.model_name)
    metrics = llm.metrics
    served = [llm.model_name]
    completions = OpenAIServingCompletion(llm, served, trust_request_chat_template)
    chats = OpenAIServingChat(llm, served, trust_request_chat_template)
    model_root = llm.config.model or served[0]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        llm.shutdown()

    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan)
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.completions = completions
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    # -- errors ------------------------------------------------------------------------------
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

    # -- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if llm.errored or not llm.is_running:
            return error_response("engine is not running", 503, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=pagedserve.__version__)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=model_root, max_model_len=llm.max_model_len) for name in served])

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        model, prompts, params = completions.prepare_completion(req)
        request_id = random_id("cmpl")
        if req.stream:
            return StreamingResponse(completions.completion_stream(req, request_id, model, prompts, params), media_type="text/event-stream", headers=SSE_HEADERS)
        return await run_until_disconnect(raw_request, completions.completion_full(req, request_id, model, prompts, params))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        model, conv, prompt, params = chats.prepare_chat(req)
        request_id = random_id("chatcmpl")
        if req.stream:
            return StreamingResponse(chats.chat_stream(req, request_id, model, conv, prompt, params), media_type="text/event-stream", headers=SSE_HEADERS)
        return await run_until_disconnect(raw_request, chats.chat_full(req, request_id, model, conv, prompt, params))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        chats.check_model(req.model)
        if req.messages is not None:
            # The chat template already places every special token (as for chat completions).
            _, ids = chats.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template)
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = llm.input_processor.tokenize(req.prompt, add, "prompt")
        else:
            raise RequestError("tokenize needs prompt or messages.", param="prompt")
        strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        chats.check_model(req.model)
        for t in req.tokens:
            if not 0 <= t < llm.vocab_size:
                raise RequestError(f"tokens contains token id {t} outside the vocabulary [0, {llm.vocab_size}).", param="tokens")
        return DetokenizeResponse(prompt=llm.tokenizer.decode(req.tokens))

    return app


ENGINE_DEAD_GRACE_S = 2.0  # /health answers 503 this long before the server exits


def run_server(args: Any) -> int:
    """Entry point of ``pagedserve serve``: start the engine core process, then serve until
    interrupted. Returns 1 when the engine core died (a supervisor should restart the server)."""
    import threading

    import uvicorn

    from pagedserve.config import EngineConfig

    api_key = getattr(args, "api_key", None) or os.environ.get("PAGEDSERVE_API_KEY") or None
    config = EngineConfig.from_cli_args(args, model=getattr(args, "model_tag", None))
    log_level = str(getattr(args, "log_level", "info")).lower()
    server: Optional[uvicorn.Server] = None
    engine_dead = threading.Event()

    def on_engine_dead() -> None:
        engine_dead.set()
        # Let /health say 503 for a moment, then stop the server (its exit status says why).
        timer = threading.Timer(ENGINE_DEAD_GRACE_S, lambda: setattr(server, "should_exit", True) if server else None)
        timer.daemon = True
        timer.start()

    llm = AsyncLLM(config, metrics=None, on_engine_dead=on_engine_dead, log_level=log_level)
    app = build_app(llm, api_key=api_key, trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)))
    logger.info("pagedserve: serving %s on http://%s:%d%s (engine core pid %d)", llm.model_name, args.host, args.port,
                " (API key required)" if api_key else "", llm.engine_pid)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level, timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        llm.shutdown()
    if engine_dead.is_set():
        logger.error("pagedserve: exiting because the engine core died")
        return 1
    return 0
