"""vLLM's request ids: the ``X-Request-Id`` header, else the body's ``request_id``, names a
completion (``cmpl-<id>`` / ``chatcmpl-<id>``); two requests sending the same id never collide
in the engine; ``--enable-request-id-headers`` echoes the id on every response. A tiny random
model served in process."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from app_utils import kv_idle, serve
from pagedserve.entrypoints.openai.server_args import ServerArgs


def _stream_ids(url: str, path: str, body: dict, headers: dict | None = None) -> set[str]:
    ids = set()
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids.add(json.loads(line[6:])["id"])
    return ids


COMPLETION = {"model": "tiny", "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_body_id_then_header_id_name_the_response(tiny_url):
    r = httpx.post(tiny_url + "/v1/completions", json={**COMPLETION, "request_id": "job-7"})
    assert r.json()["id"] == "cmpl-job-7" and "x-request-id" not in r.headers  # no header without the flag
    assert httpx.post(tiny_url + "/v1/chat/completions", json={**CHAT, "request_id": "job-7"}).json()["id"] == "chatcmpl-job-7"
    assert _stream_ids(tiny_url, "/v1/completions", {**COMPLETION, "request_id": "s1"}) == {"cmpl-s1"}
    assert _stream_ids(tiny_url, "/v1/chat/completions", {**CHAT, "n": 2, "request_id": "s2"}) == {"chatcmpl-s2"}
    # The header wins over the body, as vLLM's _base_request_id.
    r = httpx.post(tiny_url + "/v1/chat/completions", json={**CHAT, "request_id": "body"}, headers={"X-Request-Id": "hdr-1"})
    assert r.json()["id"] == "chatcmpl-hdr-1"
    assert _stream_ids(tiny_url, "/v1/completions", COMPLETION, headers={"X-Request-Id": "hdr-2"}) == {"cmpl-hdr-2"}
    # Without either: a fresh random hex per request.
    a, b = (httpx.post(tiny_url + "/v1/completions", json=COMPLETION).json()["id"] for _ in range(2))
    assert a != b and re.fullmatch(r"cmpl-[0-9a-f]{32}", a) and re.fullmatch(r"cmpl-[0-9a-f]{32}", b)


def test_the_same_id_twice_at_once_does_not_collide(tiny_url, tiny_llm):
    """Two streams sending one id, each with two prompts, run side by side: each gets its own
    greedy text (what it gets alone), and every block comes back."""
    bodies = [{**COMPLETION, "prompt": ["One two three", "Four five"], "max_tokens": 24},
              {**COMPLETION, "prompt": ["A B C D", "E F"], "max_tokens": 24}]
    alone = [[c["text"] for c in httpx.post(tiny_url + "/v1/completions", json=b, timeout=60).json()["choices"]] for b in bodies]

    async def one(client: httpx.AsyncClient, body: dict) -> tuple[set, list[str]]:
        ids, texts = set(), ["", ""]
        async with client.stream("POST", tiny_url + "/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": "same"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    ids.add(chunk["id"])
                    for ch in chunk["choices"]:
                        texts[ch["index"]] += ch["text"]
        return ids, texts

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, b) for b in bodies))

    for (ids, texts), want in zip(asyncio.run(main()), alone):
        assert ids == {"cmpl-same"} and texts == want
    kv_idle(tiny_llm)


@pytest.mark.parametrize("body_id, header_id", [("", None), ("x" * 257, None), ("a\nb", None), (None, "a\tb"), (None, "")])
def test_bad_ids_get_400(tiny_url, tiny_llm, body_id, header_id):
    body = {**CHAT} if body_id is None else {**CHAT, "request_id": body_id}
    headers = None if header_id is None else {"X-Request-Id": header_id}
    r = httpx.post(tiny_url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "printable characters" in err["message"]
    assert err["param"] == ("request_id" if header_id is None else None)
    assert ("X-Request-Id" in err["message"]) == (header_id is not None)
    ok = httpx.post(tiny_url + "/v1/chat/completions", json={**CHAT, "request_id": "x" * 256})  # the limit itself is fine
    assert ok.status_code == 200 and ok.json()["id"] == "chatcmpl-" + "x" * 256
    kv_idle(tiny_llm)


def test_enable_request_id_headers(tiny_llm):
    with serve(tiny_llm, ServerArgs(enable_request_id_headers=True)) as base:
        r = httpx.post(base + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-42"})
        assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
        with httpx.stream("POST", base + "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "t-s"}) as r:
            assert r.headers["x-request-id"] == "t-s" and r.headers["content-type"].startswith("text/event-stream")
            r.read()
        # Every route, errors included; without a header, a new hex each time.
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/nope")):
            a, b = (httpx.request(method, base + path).headers.get_list("x-request-id") for _ in range(2))
            assert len(a) == len(b) == 1 and a != b and re.fullmatch(r"[0-9a-f]{32}", a[0])
        bad = httpx.post(base + "/v1/completions", json={**COMPLETION, "max_tokens": -1}, headers={"X-Request-Id": "e1"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "e1"
    kv_idle(tiny_llm)
