"""Reasoning outputs (``--reasoning-parser``): the split of a thinking model's text into
reasoning and content, streamed or not (fuzzed against each other), and a tiny random model
whose tokenizer has ``<think>`` / ``</think>`` tokens served in process: reasoning_content,
include_reasoning, a template that closes the thinking block, a structured-output
constraint that starts only after ``</think>``, and qwen3's rule (reasoning only after a
``<think>`` in the prompt or at the start of the output)."""
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
    "<thi",
    "<think",
    "<think>",
    "<think>a</think>b<think>c",
    " <think>a</think>b",
    "",
]


@pytest.mark.parametrize("thinking", [True, None, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_reasoning_adds_up_to_the_split_whatever_the_chunks(text, thinking):
    reasoning, content = ReasoningParser.split(text, thinking)
    rnd = random.Random(text)
    for _ in range(200):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(0, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s = ReasoningStream(thinking)
        r, c = [], []
        for p in pieces:
            dr, dc = s.feed(p)
            r.append(dr)
            c.append(dc)
        dr, dc = s.finish()
        r.append(dr)
        c.append(dc)
        assert "".join(r) == (reasoning or "") and "".join(c) == (content or ""), (pieces, r, c)
    assert ReasoningStream(thinking=False).feed(text) == ("", text)


def test_split_rules():
    assert ReasoningParser.split("<think>a</think>b") == ("a", "b")
    assert ReasoningParser.split("a</think>") == ("a", None)
    assert ReasoningParser.split("only thinking") == ("only thinking", None)
    r = ReasoningParser("deepseek_r1", 7, 8)
    assert r.thinks([1, 2]) and r.thinks([7, 8, 7]) and not r.thinks([7, 3, 8, 5])
    q = ReasoningParser("qwen3", 7, 8)
    assert not q.thinks([7], {"enable_thinking": False}) and q.thinks([7, 1], {"enable_thinking": True})


def test_qwen3_is_in_reasoning_only_after_a_think_tag():
    """vLLM's qwen3 rule: with no <think> in the prompt or at the start of the output, the
    output is content, finished or cut; deepseek_r1 reads the same output as reasoning."""
    q, d = ReasoningParser("qwen3", 7, 8), ReasoningParser("deepseek_r1", 7, 8)
    assert q.thinking([1, 2]) is None and d.thinking([1, 2]) is True
    assert q.thinking([7, 1]) is True and q.thinking([7, 8, 1]) is False and q.thinking([7, 1], {"enable_thinking": False}) is False
    assert not q.thinks([1, 2])  # no tag in the prompt: constrained from the first token
    split = ReasoningParser.split
    assert split("The answer is 4.", None) == (None, "The answer is 4.")
    assert split("The answer is 4.", True) == ("The answer is 4.", None)
    assert split("<think>a</think>b", None) == ("a", "b") and split("<think>cut", None) == ("cut", None)
    assert split("x<think>a</think>b", None) == (None, "x<think>a</think>b")
    assert split("a</think>b", None) == (None, "a</think>b") and split("<think>a</think>b", False) == (None, "<think>a</think>b")
    assert q.reasoning_tokens([7, 1, 8, 2], None) == 3 and q.reasoning_tokens([1, 8, 2], None) == 0
    assert q.reasoning_tokens([1, 8, 2], True) == 2 and q.reasoning_tokens([7, 1], False) == 0
    # Streamed delta by delta: nothing is held back but a possible start of <think> at the start.
    s = ReasoningStream(None)
    assert [s.feed(p) for p in ("<", "thi", "nk>a</", "think>b")] == [("", ""), ("", ""), ("a", ""), ("", "b")]
    s = ReasoningStream(None)
    assert [s.feed(p) for p in ("<", "b", "c<think>")] + [s.finish()] == [("", ""), ("", "<b"), ("", "c<think>"), ("", "")]
    s = ReasoningStream(None)
    assert [s.feed(p) for p in ("Hi", " there")] + [s.finish()] == [("", "Hi"), ("", " there"), ("", "")]
    s = ReasoningStream(None)
    assert s.feed("<thi") == ("", "") and s.finish() == ("", "<thi")


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


OPEN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n<think>\n")


def _answer(url: str, body: dict) -> tuple[dict, dict]:
    """The message of a chat answer and the fields of its streamed deltas joined (None where
    no delta carried one), with the streamed finish_reason."""
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    deltas = _stream(url, body)
    joined = {k: "".join(d[k] for d in deltas if d.get(k) is not None) if any(d.get(k) is not None for d in deltas) else None
              for k in ("reasoning_content", "reasoning")}
    joined["content"] = "".join(d.get("content") or "" for d in deltas) or None
    return {**choice["message"], "finish_reason": choice["finish_reason"]}, joined


def test_served_qwen3_reasoning_only_after_a_think_tag(thinking_model):
    """qwen3 (vLLM's rule): an answer with no <think> in the prompt or at its start is content,
    finished or cut by max_tokens, and its constraint starts at the first token; <think> at the
    start of the answer or open in the prompt makes reasoning; streamed equals non-streamed."""
    llm = tiny_async_llm(thinking_model)
    try:
        msgs = [{"role": "user", "content": "Say yes or no."}]
        no_tags = {"49152": -100, "49153": -100}
        with serve(llm, ServerArgs(reasoning_parser="qwen3")) as url:
            ids = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": msgs}).json()["tokens"]
            assert 49152 not in ids and 49153 not in ids

            def plain(**kw):
                c = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "temperature": 0, "logit_bias": no_tags,
                                                              **kw}).json()["choices"][0]
                return c["text"], c["finish_reason"]

            body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0, "logit_bias": no_tags}
            # No tags, cut by max_tokens: all content (it used to be all reasoning, content null).
            text, _ = plain(max_tokens=6)
            msg, streamed = _answer(url, body)
            assert (msg["content"], msg["reasoning_content"], msg["reasoning"], msg["finish_reason"]) == (text, None, None, "length"), msg
            assert streamed == {"reasoning_content": None, "reasoning": None, "content": text}
            msg, streamed = _answer(url, {**body, "include_reasoning": False})
            assert msg["content"] == streamed["content"] == text and msg["reasoning_content"] is None
            # No tags, finished (a stop token): all content.
            stop_id = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                                 "logit_bias": no_tags, "return_token_ids": True}).json()["choices"][0]["token_ids"][3]
            text, finish = plain(max_tokens=6, stop_token_ids=[stop_id])
            msg, streamed = _answer(url, {**body, "stop_token_ids": [stop_id]})
            assert finish == msg["finish_reason"] == "stop" and msg["content"] == streamed["content"] == text
            assert msg["reasoning_content"] is None and streamed["reasoning_content"] is None
            # No tags: a constraint applies from the first token (a forced </think> cannot come first).
            forced = {**body, "max_tokens": 8, "logit_bias": {"49153": 100}, "structured_outputs": {"choice": ["yes", "no"]}}
            msg, streamed = _answer(url, forced)
            assert msg["content"] in ("yes", "no") and msg["reasoning_content"] is None and msg["finish_reason"] == "stop", msg
            assert streamed == {"reasoning_content": None, "reasoning": None, "content": msg["content"]}
            # <think> at the start of the answer: reasoning until </think> (the tags as the added tokens).
            think = {**body, "max_tokens": 16, "logit_bias": {}, "structured_outputs": {"grammar": 'start: <[49152]> "ab" <[49153]> "yes"'}}
            msg, streamed = _answer(url, think)
            assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == ("ab", "ab", "yes"), msg
            assert streamed == {"reasoning_content": "ab", "reasoning": "ab", "content": "yes"}
            msg, streamed = _answer(url, {**think, "include_reasoning": False})
            assert (msg["reasoning_content"], msg["content"]) == (None, "yes") and streamed["reasoning_content"] is None
            assert streamed["content"] == "yes"
            # enable_thinking false: all content, tags and all.
            msg, streamed = _answer(url, {**think, "chat_template_kwargs": {"enable_thinking": False}})
            assert (msg["reasoning_content"], msg["content"]) == (None, "<think>ab</think>yes"), msg
            assert streamed == {"reasoning_content": None, "reasoning": None, "content": "<think>ab</think>yes"}
        # <think> open in the prompt: reasoning until </think>; the constraint waits for it.
        with serve(llm, ServerArgs(reasoning_parser="qwen3", chat_template=OPEN)) as url:
            ids = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": msgs}).json()["tokens"]
            assert 49152 in ids
            text = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                             "logit_bias": no_tags}).json()["choices"][0]["text"]
            msg, streamed = _answer(url, body)
            assert (msg["reasoning_content"], msg["content"]) == (text, None), msg
            assert streamed == {"reasoning_content": text, "reasoning": text, "content": None}
            msg, streamed = _answer(url, {**body, "include_reasoning": False})
            assert msg["reasoning_content"] is None and msg["content"] is None and streamed["reasoning_content"] is None
            msg, streamed = _answer(url, forced)
            assert msg["reasoning_content"] == "" and msg["content"] in ("yes", "no"), msg
            assert streamed["content"] == msg["content"] and streamed["reasoning_content"] is None  # an empty reasoning is not sent
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
