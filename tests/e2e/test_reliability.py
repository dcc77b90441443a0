"""Reliability and security guarantees of the server, in process (a tiny random model, the real
app on a loopback port, the engine core in a thread so its state can be checked): overload
503s, deadlines, body/header limits, a step that raises, malicious request chat templates,
and a static check that nothing is unpickled or evaluated. See docs/reliability.md."""
from __future__ import annotations

import ast
import asyncio
import json
import pathlib
import time

try:
    import httpx
except ImportError:  # pragma: no cover
    import httpx2 as httpx
import pytest

from app_utils import kv_idle, serve, tiny_async_llm
from pagedserve.entrypoints.openai.server_args import ServerArgs

LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = tiny_async_llm(tiny_dir, max_num_seqs=1)
    yield llm
    llm.shutdown()


def assert_openai_error(resp: httpx.Response, status: int, err_type: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["type"] == err_type and body["error"]["code"] == status, body
    return body["error"]


def test_overload_is_an_immediate_503_with_retry_after(llm):
    with serve(llm, ServerArgs(max_queued_requests=1)) as base:
        async def burst():
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                async def one():
                    t0 = time.monotonic()
                    r = await c.post("/v1/completions", json=dict(LONG, max_tokens=120))
                    return r, time.monotonic() - t0
                return await asyncio.gather(*(one() for _ in range(8)))

        results = asyncio.run(burst())
        refused = [(r, dt) for r, dt in results if r.status_code == 503]
        served = [(r, dt) for r, dt in results if r.status_code == 200]
        assert len(refused) + len(served) == 8, [r.text for r, _ in results]
        assert refused and served
        for r, dt in refused:
            assert_openai_error(r, 503, "ServiceUnavailableError")
            assert r.headers["retry-after"] == "1"
        assert max(dt for _, dt in refused) < min(dt for _, dt in served)  # refused at once, not after a wait
        for r, _ in served:
            assert r.json()["usage"]["completion_tokens"] == 120
        kv_idle(llm)
        assert httpx.post(base + "/v1/completions", json=dict(LONG, max_tokens=2), timeout=30).status_code == 200


def _success(base: str, reason: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedserve:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.split()[-1])
    raise AssertionError(f"no request_success_total for {reason}")


def test_deadline_ends_the_request_with_finish_reason_timeout_and_frees_blocks(llm):
    with serve(llm, ServerArgs()) as base:
        before = _success(base, "timeout")
        r = httpx.post(base + "/v1/completions", json=dict(LONG, timeout=0.05), timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout"
        assert r.json()["usage"]["completion_tokens"] < 400
        chunks = []
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=30, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True,
                "stream": True, "timeout": 0.05}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        assert chunks[-1]["choices"][0]["finish_reason"] == "timeout"
        kv_idle(llm)
        assert _success(base, "timeout") == before + 2
        bad = httpx.post(base + "/v1/completions", json=dict(LONG, timeout=0), timeout=30)
        assert assert_openai_error(bad, 400, "BadRequestError")["param"] == "timeout"
    with serve(llm, ServerArgs(request_timeout=0.05)) as base:  # the server's default
        r = httpx.post(base + "/v1/completions", json=LONG, timeout=30)
        assert r.json()["choices"][0]["finish_reason"] == "timeout"
        r = httpx.post(base + "/v1/completions", json=dict(LONG, max_tokens=3, timeout=60), timeout=30)
        assert r.json()["choices"][0]["finish_reason"] == "length"  # the request's own timeout wins
        kv_idle(llm)


def test_oversized_body_is_413_and_oversized_headers_431(llm):
    with serve(llm, ServerArgs(max_request_body_bytes=4096, max_header_bytes=2048)) as base:
        r = httpx.post(base + "/v1/completions", json=dict(LONG, prompt="x " * 5000), timeout=30)
        assert_openai_error(r, 413, "RequestEntityTooLargeError")

        def chunked():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000
        r = httpx.post(base + "/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}, timeout=30)
        assert_openai_error(r, 413, "RequestEntityTooLargeError")
        r = httpx.get(base + "/v1/models", headers={"X-Filler": "y" * 3000}, timeout=30)
        assert_openai_error(r, 431, "RequestHeaderFieldsTooLargeError")
        assert httpx.post(base + "/v1/completions", json=dict(LONG, max_tokens=2), timeout=30).status_code == 200
        kv_idle(llm)


MALICIOUS_TEMPLATES = {
    "escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "string bomb": "{{ 'x' * 10**9 }}",
    "filter bomb": "{{ 'x'|center(1000000000) }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested string loops": "{% set s = 'y' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "output bomb": "{% for i in range(90000) %}{{ 'z' * 100 }}{% endfor %}",
    "huge template": "{{ 'a' }}" * 10000,
}


def test_malicious_request_chat_templates_are_400s_within_bounds(llm):
    msgs = [{"role": "user", "content": "hi"}]
    with serve(llm, ServerArgs(trust_request_chat_template=True)) as base:
        for name, template in MALICIOUS_TEMPLATES.items():
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/chat/completions", timeout=60,
                           json={"model": "tiny", "messages": msgs, "max_tokens": 2, "chat_template": template})
            assert time.monotonic() - t0 < 10, name
            err = assert_openai_error(r, 400, "BadRequestError")
            assert err["param"] in ("chat_template", "messages"), (name, err)
        ok = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
        r = httpx.post(base + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": msgs, "max_tokens": 2, "chat_template": ok})
        assert r.status_code == 200, r.text
        r = httpx.post(base + "/tokenize", timeout=60, json={"model": "tiny", "messages": msgs, "chat_template": ok})
        assert r.json()["count"] > 0
        kv_idle(llm)
    with serve(llm, ServerArgs()) as base:  # not trusted: refused without running it
        r = httpx.post(base + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": msgs, "max_tokens": 2, "chat_template": ok})
        assert "trust-request-chat-template" in assert_openai_error(r, 400, "BadRequestError")["message"]


def test_exception_inside_a_step_fails_its_requests_503_and_health_503(tiny_dir):
    llm = tiny_async_llm(tiny_dir)
    core = llm.client.core
    real_step, calls = core.step, [0]

    def failing_step():
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("injected fault in a step")
        return real_step()

    core.step = failing_step
    try:
        with serve(llm, ServerArgs()) as base:
            assert httpx.get(base + "/health", timeout=10).status_code == 200
            events = []
            with httpx.stream("POST", base + "/v1/completions", timeout=30, json=dict(LONG, stream=True)) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
            assert events[-1]["error"]["code"] == 503 and events[-1]["error"]["type"] == "ServiceUnavailableError", events[-1]
            assert "injected fault" in events[-1]["error"]["message"]
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/completions", json=LONG, timeout=30)
            assert_openai_error(r, 503, "ServiceUnavailableError")
            assert time.monotonic() - t0 < 5  # no hang
            assert_openai_error(httpx.get(base + "/health", timeout=10), 503, "ServiceUnavailableError")
            assert_openai_error(httpx.get(base + "/dashboard/api/stream", timeout=10), 503, "ServiceUnavailableError")
    finally:
        llm.shutdown()


BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
BANNED_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
BANNED_ATTRS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("numpy", "load"), ("np", "load")}


def test_nothing_is_unpickled_or_evaluated():
    """Static check of the package: no pickle-family module, torch.load, yaml.load, np.load, eval
    or exec, and no trust_remote_code=True (model code from a checkpoint folder never runs)."""
    root = pathlib.Path(__file__).resolve().parents[2] / "pagedserve"
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                found += [f"{where} imports {n}" for n in names if n.split(".")[0] in BANNED_MODULES]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BANNED_CALLS:
                found.append(f"{where} calls {node.func.id}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (node.value.id, node.attr) in BANNED_ATTRS:
                found.append(f"{where} uses {node.value.id}.{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and not (
                    isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"{where} passes trust_remote_code")
    assert not found, "\n".join(found)


def test_api_key_with_metrics_public(llm):
    with serve(llm, ServerArgs(api_key="k-123", metrics_public=True)) as base:
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        for path in ("/v1/models", "/version", "/openapi.json", "/health/", "/metrics/"):
            assert_openai_error(httpx.get(base + path, timeout=10), 401, "AuthenticationError")
        assert httpx.get(base + "/v1/models", headers={"X-Api-Key": "k-123"}, timeout=10).status_code == 200
        assert_openai_error(httpx.get(base + "/v1/models", headers={"X-Api-Key": "k-1234"}, timeout=10), 401, "AuthenticationError")
        # The dashboard page and its files are public, its data is not.
        for path in ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/api/auth"):
            assert httpx.get(base + path, timeout=10).status_code == 200, path
        assert httpx.get(base + "/dashboard/api/auth", timeout=10).json() == {"api_key_required": True}
        for since in (2**64, -(2**63) - 1, -5, 10**30):  # clamped, never a 5xx (msgpack carries int64)
            r = httpx.get(base + "/dashboard/api/snapshot", params={"since_step": since}, headers={"X-Api-Key": "k-123"}, timeout=10)
            assert r.status_code == 200 and set(r.json()) == {"steps", "blocks", "stats"}, (since, r.text[:200])
        for path in ("/dashboard/api/snapshot", "/dashboard/api/stream", "/dashboard/static/../api/snapshot",
                     "/dashboard/static/%2E%2E/api/snapshot", "/docs", "/redoc", "/docs/static/../../v1/models"):
            assert_openai_error(httpx.get(base + path, timeout=10), 401, "AuthenticationError")


def test_cache_salt_over_http_never_hits_another_tenants_blocks(llm):
    prompt = "tenant isolation " * 20  # several full blocks
    with serve(llm, ServerArgs()) as base:
        def cached(salt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            return httpx.post(base + "/v1/completions", json=body, timeout=30).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        cached("alice")
        assert cached("alice") >= 32  # the same tenant hits its own blocks
        assert cached("bob") == 0 and cached(None) == 0  # another salt, or none, hits nothing of alice's
        assert cached("bob") >= 32
        kv_idle(llm)


def test_the_server_engine_bounds_step_time_by_default(llm):
    # AsyncLLM (the server's engine) fills in the online default; LLM offline leaves it off.
    assert llm.config.max_step_ms == 200.0 and llm.client.core.scheduler.step_cost is not None
