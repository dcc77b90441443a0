"""The OpenAI-compatible server, end to end: a real ``pagedserve serve`` process on a loopback
port (SmolLM2-135M, float32) driven by the official ``openai`` client and by raw httpx.

One server (with an API key) serves the whole module; tests leave it idle, and the checks that
blocks come back read /metrics (``kv_cache_usage_perc`` and the request gauges)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import openai

try:
    import httpx
except ImportError:  # some environments ship only httpx2 (what the openai client uses there)
    import httpx2 as httpx
import pytest

from server_utils import AUTH, MAX_MODEL_LEN, MODEL, free_port, _metrics, start_tiny_server, wait_idle


# -- AsyncLLM alone (no HTTP) ------------------------------------------------------------------
@pytest.mark.parametrize("engine_process", [False, True], ids=["core-thread", "core-process"])
def test_async_llm_generate_abort_and_errors(smollm2_llm, engine_process):
    from pagedserve import EngineConfig, SamplingParams
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.sampling_params import RequestOutputKind

    ref = smollm2_llm.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    config = EngineConfig(dtype="float32", num_kv_blocks=160, max_model_len=2048, num_threads=1 if engine_process else None)
    llm = AsyncLLM(config, engine_process=engine_process)

    async def wait_idle_async():
        for _ in range(500):
            s = llm.get_stats()
            if llm.num_unfinished_requests() == 0 and s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
                return s
            await asyncio.sleep(0.01)
        raise AssertionError(llm.get_stats())

    async def main():
        delta = SamplingParams(max_tokens=6, temperature=0, output_kind=RequestOutputKind.DELTA)
        # Deltas join to the offline text.
        outs = [o async for o in llm.generate("The capital of France is", delta, "a")]
        assert outs[-1].finished and "".join(o.outputs[0].text for o in outs) == ref.outputs[0].text
        # Leaving early (break + aclose) aborts: the blocks come back.
        long = SamplingParams(max_tokens=500, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA)
        gen = llm.generate("Tell me a story.", long, "b")
        async for o in gen:
            if len(o.outputs[0].token_ids):
                break
        await gen.aclose()
        await wait_idle_async()
        # Cancelling the consuming task aborts too.
        async def consume():
            async for _ in llm.generate("Tell me a story.", long, "c"):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle_async()
        # Refusals come back as ValueError naming the field; the id stays usable.
        with pytest.raises(ValueError, match="prompt"):
            async for _ in llm.generate("", delta, "d"):
                pass
        with pytest.raises(ValueError, match="vocabulary"):
            async for _ in llm.generate([1, 10**7], delta, "d"):
                pass
        outs = [o async for o in llm.generate("The capital of France is", delta, "d")]
        assert "".join(o.outputs[0].text for o in outs) == ref.outputs[0].text
        # A stop string ends the request in the frontend and aborts it in the core.
        text = ref.outputs[0].text
        stop = SamplingParams(max_tokens=40, temperature=0, stop=[text[3:6]])
        outs = [o async for o in llm.generate("The capital of France is", stop, "e")]
        assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].text == text[: text.index(text[3:6])]
        await wait_idle_async()
        assert await llm.reset_prefix_cache() is True

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    if not engine_process:
        core = llm.client.core
        assert not core.scheduler.requests and not core.scheduler.kv_cache_manager.req_to_blocks


def test_async_llm_busy_core_loses_no_message(tiny_model_factory):
    """While the engine core is stopped (a long step), 1,200 requests and 100 aborts queue up:
    more than ZeroMQ's default high-water mark of 1,000. Every request still finishes or is
    aborted, and the core ends idle. The core also survives the thread that started it."""
    import threading

    from pagedserve import EngineConfig, SamplingParams
    from pagedserve.engine.async_llm import AsyncLLM

    box = {}
    config = EngineConfig(model=tiny_model_factory("llama"), dtype="float32", num_kv_blocks=256, max_model_len=256, num_threads=1)
    t = threading.Thread(target=lambda: box.setdefault("llm", AsyncLLM(config)))
    t.start()
    t.join(120)
    llm = box["llm"]
    n = 1200

    async def one(i):
        async for out in llm.generate([5, 6, 7, 10 + i % 1000], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), f"r{i}"):
            if out.finished:
                return out.outputs[0].finish_reason

    async def main():
        os.kill(llm.engine_pid, signal.SIGSTOP)
        try:
            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            await asyncio.sleep(0.5)
            for task in tasks[:100]:
                task.cancel()  # 100 aborts on top
            await asyncio.sleep(0.5)
        finally:
            os.kill(llm.engine_pid, signal.SIGCONT)
        done, pending = await asyncio.wait(tasks, timeout=120)
        assert not pending, len(pending)
        assert sum(1 for task in tasks[100:] if task.result() == "length") == n - 100
        for _ in range(200):
            s = llm.get_stats()
            if s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(llm.get_stats())

    try:
        asyncio.run(main())
        assert llm.is_running and llm.client.is_alive()
    finally:
        llm.shutdown()


def test_async_llm_engine_process_killed_fails_requests_and_never_hangs():
    """SIGKILL of the engine-core process: the live stream ends with EngineDeadError, new requests
    are refused at once, the death callback fires, and nothing waits forever."""
    from pagedserve import EngineConfig, SamplingParams
    from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
    from pagedserve.sampling_params import RequestOutputKind

    died = []
    llm = AsyncLLM(EngineConfig(dtype="float32", num_kv_blocks=160, max_model_len=2048, num_threads=1), on_engine_dead=lambda: died.append(1))
    pid = llm.engine_pid

    async def main():
        long = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA)
        got = 0
        with pytest.raises(EngineDeadError):
            async for o in llm.generate("Tell me a story.", long, "a"):
                got += len(o.outputs[0].token_ids)
                if got == 3:
                    os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("Hello", long, "b"):
                pass

    try:
        t0 = time.monotonic()
        asyncio.run(asyncio.wait_for(main(), 30))
        assert time.monotonic() - t0 < 30
        assert llm.errored and not llm.is_running and died == [1]
    finally:
        llm.shutdown()
    assert llm.client.proc.returncode == -signal.SIGKILL


def test_send_to_a_dead_engine_process_never_blocks(tiny_model_factory):
    """A ZeroMQ PUSH socket whose peer is gone blocks on send; the front sends from its event
    loop, so a request arriving between the core's death and its detection froze the server."""
    import threading

    from pagedserve import EngineConfig
    from pagedserve.engine.core_client import MPClient
    from pagedserve.messages import AbortRequests, EngineCoreRequestType

    client = MPClient(EngineConfig(model=tiny_model_factory("llama"), dtype="float32", num_kv_blocks=64, num_threads=1))
    try:
        os.kill(client.pid, signal.SIGKILL)
        client.proc.wait(10)
        time.sleep(0.2)  # the IPC peer is gone
        t = threading.Thread(target=lambda: [client.send((EngineCoreRequestType.ABORT, AbortRequests([f"r{i}"]))) for i in range(100)], daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), "send blocked on a dead core"
        assert not client.is_alive()
    finally:
        client.shutdown(timeout_s=2)


