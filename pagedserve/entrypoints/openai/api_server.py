"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`AsyncLLM`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /v1/embeddings (``--runner pooling``), GET /v1/models, GET /v1/models/{id},
POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API and error shape: :mod:`.serving_messages`),
GET /health, GET /metrics, POST /tokenize, POST /detokenize, GET /version; with
``--allow-runtime-lora-updating`` POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(:mod:`.lora_routes`: a request's ``model`` may name a LoRA adapter).

``pagedserve serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY]`` binds its port first,
answers ``/health`` with 503 while the engine loads, then serves. With an API key (or
``PAGEDSERVE_API_KEY``) every /v1 route requires ``Authorization: Bearer KEY``. CORS follows
``--allowed-origins`` etc. (default: everything, as vLLM), so a browser preflight succeeds.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: invalid input is
HTTP 400 (``BadRequestError``), a missing/wrong key 401, an unknown model or route 404
(``NotFoundError``), a bug 500. A client that disconnects (streaming or not) aborts its request
at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline

import pagedserve
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai import dashboard
from pagedserve.entrypoints.openai.anthropic_errors import AnthropicErrorMiddleware
from pagedserve.entrypoints.openai.http_common import (
    SSE_HEADERS,
    APIError,
    APIKeyMiddleware,
    RequestIdHeaderMiddleware,
    RequestLimitsMiddleware,
    error_response,
    install_error_handlers,
    request_ids,
    run_until_disconnect,
)
from pagedserve.entrypoints.openai.lora_routes import check_lora_flags, lora_cards, register_lora_routes
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedserve.entrypoints.openai.protocol_anthropic import AnthropicCountTokensRequest, AnthropicMessagesRequest
from pagedserve.entrypoints.openai.protocol_responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from pagedserve.entrypoints.openai.responses_api import ResponsesRequest
from pagedserve.entrypoints.openai.server_args import ServerArgs
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import release_unused_kv
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_embedding import EmbeddingRequest, OpenAIServingEmbedding
from pagedserve.entrypoints.openai.serving_messages import AnthropicServingMessages
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedserve.entrypoints.openai.tools import plan_tools
from pagedserve.metrics import CONTENT_TYPE

logger = logging.getLogger("pagedserve")


def add_cors(app: FastAPI, server: ServerArgs) -> None:
    app.add_middleware(
        CORSMiddleware,
        allow_origins=server.allowed_origins,
        allow_methods=server.allowed_methods,
        allow_headers=server.allowed_headers,
        allow_credentials=server.allow_credentials,
    )


