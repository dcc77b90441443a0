"""``pagedserve proxy`` against fake prefill/decode instances (small FastAPI apps served by uvicorn
from threads of the test process on loopback ports) that record what they receive."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from pagedserve.entrypoints.proxy import build_app
from pagedserve.entrypoints.proxy_upstreams import PREFILL_KV_PARAMS
from server_utils import free_port

try:
    import httpx
except ImportError:  # pragma: no cover
    import httpx2 as httpx

KEY = "proxy-key"


class ThreadServer:
    """``app`` on a free loopback port, served from a thread; stop() returns in bounded time."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        assert not self.thread.is_alive()


class Fake:
    """A fake instance. ``mode``: ok | 500 | 400 | slow (answers after 30 s unless the client
    leaves) | nojson; decode streams also: die (breaks after 2 events) | endless (until the
    client leaves)."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.mode, self.seen, self.events, self.models_calls = "ok", [], [], 0
        app = FastAPI()
        app.post("/v1/completions")(self.handle)
        app.post("/v1/chat/completions")(self.handle)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=503 if self.mode == "unhealthy" else 200)

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self.models_calls += 1
            return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": self.name}]})

        self.srv = ThreadServer(app)
        self.url = self.srv.url

    def reset(self) -> None:
        self.mode, self.seen, self.events, self.models_calls = "ok", [], [], 0

    async def handle(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:  # the client left before this loop read its request
            self.events.append("disconnected")
            return Response(status_code=499)
        self.seen.append({"path": request.url.path, "body": body, "headers": dict(request.headers)})
        mode = self.mode
        if mode == "500":
            return JSONResponse({"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}, 500)
        if mode == "400":
            return JSONResponse({"error": {"message": "bad prompt", "type": "BadRequestError", "param": "prompt", "code": 400}}, 400)
        if mode == "nojson":
            return Response(b"<html>", media_type="text/html")
        if mode == "slow":
            for _ in range(600):
                if await request.is_disconnected():
                    self.events.append("disconnected")
                    return Response(status_code=499)
                await asyncio.sleep(0.05)
        if self.role == "prefill" and mode == "nokv":
            return JSONResponse({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": None})
        if self.role == "prefill":
            kv = {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_request_id": request.headers.get("x-request-id"),
                  "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 14579, "remote_num_tokens": 20}
            return JSONResponse({"id": "cmpl-p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "kv_transfer_params": kv})
        if not body.get("stream"):
            return JSONResponse({"served_by": self.name, "choices": [{"index": i, "text": f"answer{i}"} for i in range(body.get("n", 1))]},
                                headers={"x-private": "no"})
        return StreamingResponse(self.stream(mode), media_type="text/event-stream")

    async def stream(self, mode: str):
        done = False
        try:
            for i in range(200 if mode == "endless" else 4):
                if mode == "die" and i == 2:
                    raise RuntimeError("fake decode instance dies mid-stream")
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f'tok{i}'}]})}\n\n"
                await asyncio.sleep(0.05 if mode == "endless" else 0.01)
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                self.events.append("stream closed")


@pytest.fixture(scope="module")
def fakes():
    made = {n: Fake(n, "prefill" if n[0] == "P" else "decode") for n in ("P1", "P2", "D1", "D2")}
    yield made
    for f in made.values():
        f.srv.stop()


@pytest.fixture(autouse=True)
def _reset(fakes):
    for f in fakes.values():
        f.reset()


@pytest.fixture(scope="module")
def make_proxy():
    started = []

    def make(prefill, decode, **kw):
        srv = ThreadServer(build_app(prefill, decode, **kw))
        started.append(srv)
        return srv

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def proxy(fakes, make_proxy):
    return make_proxy([fakes["P1"].url], [fakes["D1"].url], api_key=KEY)


AUTH = {"Authorization": f"Bearer {KEY}"}
DEAD = "http://127.0.0.1:1"  # nothing listens on port 1: connection refused at once


def post(url, body, headers=AUTH, path="/v1/completions", timeout=20.0):
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


def sse_events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e]


def test_body_rewriting_and_headers(fakes, proxy):
    body = {"model": "m", "prompt": "hello", "max_tokens": 7, "temperature": 0.5, "best_of": 2, "n": 2, "min_tokens": 3}
    r = post(proxy.url, body, headers={**AUTH, "X-Request-Id": "rid-1"})
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "D1" and len(r.json()["choices"]) == 2
    assert r.headers["x-request-id"] == "rid-1" and "x-private" not in r.headers
    (p,), (d,) = fakes["P1"].seen, fakes["D1"].seen
    assert p["body"] == {**body, "max_tokens": 1, "stream": False, "n": 1, "best_of": 1, "min_tokens": 0, "kv_transfer_params": PREFILL_KV_PARAMS}
    assert d["body"] == {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "P1", "remote_request_id": "rid-1",
                                                        "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 14579,
                                                        "remote_num_tokens": 20}}
    for seen in (p, d):
        assert seen["headers"]["x-request-id"] == "rid-1" and seen["headers"]["authorization"] == AUTH["Authorization"]
    # No X-Request-Id from the client: one is made, the same for both instances.
    r = post(proxy.url, body)
    rid = r.headers["x-request-id"]
    assert rid and fakes["P1"].seen[1]["headers"]["x-request-id"] == rid == fakes["D1"].seen[1]["headers"]["x-request-id"]


def test_streaming_chat_passthrough(fakes, proxy):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}, "n": 3}
    r = post(proxy.url, body, path="/v1/chat/completions")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert sse_events(r.text) == [json.dumps({"choices": [{"index": 0, "text": f"tok{i}"}]}) for i in range(4)] + ["[DONE]"]
    (p,), (d,) = fakes["P1"].seen, fakes["D1"].seen
    assert p["path"] == d["path"] == "/v1/chat/completions"
    assert p["body"]["stream"] is False and "stream_options" not in p["body"] and p["body"]["n"] == 1
    assert p["body"]["max_tokens"] == p["body"]["max_completion_tokens"] == 1
    assert d["body"]["stream_options"] == {"include_usage": True} and d["body"]["n"] == 3 and d["body"]["max_completion_tokens"] == 9
    assert "max_tokens" not in d["body"] and d["body"]["kv_transfer_params"]["remote_engine_id"] == "P1"


def test_round_robin_and_dead_upstream_skipped(fakes, make_proxy):
    px = make_proxy([fakes["P1"].url, fakes["P2"].url], [fakes["D1"].url, fakes["D2"].url])
    for _ in range(4):
        assert post(px.url, {"prompt": "x"}, headers={}).status_code == 200
    assert [len(fakes[n].seen) for n in ("P1", "P2", "D1", "D2")] == [2, 2, 2, 2]
    # A refused connection: the next instance takes the request; the dead one is skipped after.
    px = make_proxy([DEAD, fakes["P2"].url], [fakes["D1"].url, DEAD])
    for _ in range(4):
        r = post(px.url, {"prompt": "x"}, headers={})
        assert r.status_code == 200 and r.json()["served_by"] == "D1"
    assert len(fakes["P2"].seen) == 6 and all("remote_engine_id" in d["body"]["kv_transfer_params"] for d in fakes["D1"].seen)
    assert httpx.get(px.url + "/health").json()["prefill_fallbacks"] == 0


@pytest.mark.parametrize("failure", ["dead", "slow", "500", "nojson"])
def test_prefill_failure_falls_back(fakes, make_proxy, failure):
    px = make_proxy([DEAD if failure == "dead" else fakes["P1"].url], [fakes["D1"].url], prefill_timeout=0.5)
    fakes["P1"].mode = failure
    body = {"prompt": "x", "max_tokens": 5, "stream": True}
    t0 = time.monotonic()
    r = post(px.url, body, headers={})
    assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
    assert time.monotonic() - t0 < 5
    (d,) = fakes["D1"].seen
    assert d["body"] == body  # no kv_transfer_params: the decode instance computes the prompt
    h = httpx.get(px.url + "/health").json()
    assert h["prefill_fallbacks"] == h["prefill_failures"] == 1
    if failure == "slow":  # the timed-out prefill request was closed, so the instance can abort it
        _wait_event(fakes["P1"], "disconnected")


def test_prefill_without_kv_params(fakes, make_proxy):
    px = make_proxy([fakes["P1"].url], [fakes["D1"].url])
    fakes["P1"].mode = "nokv"  # not a kv_producer: the decode instance computes the prompt, counted
    r = post(px.url, {"prompt": "x"}, headers={})
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    assert "kv_transfer_params" not in fakes["D1"].seen[0]["body"]
    h = httpx.get(px.url + "/health").json()
    assert h["prefill_without_kv_params"] == 1 and h["prefill_fallbacks"] == 0


def test_prefill_failure_error_policy(fakes, make_proxy):
    px = make_proxy([DEAD], [fakes["D1"].url], on_prefill_failure="error")
    r = post(px.url, {"prompt": "x"}, headers={})
    assert r.status_code == 503
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "ServiceUnavailableError" and err["code"] == 503
    assert "prefill" in err["message"] and not fakes["D1"].seen


def test_prefill_4xx_passes_through(fakes, proxy):
    fakes["P1"].mode = "400"
    r = post(proxy.url, {"prompt": "x", "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "bad prompt", "type": "BadRequestError", "param": "prompt", "code": 400}}
    assert not fakes["D1"].seen


def test_decode_errors(fakes, proxy, make_proxy):
    fakes["D1"].mode = "400"  # the decode's own error body, as is
    r = post(proxy.url, {"prompt": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad prompt"
    px = make_proxy([fakes["P1"].url], [DEAD])
    r = post(px.url, {"prompt": "x"}, headers={})
    assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
    px = make_proxy([fakes["P1"].url], [fakes["D1"].url], decode_timeout=0.5)
    fakes["D1"].mode = "slow"
    r = post(px.url, {"prompt": "x"}, headers={})
    assert r.status_code == 504 and r.json()["error"]["type"] == "GatewayTimeoutError"


def test_decode_dies_mid_stream(fakes, proxy):
    fakes["D1"].mode = "die"
    r = post(proxy.url, {"prompt": "x", "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["tok0", "tok1"]
    assert len(events) == 4 and events[-1] == "[DONE]"
    err = json.loads(events[2])["error"]
    assert err["type"] == "BadGatewayError" and err["code"] == 502


def _wait_event(fake, event, timeout=15.0):
    """Wait for ``fake`` to record ``event``. The bound is generous for a loaded 2-core CI box
    (a close seen 5 s late failed once there); a proxy that never closes still fails, since a
    slow fake answers only after 30 s."""
    deadline = time.monotonic() + timeout
    while event not in fake.events:
        assert time.monotonic() < deadline, f"{fake.name} saw no {event!r}: {fake.events}"
        time.sleep(0.05)


def test_client_disconnect_closes_upstream(fakes, proxy):
    fakes["D1"].mode = "endless"
    with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": "x", "stream": True}, headers=AUTH, timeout=10) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    _wait_event(fakes["D1"], "stream closed")
    # While the prefill runs: the prefill request closes and the decode instance is never called.
    fakes["P1"].mode = "slow"
    with pytest.raises(httpx.TimeoutException):
        post(proxy.url, {"prompt": "x"}, timeout=0.5)
    _wait_event(fakes["P1"], "disconnected")
    time.sleep(0.2)
    assert len(fakes["D1"].seen) == 1


def test_health(fakes, proxy, make_proxy):
    r = httpx.get(proxy.url + "/health")  # open without the key
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["prefill"][0]["url"] == fakes["P1"].url and h["decode"][0]["healthy"] is True
    fakes["D1"].mode = "unhealthy"
    assert httpx.get(proxy.url + "/health").status_code == 503
    r = httpx.get(make_proxy([DEAD], [fakes["D2"].url]).url + "/health")
    assert r.status_code == 503 and r.json()["prefill"][0] == {"url": DEAD, "healthy": False, "error": "ConnectError"}


def test_models(fakes, proxy, make_proxy):
    for _ in range(2):
        r = httpx.get(proxy.url + "/v1/models", headers=AUTH)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
    assert fakes["D1"].models_calls == 1  # cached
    r = httpx.get(make_proxy([fakes["P1"].url], [DEAD]).url + "/v1/models")
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_auth_limits_and_bad_json(fakes, proxy, make_proxy):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = post(proxy.url, {"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(proxy.url + "/v1/models", headers=headers).status_code == 401
    assert not fakes["P1"].seen and not fakes["D1"].seen
    r = post(proxy.url, {"prompt": "x"}, headers={"X-Api-Key": KEY})
    assert r.status_code == 200 and fakes["D1"].seen[0]["headers"]["x-api-key"] == KEY
    r = httpx.post(proxy.url + "/v1/completions", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    px = make_proxy([fakes["P1"].url], [fakes["D1"].url], max_body_bytes=1000)
    r = post(px.url, {"prompt": "x" * 2000}, headers={})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_cli_proxy_process(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "proxy", "--prefill", DEAD, "--decode", DEAD, "--port", str(port),
           "--prefill-timeout", "2"]
    log = open(tmp_path / "proxy.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 502  # fallback to a dead decode instance
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "proxy.log").read_text()


def test_bad_settings():
    for kw in (dict(prefill=["localhost:8100"], decode=["http://127.0.0.1:1"]), dict(prefill=[], decode=["http://127.0.0.1:1"]),
               dict(prefill=[DEAD], decode=[DEAD], prefill_timeout=0), dict(prefill=[DEAD], decode=[DEAD], on_prefill_failure="retry")):
        with pytest.raises(ValueError):
            build_app(**kw)