# -- basics ----------------------------------------------------------------------------------
def test_models_health_version_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "smol"]  # --served-model-name MODEL smol
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert client.completions.create(model="smol", prompt="hi", max_tokens=1).model == "smol"
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/version", headers=AUTH).json()["version"]
    m = _metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert "pagedserve:" + name in m, name
    assert "pagedserve:request_success_total[stop]" in m


def test_auth(server):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == 401 and err["type"] == "AuthenticationError" and "API key" in err["message"]
    assert httpx.get(server + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(server + "/health").status_code == 200  # stays open
    key = AUTH["Authorization"].split()[1]
    for method, path in (("GET", "/metrics"), ("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/v1/models/x")):
        r = httpx.request(method, server + path, json={"prompt": "a", "tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", path
        assert httpx.request(method, server + path, headers={"X-Api-Key": key}, json={"prompt": "a", "tokens": [1]}).status_code in (200, 404), path
    assert httpx.get(server + "/v1/models", headers={"authorization": f"bearer {key}"}).status_code == 200


def test_completion(server, client, smollm2_llm):
    from pagedserve import SamplingParams

    # The server answers what the offline engine (float32 too) answers, whatever the model writes on this host.
    prompt = "The capital of France is"
    want = smollm2_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert (c.text, c.model_extra["token_ids"], c.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    n = len(want.token_ids)
    assert c.text and c.finish_reason == ("length" if n == 8 else "stop")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == n and r.usage.total_tokens == 5 + n
    assert r.object == "text_completion" and r.model == MODEL

    # n=2 with a seed: two different samples, reproducible.
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=11, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 24

    # Several prompts (text and token ids) in one request.
    r = client.completions.create(model=MODEL, prompt=["Hello", "The sky is"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6
    ids = httpx.post(server + "/tokenize", headers=AUTH, json={"prompt": "The sky is"}).json()["tokens"]
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert r2.choices[0].text == r.choices[1].text

    # echo
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("The sky is")


def test_echo_logprobs_and_prompt_logprobs(client, server, smollm2_llm):
    """echo with logprobs scores the echoed prompt (its first token null), as vLLM; max_tokens 0
    with echo returns the prompt alone; ``prompt_logprobs`` is vLLM's per-choice (completions) or
    top-level (chat) list, and refused with stream."""
    from pagedserve import SamplingParams

    prompt = "The sky is blue and the grass"
    ref = smollm2_llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    want = [ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(prompt) and len(lp.tokens) == len(ids) + 2 and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1: len(ids)] == pytest.approx(want, abs=1e-3)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    plp = c.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(want[0], abs=1e-3) and plp[1][str(ids[1])]["rank"] >= 1
    # Streamed: the first chunk carries the prompt and its logprobs.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1, stream=True))
    streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs if ch.choices and ch.choices[0].logprobs else [])]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    # return_tokens_as_token_ids (vLLM's): tokens named by id, in completions and chat.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ref.outputs[0].token_ids]
    assert all(k.startswith("token_id:") for k in r.choices[0].logprobs.top_logprobs[0])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert all(e.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in e.top_logprobs) for e in r.choices[0].logprobs.content)
    # max_tokens 0 with echo: the prompt, nothing generated.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=0)
    assert r.choices[0].text == prompt and len(r.choices[0].logprobs.tokens) == len(ids) and r.usage.completion_tokens == 0
    assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, stop=[ref.outputs[0].text[:3]])
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["stop_reason"] is None  # not the dropped token's stop
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    # Chat: the rendered prompt's logprobs, top level.
    body = httpx.post(server + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])
    for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(server + path, headers=AUTH, timeout=60, json={**extra, "stream": True, "prompt_logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        r = httpx.post(server + path, headers=AUTH, timeout=60, json={**extra, "prompt_logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    wait_idle(server)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, server, smollm2_llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what runs (and what echo
    returns), offline and over HTTP, in completions and chat."""
    from pagedserve import SamplingParams

    prompt = "One two three four five six seven eight nine ten"
    ids = httpx.post(server + "/tokenize", headers=AUTH, json={"prompt": prompt}).json()["tokens"]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    want = smollm2_llm.generate({"prompt_token_ids": ids[-4:]}, greedy, use_tqdm=False)[0]
    got = smollm2_llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert got.prompt_token_ids == ids[-4:] and got.outputs[0].token_ids == want.outputs[0].token_ids
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 4})
    kept = httpx.post(server + "/detokenize", headers=AUTH, json={"tokens": ids[-4:]}).json()["prompt"]
    assert r.usage.prompt_tokens == 4 and r.choices[0].text == kept + want.outputs[0].text
    # allowed_token_ids (vLLM's): sampling keeps to them, greedy or not.
    allowed = ids[:3]
    for t in (0, 1.0):
        r = httpx.post(server + "/v1/completions", headers=AUTH, json={"prompt": prompt, "max_tokens": 6, "temperature": t, "seed": 3,
                                                                        "ignore_eos": True, "allowed_token_ids": allowed, "logprobs": 0,
                                                                        "return_tokens_as_token_ids": True})
        out_ids = [int(tok.split(":")[1]) for tok in r.json()["choices"][0]["logprobs"]["tokens"]]
        assert len(out_ids) == 6 and set(out_ids) <= set(allowed), (out_ids, allowed)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "truncate_prompt_tokens": 5}
    assert httpx.post(server + "/v1/chat/completions", headers=AUTH, json=body).json()["usage"]["prompt_tokens"] == 5
    wait_idle(server)


def test_stop_strings_and_stop_reason(client):
    """Stop strings and stop token ids taken from the greedy answer's own tokens (whatever the
    model writes on this host), so each one is known to occur before max_tokens."""
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    ext = {"ignore_eos": True}  # always 8 tokens to cut
    b = client.completions.create(**kw, logprobs=0, extra_body={**ext, "return_token_ids": True}).choices[0]
    base, ids, pieces = b.text, b.model_extra["token_ids"], b.logprobs.tokens
    assert len(ids) == len(pieces) == 8 and b.finish_reason == "length" and len(base) >= 5, (base, pieces)
    # A stop string: the text of one of the answer's tokens past the first two; the text ends where it first occurs.
    stop = next((p.strip() for p in pieces[2:] if p.strip() and p.strip() in base), None)
    assert stop and stop in base, pieces
    c = client.completions.create(**kw, stop=[stop], extra_body=ext).choices[0]
    assert c.text == base[: base.index(stop)] and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop, (c.text, base, stop)
    # include_stop_str_in_output keeps it (a span of the answer that can lie across tokens).
    span = base[2:5]
    c = client.completions.create(**kw, stop=span, extra_body={**ext, "include_stop_str_in_output": True}).choices[0]
    assert c.text == base[: base.index(span) + len(span)] and c.finish_reason == "stop" and c.model_extra["stop_reason"] == span
    # A stop token id: the answer's fourth token; the answer ends with its first occurrence.
    stop_id = ids[3]
    cut = ids.index(stop_id) + 1
    c = client.completions.create(**kw, extra_body={**ext, "stop_token_ids": [stop_id], "return_token_ids": True}).choices[0]
    assert c.model_extra["token_ids"] == ids[:cut] and base.startswith(c.text)
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop_id


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert p <= 0 and 3 <= len(top) <= 4
        assert abs(max(top.values()) - p) < 1e-4  # greedy: the sampled token is the most likely


def test_chat(server, client, smollm2_llm):
    from pagedserve import SamplingParams

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    c = full.choices[0]
    # The offline engine's answer through the same chat template, whatever the model writes on this host.
    want = smollm2_llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0].outputs[0]
    assert c.message.role == "assistant" and c.message.content and (c.message.content, c.finish_reason) == (want.text, want.finish_reason)
    assert full.usage.completion_tokens == len(want.token_ids) <= 16 and c.finish_reason in ("stop", "length")
    assert full.object == "chat.completion"

    # logprobs: content list of {token, logprob, bytes, top_logprobs}
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and bytes(e.bytes).decode("utf-8", "replace")
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content

    # streaming with usage, via the official client
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [c.finish_reason]


def test_raw_sse_format(server):
    with httpx.stream("POST", server + "/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] == 1


def _stream_completion(client, **kw):
    deltas: dict[int, list[str]] = {}
    finish = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            deltas.setdefault(c.index, []).append(c.text)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return deltas, finish


def test_stream_equals_non_stream_sampled(client):
    kw = dict(model=MODEL, prompt="Write a short story about a robot.", max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, n=2)
    full = client.completions.create(**kw)
    deltas, finish = _stream_completion(client, **kw)
    for c in full.choices:
        assert "".join(deltas[c.index]) == c.text
        assert finish[c.index] == c.finish_reason


def test_stream_no_replacement_chars(client):
    # Emoji are 3-4 byte-level tokens each; CJK likewise. No delta may carry a half character.
    kw = dict(model=MODEL, prompt="🍕🍕🍕🍕🍕🍕🍕🍕🍕🍕🍕", max_tokens=16, temperature=0)
    deltas, _ = _stream_completion(client, **kw)
    text = "".join(deltas[0])
    assert "🍕" in text
    assert not any("\ufffd" in d for d in deltas[0])
    assert text == client.completions.create(**kw).choices[0].text

    msgs = [{"role": "user", "content": "请用中文写一句关于猫的话。"}]
    pieces = []
    for ch in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
    joined = "".join(pieces)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in joined), joined
    assert not any("\ufffd" in p for p in pieces)


# -- bad input (every validation case runs in process in test_openai_validation.py) --------------
BAD_REQUESTS_END_TO_END = [
    # (path, body, expected param, words in message)
    ("/v1/completions", b'{"prompt": "hi", ', None, "JSON"),
    ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}, "prompt", "max_model_len"),
    ("/v1/completions", {"prompt": [1, 2, 49152]}, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "n must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}, "max_completion_tokens", "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1, "stream": True}, "temperature", "temperature"),
]


def test_bad_inputs_are_400_and_lose_nothing(server):
    good = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as http:
        ref = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
        for path, body, param, words in BAD_REQUESTS_END_TO_END:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == 400, (body if not isinstance(body, dict) or len(str(body)) < 200 else path, r.text)
            err = r.json()["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400
            assert words.lower() in err["message"].lower(), (words, err)
            assert err["param"] == param, (param, err)
            ok = http.post("/v1/completions", json=good)
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref
        assert http.get("/health").status_code == 200
    wait_idle(server)


# -- disconnects -------------------------------------------------------------------------------
def test_disconnect_aborts(server):
    before = _metrics(server)["pagedserve:request_success_total[abort]"]
    long = {"prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    # Non-streaming: the client gives up (read timeout closes the connection).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=long, headers=AUTH, timeout=httpx.Timeout(60, read=1.0))
    # Streaming: read a few chunks, then hang up.
    with httpx.stream("POST", server + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "Count to 1000."}], "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    # Several prompts in one streaming request: hanging up aborts all of them.
    with httpx.stream("POST", server + "/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": ["One", "Two", "Three"], "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    m = wait_idle(server, timeout=10)
    assert m["pagedserve:request_success_total[abort]"] - before == 5


@pytest.mark.slow
def test_load_64_streams_with_disconnects(server, smollm2_llm):
    import torch

    from pagedserve import SamplingParams

    from conftest import assert_engine_idle

    t_start = time.monotonic()
    n_clients = 64
    specs = []
    for i in range(n_clients):
        disconnect = i % 4 == 3
        specs.append(dict(
            prompt=f"Request {i}: " + ["Tell me about the sea.", "List some fruits:", "def fibonacci(n):", "The history of Rome"][i % 4] + " " * (i % 3),
            max_tokens=200 if disconnect else 4 + (i * 7) % 45,
            ignore_eos=disconnect or i % 2 == 0,
            disconnect=disconnect,
        ))
    kept = [s for s in specs if not s["disconnect"]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the server fixture: the server process is busy on the other core
    try:
        ref = smollm2_llm.generate(
            [s["prompt"] for s in kept],
            [SamplingParams(max_tokens=s["max_tokens"], temperature=0, ignore_eos=s["ignore_eos"]) for s in kept],
            use_tqdm=False,
        )
    finally:
        torch.set_num_threads(threads)
    assert_engine_idle(smollm2_llm)
    expected = {s["prompt"]: (o.outputs[0].text, o.outputs[0].finish_reason) for s, o in zip(kept, ref)}
    before = _metrics(server)["pagedserve:request_success_total[abort]"]

    async def one(http: httpx.AsyncClient, spec: dict):
        body = {"model": MODEL, "prompt": spec["prompt"], "max_tokens": spec["max_tokens"], "temperature": 0,
                "ignore_eos": spec["ignore_eos"], "stream": True}
        text, finish, n_chunks = [], None, 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    break
                c = json.loads(line[6:])["choices"][0]
                text.append(c["text"])
                finish = c["finish_reason"] or finish
                n_chunks += 1
                if spec["disconnect"] and n_chunks >= 3:
                    return None  # leaving the block closes the connection mid-stream
        return "".join(text), finish

    async def main():
        limits = httpx.Limits(max_connections=n_clients + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=80, limits=limits) as http:
            return await asyncio.gather(*(one(http, s) for s in specs))

    results = asyncio.run(main())
    for spec, res in zip(specs, results):
        if spec["disconnect"]:
            assert res is None
        else:
            assert res == expected[spec["prompt"]], spec
    m = wait_idle(server, timeout=15)
    assert m["pagedserve:request_success_total[abort]"] - before == n_clients // 4
    assert time.monotonic() - t_start < 90, time.monotonic() - t_start
    assert httpx.get(server + "/health").status_code == 200


def test_tokenize_messages_with_special_tokens(server, smollm2_dir):
    """The chat template places the special tokens itself: /tokenize (as chat completions) adds
    none on top unless asked (``add_special_tokens`` defaults to false for messages, as vLLM);
    the tools and chat_template_kwargs are rendered as chat completions renders them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "Hi"}]
    expected = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    r = httpx.post(server + "/tokenize", headers=AUTH, json={"messages": msgs})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == expected
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids[1] != im_start
    r = httpx.post(server + "/tokenize", headers=AUTH, json={"prompt": "Hi there"})
    assert r.json()["tokens"] == tok("Hi there")["input_ids"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": msgs, "tools": tools, "chat_template_kwargs": {"add_generation_prompt": False}}
    counted = httpx.post(server + "/tokenize", headers=AUTH, json=body).json()["count"]
    chat = httpx.post(server + "/v1/chat/completions", headers=AUTH, json={**body, "max_tokens": 1}).json()
    assert counted == chat["usage"]["prompt_tokens"] > len(expected) + 20  # the tool block counted
    # chat_template_kwargs override the named arguments (as vLLM) but not the tokenizer's own.
    no_gen = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False), add_special_tokens=False)["input_ids"]
    assert httpx.post(server + "/tokenize", headers=AUTH, json={"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}}).json()["tokens"] == no_gen
    r = httpx.post(server + "/tokenize", headers=AUTH, json={"messages": msgs, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = httpx.post(server + "/v1/chat/completions", headers=AUTH, json={"messages": msgs, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"  # still needs --trust-request-chat-template


def test_completion_prompts_honour_add_special_tokens():
    """``add_special_tokens`` reaches the tokenizer (true by default for completions, as vLLM):
    a client that renders its own template with the BOS sends false."""
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion

    calls = []

    class Tokenize:
        def tokenize(self, text, add_special_tokens, field):
            calls.append(add_special_tokens)
            return [1, 2]

        def check_token_ids(self, ids):
            pass

    serving = object.__new__(OpenAIServingCompletion)
    serving.input_processor = Tokenize()
    serving.tokenized_prompts(["a", [5, 6]], False)
    serving.tokenized_prompts("a")
    assert calls == [False, True]


def test_continuous_usage_stats(server, client):
    body = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in with_text] == list(range(1, 7))
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in with_text)
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens == 6 == full.usage.completion_tokens
    assert last.usage.total_tokens == full.usage.total_tokens
    assert "".join(c.choices[0].text for c in with_text) == full.choices[0].text
    # Per choice, as vLLM: each of n = 2 choices of two prompts counts its own tokens and prompt.
    two = dict(body, prompt=["The capital of France is", "Hi"], n=2)
    chunks = [c for c in client.completions.create(**two, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}) if c.choices]
    for i in range(4):
        mine = [c.usage for c in chunks if c.choices[0].index == i]
        assert [u.completion_tokens for u in mine] == list(range(1, 7))
        assert {u.prompt_tokens for u in mine} == {full.usage.prompt_tokens if i < 2 else len(httpx.post(
            server + "/tokenize", headers=AUTH, json={"prompt": "Hi"}).json()["tokens"])}
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, n=2, extra_body={"ignore_eos": True})
    chunks = [c for c in client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
              if c.choices and c.choices[0].delta.content]
    for i in range(2):
        assert [c.usage.completion_tokens for c in chunks if c.choices[0].index == i] == list(range(1, 5))


def test_streamed_usage_reports_cached_tokens_as_the_full_response_does(server, client):
    text = "Prefix caching is counted the same way streamed or not. " * 4  # > 2 full blocks
    body = dict(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    client.completions.create(**body)  # its blocks now cached
    full = client.completions.create(**body)
    cached = full.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0
    last = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))[-1]
    assert last.usage.prompt_tokens_details.cached_tokens == cached
    chat = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, temperature=0)
    client.chat.completions.create(**chat)
    full = client.chat.completions.create(**chat)
    assert full.usage.prompt_tokens_details.cached_tokens >= 32
    last = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))[-1]
    assert last.usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens_details.cached_tokens


