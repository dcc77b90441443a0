"""``pagedserve proxy``: the thin HTTP proxy in front of prefill/decode disaggregation (experimental).

One client request becomes two upstream requests (vLLM's disaggregation contract, as in its
NixlConnector toy proxy):

1. To a prefill instance (``serve --kv-transfer-config '{"kv_role": "kv_producer", ...}'``), the
   client's body with ``max_tokens: 1`` (``max_completion_tokens: 1`` when present), ``stream:
   false``, no ``stream_options``, ``n: 1`` (``best_of: 1``, ``min_tokens: 0`` when present, so
   that the one-token request stays valid) and ``kv_transfer_params: {"do_remote_decode": true,
   "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host":
   null, "remote_port": null}``. Its JSON answer carries a top-level ``kv_transfer_params``
   (opaque here: where the decode side fetches the prompt's KV blocks from) or null.
2. To a decode instance (``kv_consumer``), the client's original body plus that
   ``kv_transfer_params``; its answer goes back unchanged: the status, ``content-type`` and
   ``retry-after``, the JSON body or the SSE stream (forwarded event by event).

Both get the client's ``Authorization`` / ``X-Api-Key`` and the same ``X-Request-Id`` (the
client's, else a new one; it is also returned). Several URLs per role are used round-robin; one
that refused a connection is tried last for ``down_s`` seconds.

Failures, each bounded in time:
- prefill unreachable, 5xx, 408/429 (overloaded, not the client's fault), unreadable JSON, or no
  answer within ``--prefill-timeout``: with ``--on-prefill-failure fallback`` (default) the
  decode instance gets the original body without ``kv_transfer_params`` and computes the prompt
  itself (a warning, counted in ``/health``); with ``error`` the client gets a 503.
- another prefill 4xx (the client's request is bad): returned as is; decode is not called.
- decode unreachable: 502 ``BadGatewayError``; silent for ``--decode-timeout`` before answering:
  504 ``GatewayTimeoutError``; the stream breaks: one ``data: {"error": ...}`` event, then
  ``data: [DONE]``.
- the client goes away: the upstream request in flight (prefill or decode) is closed at once,
  so that instance aborts the request and frees its KV blocks.

``GET /health`` (no key needed) probes every upstream's ``/health``: 200 when one prefill and
one decode instance answer, else 503. ``GET /v1/models`` is a decode instance's list, cached.

Sources: vLLM's ``examples/online_serving/disaggregated_serving`` proxies (toy_proxy_server.py
of the NixlConnector) and SGLang's mini load balancer (``sglang.srt.disaggregation.mini_lb``).
It does not: pick instances by load or cached prefix, retry a request once it reached an
instance, speak anything but the two completion routes, or batch prefills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.entrypoints.openai.http_common import (
    SSE_HEADERS,
    APIKeyMiddleware,
    RequestLimitsMiddleware,
    error_response,
    install_error_handlers,
)
from pagedserve.entrypoints.openai.serving_common import error_body
from pagedserve.entrypoints.proxy_upstreams import UpstreamPool, _Proxied, _send_bytes, decode_body, prefill_body

try:  # httpx, or its successor httpx2 (what openai installs here); same API
    import httpx
except ImportError:  # pragma: no cover - depends on the environment
    import httpx2 as httpx  # type: ignore[no-redef]

logger = logging.getLogger("pagedserve.proxy")

FORWARDED = ("authorization", "x-api-key")
RETURNED = ("content-type", "retry-after")
NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # another upstream may take it
HEALTH_TIMEOUT_S = 2.0
MODELS_TTL_S = 30.0
MAX_PENDING_EVENT = 1 << 20  # bytes of an unterminated SSE event held before forwarding anyway


class _PrefillFailed(Exception):
    """The prefill phase failed in a way the failure policy handles."""


class Proxy:
    """The state of one proxy: upstream pools, the HTTP client and counters."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        prefill_timeout: float = 30.0,
        decode_timeout: float = 600.0,
        on_prefill_failure: str = "fallback",
        down_s: float = 5.0,
    ) -> None:
        if on_prefill_failure not in ("fallback", "error"):
            raise ValueError(f"--on-prefill-failure must be fallback or error, got {on_prefill_failure!r}")
        if not (prefill_timeout > 0 and decode_timeout > 0):
            raise ValueError("--prefill-timeout and --decode-timeout must be > 0")
        self.prefill, self.decode = UpstreamPool(prefill, down_s), UpstreamPool(decode, down_s)
        self.prefill_timeout, self.on_prefill_failure = prefill_timeout, on_prefill_failure
        self.prefill_http_timeout = httpx.Timeout(prefill_timeout, connect=min(5.0, prefill_timeout))
        # Decode: a read timeout is the longest silence (before the answer, between chunks).
        self.decode_http_timeout = httpx.Timeout(decode_timeout, connect=min(5.0, decode_timeout))
        # Idle connections expire before the instances' keep-alive (uvicorn: 5 s) would close them
        # under a request in flight.
        self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256, keepalive_expiry=2.0))
        # prefill_without_kv_params: answers with no kv_transfer_params (is the instance a kv_producer?)
        self.counters = {"requests": 0, "prefill_failures": 0, "prefill_fallbacks": 0, "prefill_without_kv_params": 0}
        self._models: dict[tuple, tuple[float, Any]] = {}

    # -- the two completion routes --------------------------------------------------------
    async def route(self, request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return error_response(f"Invalid JSON body: {e}", 400, "BadRequestError")
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400, "BadRequestError")
        rid = request.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED}
        headers["x-request-id"] = rid
        self.counters["requests"] += 1
        return _Proxied(lambda send: self._handle(path, body, headers, send))

    async def _handle(self, path: str, body: dict, headers: dict, send: Any) -> None:
        try:
            kv = await asyncio.wait_for(self._prefill(path, body, headers), self.prefill_timeout)
        except (_PrefillFailed, asyncio.TimeoutError) as e:
            why = str(e) or f"no answer within --prefill-timeout {self.prefill_timeout:g} s"
            self.counters["prefill_failures"] += 1
            if self.on_prefill_failure == "error":
                logger.warning("prefill failed for %s (%s); 503", headers["x-request-id"], why)
                return await self._error(send, headers, 503, f"prefill instance failed: {why}", "ServiceUnavailableError")
            self.counters["prefill_fallbacks"] += 1
            logger.warning("prefill failed for %s (%s); the decode instance computes the prompt", headers["x-request-id"], why)
            kv = None
        if isinstance(kv, httpx.Response):  # the client's request is bad: its 4xx as is
            return await _send_bytes(send, kv.status_code, self._headers_back(kv, headers), kv.content)
        await self._decode(path, decode_body(body, kv), headers, bool(body.get("stream")), send)

    async def _prefill(self, path: str, body: dict, headers: dict) -> Any:
        """The prefill's ``kv_transfer_params`` (a dict or None), or its 4xx response.

        Raises:
            _PrefillFailed: no instance reachable, a 5xx/408/429, or an unreadable answer.
        """
        tried = []
        for url in self.prefill.order():
            try:
                r = await self.client.post(url + path, json=prefill_body(body), headers=headers, timeout=self.prefill_http_timeout)
            except NOTHING_SENT as e:
                self.prefill.mark(url, False)
                tried.append(f"{url}: {type(e).__name__}")
                continue
            except httpx.HTTPError as e:
                raise _PrefillFailed(f"{url}: {type(e).__name__}: {e}") from None
            self.prefill.mark(url, True)
            if r.status_code >= 500 or r.status_code in (408, 429):
                raise _PrefillFailed(f"{url} answered HTTP {r.status_code}: {r.text[:200]}")
            if r.status_code >= 400:
                return r
            try:
                data = r.json()
            except ValueError:
                raise _PrefillFailed(f"{url} answered HTTP {r.status_code} with no JSON body") from None
            kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
            if not isinstance(kv, dict):
                self.counters["prefill_without_kv_params"] += 1
                return None
            return kv
        raise _PrefillFailed(f"no prefill instance reachable ({'; '.join(tried)})")

    async def _decode(self, path: str, body: dict, headers: dict, stream: bool, send: Any) -> None:
        resp, tried = None, []
        for url in self.decode.order():
            req = self.client.build_request("POST", url + path, json=body, headers=headers, timeout=self.decode_http_timeout)
            try:
                resp = await self.client.send(req, stream=True)
                break
            except NOTHING_SENT as e:
                self.decode.mark(url, False)
                tried.append(f"{url}: {type(e).__name__}")
            except httpx.TimeoutException:
                return await self._error(send, headers, 504, f"decode instance {url} did not answer in time", "GatewayTimeoutError")
            except httpx.HTTPError as e:
                return await self._error(send, headers, 502, f"decode instance {url} failed: {type(e).__name__}: {e}", "BadGatewayError")
        if resp is None:
            return await self._error(send, headers, 502, f"no decode instance reachable ({'; '.join(tried)})", "BadGatewayError")
        self.decode.mark(url, True)
        try:
            back = self._headers_back(resp, headers)
            if not (stream and resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream")):
                try:
                    content = await resp.aread()
                except httpx.HTTPError as e:
                    return await self._error(send, headers, 502, f"decode instance {url} broke off its answer: {type(e).__name__}", "BadGatewayError")
                return await _send_bytes(send, resp.status_code, back, content)
            back += [(k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()]
            await send({"type": "http.response.start", "status": 200, "headers": back})
            pending = b""
            try:
                async for chunk in resp.aiter_bytes():  # whole events only, so an error event stays parseable
                    pending += chunk
                    cut = pending.rfind(b"\n\n") + 2 if len(pending) <= MAX_PENDING_EVENT else len(pending)
                    if cut > 1:
                        await send({"type": "http.response.body", "body": pending[:cut], "more_body": True})
                        pending = pending[cut:]
                tail = pending
            except httpx.HTTPError as e:
                logger.warning("decode instance %s broke off the stream of %s: %s", url, headers["x-request-id"], type(e).__name__)
                err = error_body(f"the decode instance broke off the stream: {type(e).__name__}", 502, "BadGatewayError")
                tail = f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            await resp.aclose()

    def _headers_back(self, resp: Any, headers: dict) -> list:
        out = [(k.encode(), resp.headers[k].encode()) for k in RETURNED if k in resp.headers]
        return out + [(b"x-request-id", headers["x-request-id"].encode())]

    async def _error(self, send: Any, headers: dict, status: int, message: str, err_type: str) -> None:
        back = [(b"content-type", b"application/json"), (b"x-request-id", headers["x-request-id"].encode())]
        await _send_bytes(send, status, back, json.dumps(error_body(message, status, err_type)).encode())

    # -- served by the proxy itself -------------------------------------------------------
    async def health(self) -> JSONResponse:
        async def probe(url: str) -> dict:
            try:
                r = await self.client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
                return {"url": url, "healthy": r.status_code == 200, "status_code": r.status_code}
            except httpx.HTTPError as e:
                return {"url": url, "healthy": False, "error": type(e).__name__}

        pre, dec = await asyncio.gather(asyncio.gather(*map(probe, self.prefill.urls)), asyncio.gather(*map(probe, self.decode.urls)))
        ok = any(p["healthy"] for p in pre) and any(d["healthy"] for d in dec)
        body = {"status": "ok" if ok else "unavailable", "prefill": pre, "decode": dec, **self.counters}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        auth = tuple((k, v) for k, v in request.headers.items() if k in FORWARDED)
        hit = self._models.get(auth)
        if hit and hit[0] > time.monotonic():
            return JSONResponse(hit[1])
        why = "none configured"
        for url in self.decode.order():
            try:
                r = await self.client.get(url + "/v1/models", headers=dict(auth), timeout=HEALTH_TIMEOUT_S * 2)
                data = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as e:
                why = f"{url}: {type(e).__name__}"
                continue
            if data is not None:
                if len(self._models) >= 64:
                    self._models.clear()
                self._models[auth] = (time.monotonic() + MODELS_TTL_S, data)
                return JSONResponse(data)
            if 400 <= r.status_code < 500:  # e.g. the instance wants a key: its answer as is
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
            why = f"{url}: HTTP {r.status_code}"
        return error_response(f"no decode instance answered /v1/models ({why})", 503, "ServiceUnavailableError")


def build_app(prefill: list[str], decode: list[str], api_key: Optional[str] = None, max_body_bytes: int = 32 << 20, **kwargs: Any) -> FastAPI:
    """The proxy's ASGI app; ``kwargs`` go to :class:`Proxy`. Raises ValueError on bad settings."""
    proxy = Proxy(prefill, decode, **kwargs)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await proxy.client.aclose()

    app = FastAPI(title="pagedserve proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=max_body_bytes, max_header_bytes=64 << 10)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.route(request, "/v1/chat/completions")

    app.get("/health")(proxy.health)
    app.get("/v1/models")(proxy.models)
    return app


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (kv_producer), e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help="key the proxy's clients must send (Bearer or X-Api-Key); forwarded to the instances")
    p.add_argument("--prefill-timeout", type=float, default=30.0, help="seconds a prefill may take before the failure policy applies (default 30)")
    p.add_argument(
        "--decode-timeout",
        type=float,
        default=600.0,
        help="longest silence of a decode instance, in seconds, before a 504 or a stream error (default 600)",
    )
    p.add_argument(
        "--on-prefill-failure",
        choices=("fallback", "error"),
        default="fallback",
        help="fallback: the decode instance computes the prompt itself; error: 503 (default fallback)",
    )


def cmd_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    for name in ("httpx", "httpx2", "httpcore"):  # one INFO line per upstream request would bury the log
        logging.getLogger(name).setLevel(logging.WARNING)
    app = build_app(
        args.prefill,
        args.decode,
        api_key=args.api_key,
        prefill_timeout=args.prefill_timeout,
        decode_timeout=args.decode_timeout,
        on_prefill_failure=args.on_prefill_failure,
    )
    logger.info("pagedserve proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