class Admission:
    """The front's gate before a request is prepared (tokenized, rendered): 503 with
    ``Retry-After`` at once when ``max_queued_requests`` requests are already waiting to start
    (those being prepared count), so an overloaded server says so instead of queueing without
    end. ``draining`` is set when the server stops admitting (SIGTERM)."""

    def __init__(self, llm: AsyncLLM, max_queued_requests: Optional[int]) -> None:
        self.llm = llm
        self.max_queued_requests = max_queued_requests
        self.draining = False
        self._preparing = 0
        self._lock = threading.Lock()

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Raises APIError 503 (with ``Retry-After``) when the server is full."""
        with self._lock:
            waiting = self.llm.num_waiting_to_start() + self._preparing
            if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
                raise APIError(
                    f"the server is overloaded: {waiting} requests are waiting to start; retry later.",
                    status_code=503,
                    err_type="ServiceUnavailableError",
                    headers={"Retry-After": "1"},
                )
            self._preparing += 1
        try:
            yield
        finally:
            with self._lock:
                self._preparing -= 1


def build_app(llm: AsyncLLM, server: Optional[ServerArgs] = None) -> FastAPI:
    """The FastAPI app over ``llm``; ``server`` holds the front's flags. Shutting the app down
    shuts ``llm`` down. ``app.state.admission`` is its :class:`Admission`.

    Raises:
        ValueError: an unreadable ``--chat-template`` or ``--generation-config``;
            ``--allow-runtime-lora-updating`` without ``--enable-lora``.
    """
    server = server or ServerArgs()
    check_lora_flags(llm, server)
    metrics = llm.metrics
    if llm.config.enable_lora:
        metrics.enable_lora_info(llm.config.max_loras)
    served = list(llm.served_model_names)
    kw = dict(
        trust_request_chat_template=server.trust_request_chat_template,
        chat_template=server.chat_template_text(),
        enable_auto_tool_choice=server.enable_auto_tool_choice,
        tool_call_parser=server.tool_call_parser,
        reasoning_parser=server.reasoning_parser,
        default_sampling=generation_defaults(server.generation_config, llm.model_dir),
        log_requests=server.enable_log_requests,
        request_timeout=server.request_timeout,
    )
    admission = Admission(llm, server.max_queued_requests)
    completions = OpenAIServingCompletion(llm, served, **kw)
    chats = OpenAIServingChat(llm, served, **kw)
    responses = OpenAIServingResponses(chats)
    messages = AnthropicServingMessages(chats)
    embeddings = OpenAIServingEmbedding(llm, served, **kw)
    model_root = llm.config.model or served[0]
    # Tokenizing, rendering and compiling constraints run on one worker thread, not on the event
    # loop: a big schema must not pause every stream. One thread: the tokenizer is shared.
    prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-prepare")
    prepare.submit(lambda: llm.input_processor.grammars.lltokenizer)  # built once, ahead of the first constraint

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(prepare, fn, *args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        llm.shutdown()
        prepare.shutdown(wait=False)

    # /docs with Swagger UI served from the package (FastAPI's own page loads it from a CDN and
    # renders blank offline). No /redoc: ReDoc still fetches its logo from cdn.redoc.ly.
    app = FastAPIOffline(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan, static_url="/docs/static", redoc_url=None)
    dashboard.add_dashboard(app, llm, api_key_required=bool(server.api_key))
    app.state.llm = llm
    app.state.admission = admission
    app.state.metrics = metrics
    if server.api_key:
        public = {"/health", "/metrics"} if server.metrics_public else {"/health"}
        app.add_middleware(
            APIKeyMiddleware,
            api_key=server.api_key,
            public_paths=frozenset(public | set(dashboard.PUBLIC_PATHS)),
            public_prefixes=(dashboard.PUBLIC_PREFIX,),
        )
    add_cors(app, server)
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=server.max_request_body_bytes, max_header_bytes=server.max_header_bytes)
    if server.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: every error of /v1/messages in Anthropic's shape
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if llm.errored or not llm.is_running:
            return error_response("engine is not running", 503, "ServiceUnavailableError")
        replicas = llm.replica_status()
        if replicas is not None:  # data parallel: 200 while any replica serves, with each one's state
            live = sum(r["alive"] for r in replicas)
            return JSONResponse({"status": "ok" if live == len(replicas) else "degraded", "replicas": replicas})
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=pagedserve.__version__)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        for r in llm.replica_status() or ():
            metrics.for_engine(r["engine"]).replica_up.set(1 if r["alive"] else 0)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=model_root, max_model_len=llm.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in served] + lora_cards(llm, llm.max_model_len))

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        chats.check_model(model_id)
        return next((c for c in lora_cards(llm, llm.max_model_len) if c.id == model_id), None) or card(model_id)

    if server.allow_runtime_lora_updating:
        register_lora_routes(app, llm)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        try:
            request_id, engine_id = request_ids("cmpl", raw_request, req.request_id)
            with admission.admit():  # 503 at once when too many requests wait to start
                model, prompts, params = await off_loop(completions.prepare_completion, req)
        except (APIError, ValueError):  # refused (RequestError is a ValueError)
            release_unused_kv(llm, req.kv_transfer_params)
            raise
        completions.log_request(engine_id, req, [len(p.token_ids) for p in prompts], params)
        if req.stream:
            return StreamingResponse(
                completions.completion_stream(req, request_id, model, prompts, params, engine_id), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await run_until_disconnect(raw_request, completions.completion_full(req, request_id, model, prompts, params, engine_id))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        try:
            request_id, engine_id = request_ids("chatcmpl", raw_request, req.request_id)
            with admission.admit():
                model, conv, prompt, params, tools = await off_loop(chats.prepare_chat, req)
        except (APIError, ValueError):  # refused (RequestError is a ValueError)
            release_unused_kv(llm, req.kv_transfer_params)
            raise
        chats.log_request(engine_id, req, [len(prompt.token_ids)], [params])
        if req.stream:
            return StreamingResponse(
                chats.chat_stream(req, request_id, model, conv, prompt, params, tools, engine_id), media_type="text/event-stream", headers=SSE_HEADERS
            )
        return await run_until_disconnect(raw_request, chats.chat_full(req, request_id, model, conv, prompt, params, tools, engine_id))

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, raw_request: Request):
        request_id, engine_id = request_ids("embd", raw_request, req.request_id)
        with admission.admit():
            model, prompts, params = await off_loop(embeddings.prepare, req)
        embeddings.log_request(engine_id, req, [len(p.token_ids) for p in prompts], [params])  # type: ignore[list-item]
        return await run_until_disconnect(raw_request, embeddings.embed_full(req, request_id, model, prompts, params, engine_id))

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw_request: Request):
        response_id, engine_id = request_ids("resp", raw_request, req.request_id)
        with admission.admit():
            chat_req, model, conv, prompt, params, tools = await off_loop(responses.prepare, req)
        chats.log_request(engine_id, req, [len(prompt.token_ids)], [params])
        args = (req, chat_req, response_id, model, conv, prompt, params, tools, engine_id)
        if req.stream:
            return StreamingResponse(responses.response_stream(*args), media_type="text/event-stream", headers=SSE_HEADERS)
        result = await run_until_disconnect(raw_request, responses.response_full(*args))
        return result if isinstance(result, Response) else JSONResponse(result)  # a Response: the client left (499)

    @app.post("/v1/messages")
    async def create_message(req: AnthropicMessagesRequest, raw_request: Request):
        request_id, engine_id = request_ids("msg", raw_request, None)
        message_id = "msg_" + request_id[len("msg-") :]
        with admission.admit():
            prepared = await off_loop(messages.prepare, req)
        chats.log_request(engine_id, req, [len(prepared.prompt.token_ids)], [prepared.params])
        if req.stream:
            return StreamingResponse(messages.message_stream(message_id, prepared, engine_id), media_type="text/event-stream", headers=SSE_HEADERS)
        result = await run_until_disconnect(raw_request, messages.message_full(message_id, prepared, engine_id))
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: AnthropicCountTokensRequest):
        with admission.admit():
            return JSONResponse(await off_loop(messages.count_tokens, req))

    def not_stored(response_id: str) -> APIError:
        return APIError(
            f"Response {response_id!r} not found: this server stores no responses (store is ignored).",
            param="response_id",
            status_code=404,
            err_type="NotFoundError",
        )

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        raise not_stored(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        raise not_stored(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        raise not_stored(response_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        chats.check_model(req.model)
        if req.messages is not None:
            # As chat completions: the template places the special tokens, and sees the tools.
            tools = plan_tools(req.tools, "none", True, None).tools or None
            _, ids = chats.render_chat(
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template,
                req.chat_template_kwargs,
                tools,
                bool(req.add_special_tokens),
            )
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = llm.input_processor.tokenize(req.prompt, add, "prompt")
        else:
            raise APIError("tokenize needs prompt or messages.", param="prompt")
        strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        chats.check_model(req.model)
        if req.tokens:  # none decode to ""
            llm.input_processor.check_token_ids(req.tokens, "tokens", param="tokens")
        return DetokenizeResponse(prompt=llm.tokenizer.decode(req.tokens))

    return app


def generation_defaults(mode: str, model_dir: str) -> dict[str, Any]:
    """Sampling defaults from ``generation_config.json`` (``--generation-config``): the fields it
    sets among temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
    max_tokens). ``"vllm"`` = none; ``"auto"`` = the model folder's; else a folder.

    Raises:
        ValueError: a folder without a readable generation_config.json.
    """
    import json
    import os

    if mode == "vllm":
        return {}
    folder = model_dir if mode == "auto" else mode
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if mode == "auto":
            return {}
        raise ValueError(f"--generation-config {mode!r}: no generation_config.json there")
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    out = {k: cfg[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if cfg.get(k) is not None}
    if cfg.get("max_new_tokens") is not None:
        out["max_tokens"] = cfg["max_new_tokens"]
    if out:
        logger.info("pagedserve: default sampling parameters from %s: %s", path, out)
    return out