def test_metric_histograms_count_what_happened(server, client):
    before = wait_idle(server)
    n, max_tokens = 3, 5
    prompt_tokens = 0
    for i in range(n):
        r = client.completions.create(model=MODEL, prompt=f"Count with me: {i}", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        prompt_tokens += r.usage.prompt_tokens
    after = wait_idle(server)

    def delta(key):
        return after[key] - before.get(key, 0.0)

    assert delta("pagedserve:time_to_first_token_seconds_count") == n
    assert delta("pagedserve:e2e_request_latency_seconds_count") == n
    assert delta("pagedserve:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert delta("pagedserve:generation_tokens_total") == n * max_tokens
    assert delta("pagedserve:prompt_tokens_total") == prompt_tokens
    assert delta("pagedserve:request_success_total[length]") == n
    assert delta("pagedserve:time_to_first_token_seconds_sum") > 0 and delta("pagedserve:e2e_request_latency_seconds_sum") > 0
    assert delta("pagedserve:e2e_request_latency_seconds_sum") >= delta("pagedserve:time_to_first_token_seconds_sum")
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"pagedserve:request_{phase}_time_seconds_count") == n
    assert delta("pagedserve:request_prompt_tokens_sum") == prompt_tokens and delta("pagedserve:request_prompt_tokens_count") == n
    assert delta("pagedserve:request_generation_tokens_sum") == n * max_tokens
    assert delta("pagedserve:iteration_tokens_total_count") >= max_tokens  # at least one step per token
    assert delta("pagedserve:iteration_tokens_total_sum") == prompt_tokens + n * (max_tokens - 1)


def _children(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (the engine process is started by the server's loading
    thread and listed under it until that thread exits)."""
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(x) for x in fh.read().split()]
        except FileNotFoundError:  # the thread just exited (its children moved to another)
            pass
    return sorted(set(out))


def test_engine_process_killed_health_503_errors_and_nonzero_exit(tiny_model_factory, tmp_path):
    """SIGKILL of the engine-core process under a live stream: the stream ends with an error
    event, /health turns 503 (not a hang, not a connection error), and the server exits with a
    non-zero status by itself, all in bounded time."""
    model = tiny_model_factory("llama")
    proc, base, log_path = start_tiny_server(model, tmp_path, "--num-kv-blocks", "64", "--max-model-len", "512")
    try:
        (core_pid,) = _children(proc.pid)
        events = []
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    os.kill(core_pid, signal.SIGKILL)
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "engine" in err["message"]
        statuses, deadline = [], time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(base + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                statuses.append("down")
            time.sleep(0.05)
        assert statuses and statuses[0] == 503, statuses[:5]
        assert proc.wait(30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("shutdown_timeout", [pytest.param(60, marks=pytest.mark.slow), 1])
def test_sigterm_to_the_process_group_drains_then_exits_0(tiny_model_factory, tmp_path, shutdown_timeout):
    """A supervisor's SIGTERM to the server's whole process group: new requests get 503 at once,
    the running stream is not cut (every token, then [DONE]), the engine core (same group)
    does not die on its own, and the server exits 0 after stopping it. With a short
    --shutdown-timeout the stream still running then ends with a 503 error event (not a cut
    connection or a plain-text 500), an open dashboard stream ends too, and the exit is prompt."""
    import threading

    model = tiny_model_factory("llama")
    proc, base, log_path = start_tiny_server(model, tmp_path, "--num-kv-blocks", "128", "--max-model-len", "1024",
                                             "--shutdown-timeout", str(shutdown_timeout), new_session=True)
    try:
        (core_pid,) = _children(proc.pid)
        dashboard_ended = threading.Event()

        def watch_dashboard():
            with httpx.stream("GET", base + "/dashboard/api/stream", timeout=60) as d:
                for _ in d.iter_lines():
                    pass
            dashboard_ended.set()

        threading.Thread(target=watch_dashboard, daemon=True).start()
        events, refused = [], []
        body = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    os.killpg(proc.pid, signal.SIGTERM)
                    t_term = time.monotonic()
                    late = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
                    refused.append((late.status_code, late.json()["error"]["type"], len(events)))
        assert refused == [(503, "ServiceUnavailableError", 3)]
        if shutdown_timeout == 1:
            assert events[-2].startswith("data: {") and json.loads(events[-2][6:])["error"]["code"] == 503, events[-3:]
            assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
            assert proc.wait(30) == 0, log_path.read_text()[-3000:]
            assert time.monotonic() - t_term < 8, "the drain did not end at --shutdown-timeout"
            assert dashboard_ended.wait(5)
            assert "Exception in ASGI application" not in log_path.read_text()
            return
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) > 900  # nothing cut
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
        assert dashboard_ended.wait(5)
        with pytest.raises(ProcessLookupError):
            for _ in range(100):  # reaped by the server before it exited
                os.kill(core_pid, 0)
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group
        except ProcessLookupError:
            pass


# -- structured output through the official client -------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"],
          "additionalProperties": False}


def test_response_format_json_schema_chat_and_completions(client):
    import jsonschema

    msgs = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    full = r.choices[0].message.content
    jsonschema.validate(json.loads(full), PERSON)
    chunks = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, seed=4, n=3,
                                       response_format={"type": "json_object"})
    for ch in r.choices:
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict)
    c = client.completions.create(model=MODEL, prompt="A person in JSON: ", max_tokens=60, temperature=0, extra_body={"response_format": fmt})
    if c.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(c.choices[0].text), PERSON)
    else:
        assert c.choices[0].text.startswith("{")


def test_vllm_structured_output_fields(client):
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Phone: ", max_tokens=20, temperature=0, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0, extra_body={"guided_json": PERSON})
    assert set(json.loads(r.choices[0].message.content)) == {"name", "age"}


def test_front_flags_and_health_503_while_loading(tiny_model_factory, tmp_path):
    """A server with --chat-template FILE, --generation-config DIR, --enable-log-requests and
    --log-level after the subcommand: /health is 503 while the engine loads, then 200; the
    template and the sampling defaults apply; requests are logged; a second server on the same
    port fails at once with one line."""
    model = tiny_model_factory("llama")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    port = free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("PAGEDSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", model, "--port", str(port), "--dtype", "float32",
           "--num-kv-blocks", "64", "--max-model-len", "256", "--chat-template", str(template), "--generation-config", str(gen),
           "--enable-log-requests", "--log-level", "info", "--uvicorn-log-level", "warning", "--frontend-nice", "7"]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        statuses = []
        deadline = time.monotonic() + 120
        while not statuses or statuses[-1] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                statuses.append(httpx.get(base + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                statuses.append("refused")
            time.sleep(0.02)
        first = next(s for s in statuses if s != "refused")
        assert first == 503 and set(statuses) <= {503, 200, "refused"}, statuses[:10]
        # --frontend-nice: the front's threads yield to the engine core, which keeps our priority.
        base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        if base_nice < 7:  # otherwise 7 changes nothing to check
            (core_pid,) = _children(proc.pid)
            front = {}
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                try:
                    front[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
                except ProcessLookupError:  # the loading thread has just ended
                    pass
            assert set(front.values()) == {7}, front
            assert os.getpriority(os.PRIO_PROCESS, core_pid) == base_nice
        r = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert httpx.post(base + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == "[user] hi\n"
        body = {"messages": [{"role": "user", "content": "hello"}]}
        a = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
        b = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
        assert a["usage"]["completion_tokens"] == 3 and a["choices"][0]["message"] == b["choices"][0]["message"]
        for extra in ({}, {"max_tokens": None}, {"max_tokens": 50}):  # max_new_tokens caps completions too
            c = httpx.post(base + "/v1/completions", json={"prompt": "hello", "ignore_eos": True, **extra}, timeout=60).json()
            assert c["usage"]["completion_tokens"] == 3, (extra, c)
        nulls = {"messages": [{"role": "user", "content": "hi"}], "n": None, "stream": None, "stop": None, "seed": None,
                 "temperature": None, "logprobs": None, "echo": None, "ignore_eos": None}
        r = httpx.post(base + "/v1/chat/completions", json=nulls, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "n": None, "echo": None, "best_of": None}, timeout=60)
        assert r.status_code == 200, r.text
        # The port is taken: a second server says so in one line, before loading anything.
        t0 = time.monotonic()
        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        assert second.returncode == 2 and "cannot listen" in second.stderr and time.monotonic() - t0 < 20, second.stderr[-2000:]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text()
    assert "request chatcmpl-" in text and "default sampling parameters" in text


def test_front_process_has_no_torch(server, client):
    """The server's front (HTTP, tokenizing, detokenizing, grammars) runs without torch: only the
    engine core process loads it. Checked after the requests of this file (chat, tools,
    logprobs, structured output, streams) went through it; its memory stays small."""
    from server_utils import SERVER_PIDS

    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2)
    pid = SERVER_PIDS[server]
    with open(f"/proc/{pid}/maps") as fh:
        torch_libs = sorted({line.split()[-1] for line in fh if "libtorch" in line})
    assert torch_libs == []
    with open(f"/proc/{pid}/status") as fh:
        rss_kib = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    assert rss_kib < 300 * 1024, f"front RSS {rss_kib // 1024} MiB"  # ~220 MiB measured; torch alone adds more
