"""Reasoning outputs (``--reasoning-parser``): the split of a thinking model's text into
reasoning and content, streamed or not (fuzzed against each other), and a tiny random model
whose tokenizer has ``<think>`` / ``</think>`` tokens served in process: reasoning_content,
include_reasoning, a template that closes the thinking block, and a structured-output
constraint that starts only after ``</think>``."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from app_utils import kv_idle, serve, tiny_async_llm
from pagedserve.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
from pagedserve.entrypoints.openai.server_args import ServerArgs

TEXTS = [
    "plain answer",
    "<think>step 1, step 2</think>The answer is 4.",
    "step 1 (the template opened the block)</think>\n\nAnswer",
    "<think>cut by max_tokens",
    "</think>",
    "a <thi",
    "x<think>y</think>z<think>w</think>",
    "</think></think><think>",
    "<<</thin</think>>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_reasoning_adds_up_to_the_split_whatever_the_chunks(text):
    reasoning, content = ReasoningParser.split(text)
    rnd = random.Random(text)
    for _ in range(200):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s = ReasoningStream(thinking=True)
        r, c = [], []
        for p in pieces:
            dr, dc = s.feed(p)
            r.append(dr)
            c.append(dc)
        r.append(s.finish())
        assert "".join(r) == reasoning and "".join(c) == (content or ""), (pieces, r, c)
    assert ReasoningStream(thinking=False).feed(text) == ("", text)


def test_split_rules():
    assert ReasoningParser.split("<think>a</think>b") == ("a", "b")
    assert ReasoningParser.split("a</think>") == ("a", None)
    assert ReasoningParser.split("only thinking") == ("only thinking", None)
    r = ReasoningParser("deepseek_r1", 7, 8)
    assert r.thinks([1, 2]) and r.thinks([7, 8, 7]) and not r.thinks([7, 3, 8, 5])
    q = ReasoningParser("qwen3", 7, 8)
    assert not q.thinks([1], {"enable_thinking": False}) and q.thinks([1], {"enable_thinking": True})


def test_a_tokenizer_without_think_tokens_is_refused(smollm2_dir):
    from pagedserve.model.loader import load_tokenizer

    with pytest.raises(ValueError, match="no single <think> token"):
        ReasoningParser.load("deepseek_r1", load_tokenizer(smollm2_dir))
    with pytest.raises(ValueError, match="reasoning-parser"):
        ServerArgs(reasoning_parser="nope")


CLOSED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_served_reasoning_content_and_constraints_after_think(thinking_model):
    llm = tiny_async_llm(thinking_model)
    try:
        with serve(llm, ServerArgs(reasoning_parser="deepseek_r1")) as url:
            msgs = [{"role": "user", "content": "Think, then say yes or no."}]
            no_tags = {"49152": -100, "49153": -100}
            body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0, "logit_bias": no_tags}
            ids = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": msgs}).json()["tokens"]
            plain = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                              "logit_bias": no_tags}).json()["choices"][0]["text"]
            # No </think> (cut by max_tokens): all of it is reasoning, content null.
            msg = httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert msg["reasoning_content"] == msg["reasoning"] == plain and msg["content"] is None, msg
            assert httpx.post(url + "/v1/chat/completions", json={**body, "include_reasoning": False}).json()[
                "choices"][0]["message"]["reasoning_content"] is None
            deltas = _stream(url, body)
            assert "".join(d.get("reasoning_content", "") for d in deltas) == plain
            assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
            assert "".join(d.get("content") or "" for d in deltas) == ""
            # A constraint starts after </think>: forced first (the bias), then the choice.
            forced = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0, "logit_bias": {"49153": 100},
                      "structured_outputs": {"choice": ["yes", "no"]}}
            choice = httpx.post(url + "/v1/chat/completions", json=forced).json()["choices"][0]
            assert choice["message"]["reasoning_content"] == "" and choice["message"]["content"] in ("yes", "no"), choice
            deltas = _stream(url, forced)
            assert "".join(d.get("content") or "" for d in deltas) == choice["message"]["content"]
        # A template that closes the thinking block: the whole answer is content.
        with serve(llm, ServerArgs(reasoning_parser="deepseek_r1", chat_template=CLOSED)) as url:
            msg = httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert msg["reasoning_content"] is None and msg["content"], msg
        kv_idle(llm)
    finally:
        llm.shutdown()


def _stream(url: str, body: dict) -> list[dict]:
    deltas = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    deltas.append(ch["delta"])
    return deltas


def test_serve_refuses_a_model_without_think_tokens_before_loading_it():
    """A new user found the refusal came only after the engine had loaded (10.8 s here, minutes
    for a big model): it now comes from the tokenizer alone, before the port is bound."""
    import os
    import subprocess
    import sys
    import time

    from app_utils import free_port

    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--reasoning-parser", "deepseek_r1",
           "--port", str(free_port()), "--num-kv-blocks", "64", "--num-threads", "1"]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert res.returncode == 2 and "no single <think> token" in res.stderr, res.stderr[-2000:]
    assert "engine ready" not in res.stderr and "listening" not in res.stderr and time.monotonic() - t0 < 60
