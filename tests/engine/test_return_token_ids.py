"""vLLM's ``return_token_ids``: the prompt's and the generated token ids beside the text, in
completions and chat, streamed (prompt ids once, generated ids per chunk) or not, on a tiny
random model served in process."""
from __future__ import annotations

import json

import httpx
import pytest

from app_utils import kv_idle, serve, tiny_async_llm


@pytest.fixture(scope="module")
def url(tiny_model_factory):
    llm = tiny_async_llm(tiny_model_factory("llama"))
    try:
        with serve(llm) as base:
            yield base
        kv_idle(llm)
    finally:
        llm.shutdown()


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_completions_return_token_ids(url):
    prompts = ["Hello there", "One two three four"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 7, "temperature": 0, "n": 2, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}).json()
    for ch in r["choices"]:
        want_prompt = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": prompts[ch["index"] // 2]}).json()["tokens"]
        assert ch["prompt_token_ids"] == want_prompt
        assert ch["token_ids"] == [int(t.split(":")[1]) for t in ch["logprobs"]["tokens"]] and len(ch["token_ids"]) == 7
    streamed: dict[int, list[int]] = {}
    prompt_ids: dict[int, list] = {}
    for c in _chunks(url, "/v1/completions", {**body, "return_token_ids": True}):
        for ch in c["choices"]:
            streamed.setdefault(ch["index"], []).extend(ch["token_ids"])
            if ch["prompt_token_ids"] is not None:  # null after a choice's first chunk
                prompt_ids.setdefault(ch["index"], []).append(ch["prompt_token_ids"])
    assert streamed == {ch["index"]: ch["token_ids"] for ch in r["choices"]}
    assert prompt_ids == {ch["index"]: [ch["prompt_token_ids"]] for ch in r["choices"]}  # once per choice
    plain = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    assert all("token_ids" not in ch for c in _chunks(url, "/v1/completions", body) for ch in c["choices"])


def test_chat_return_token_ids(url):
    msgs = [{"role": "user", "content": "Name a colour."}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body).json()
    assert r["prompt_token_ids"] == httpx.post(url + "/tokenize", json={"model": "tiny", "messages": msgs}).json()["tokens"]
    ids = r["choices"][0]["token_ids"]
    assert len(ids) == r["usage"]["completion_tokens"] == 6
    chunks = _chunks(url, "/v1/chat/completions", body)
    assert [c["prompt_token_ids"] for c in chunks if c["prompt_token_ids"] is not None] == [r["prompt_token_ids"]]  # the first chunk only
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == ids
    plain = httpx.post(url + "/v1/chat/completions", json={**body, "return_token_ids": False}).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    echo = {**body, "echo": True, "messages": msgs + [{"role": "assistant", "content": "Blue"}]}
    chunks = _chunks(url, "/v1/chat/completions", {**echo, "return_token_ids": False})
    assert all("prompt_token_ids" not in c and "token_ids" not in ch for c in chunks for ch in c["choices"])
    chunks = _chunks(url, "/v1/chat/completions", echo)  # the echoed text's chunk has no ids of its own
    assert chunks[1]["choices"][0]["delta"]["content"] == "Blue" and chunks[1]["choices"][0]["token_ids"] == []
    assert len([t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]) == 6
