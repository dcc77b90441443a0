"""Logprobs that name tokens by their text: in /v1/completions ``"".join(tokens) == text`` and
``text_offset[i] == len("".join(tokens[:i]))``, one entry per token, streamed and not, for echoed
prompt tokens and generated ones (a character split over several byte tokens goes to the token
that completes it, the pieces before it are ""); chat logprobs carry each token's UTF-8 ``bytes``.
Over the session's SmolLM2 server (byte-level BPE: 東京 and emoji are byte tokens)."""
from __future__ import annotations

import json

import httpx
import pytest

from pagedserve.entrypoints.openai.token_strings import TokenPieces
from pagedserve.sampling_params import SamplingParams
from server_utils import AUTH, MODEL, wait_idle

PROMPTS = ["東京 is a city", "I like 🙂 and 👍🏽 a lot😀", "The sky is blue", "line one\nline two\n\nend"]
FORCED = "東京🙂 ok"  # generated text made of byte tokens: a choice the grammar forces


def _check(text: str, lp: dict) -> None:
    toks = lp["tokens"]
    assert "".join(toks) == text, (toks, text)
    assert lp["text_offset"] == [len("".join(toks[:i])) for i in range(len(toks))]
    assert len(toks) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert "\ufffd" not in "".join(toks)


def _completion(server: str, body: dict) -> tuple[dict, dict]:
    """(text, logprobs) of choice 0, non-streamed and streamed (chunks joined)."""
    r = httpx.post(server + "/v1/completions", headers=AUTH, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", server + "/v1/completions", headers=AUTH, json={"model": MODEL, **body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["text"]
                    for k in lp:
                        lp[k] += (ch["logprobs"] or {}).get(k, [])
    return full, {"text": text, "logprobs": lp}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_echoed_and_generated_tokens_join_to_the_text(server, prompt):
    ids = httpx.post(server + "/tokenize", headers=AUTH, json={"prompt": prompt}).json()["tokens"]
    for body in ({"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1},
                 {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 1},
                 {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}):
        full, streamed = _completion(server, body)
        for c in (full, streamed):
            _check(c["text"], c["logprobs"])
        assert streamed["text"] == full["text"] and streamed["logprobs"]["tokens"] == full["logprobs"]["tokens"]
        if body.get("echo"):
            assert full["text"].startswith(prompt) and "".join(full["logprobs"]["tokens"][:len(ids)]) == prompt
    wait_idle(server)


def test_a_character_split_over_byte_tokens_goes_to_the_token_that_completes_it(server):
    """SmolLM2 spells 東京 in four byte tokens and 🙂 in two: the pieces are "" until a character
    is complete; generated ones (a choice the grammar forces) follow the same rule."""
    full, streamed = _completion(server, {"prompt": "東京 is a city", "max_tokens": 0, "echo": True, "logprobs": 0})
    for c in (full, streamed):
        assert c["logprobs"]["tokens"] == ["", "東", "", "京", " is", " a", " city"]
        assert c["logprobs"]["text_offset"] == [0, 0, 1, 1, 2, 5, 7]
    forced = {"prompt": "Say it:", "max_tokens": 12, "temperature": 0, "logprobs": 2, "structured_outputs": {"choice": [FORCED]}}
    for echo in (False, True):
        full, streamed = _completion(server, {**forced, "echo": echo})
        for c in (full, streamed):
            assert c["text"] == ("Say it:" if echo else "") + FORCED
            _check(c["text"], c["logprobs"])
            assert any(t == "" for t in c["logprobs"]["tokens"])  # 東 is at least two tokens here
            # the sampled token is in its top_logprobs under the name it has in tokens
            assert all(tops is None or tok in tops for tok, tops in zip(c["logprobs"]["tokens"], c["logprobs"]["top_logprobs"]))
    # A text cut inside a token by a stop string, and a stop token the text leaves out.
    body = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "logprobs": 0, "return_token_ids": True}
    plain = httpx.post(server + "/v1/completions", headers=AUTH, json={"model": MODEL, **body}).json()["choices"][0]
    for extra in ({"stop": [plain["text"][3:5]], "echo": True}, {"stop_token_ids": [plain["token_ids"][2]]}):
        c = httpx.post(server + "/v1/completions", headers=AUTH, json={"model": MODEL, **body, **extra}).json()["choices"][0]
        assert c["finish_reason"] == "stop"
        _check(c["text"], c["logprobs"])
    wait_idle(server)


def test_chat_logprobs_carry_the_token_bytes(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say it."}], "max_tokens": 12, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "structured_outputs": {"choice": [FORCED]}}
    r = httpx.post(server + "/v1/chat/completions", headers=AUTH, json=body, timeout=120).json()
    content = r["choices"][0]["logprobs"]["content"]
    entries = []
    with httpx.stream("POST", server + "/v1/chat/completions", headers=AUTH, json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    entries += (ch.get("logprobs") or {}).get("content") or []
    assert r["choices"][0]["message"]["content"] == FORCED and entries == content
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == FORCED
    partial = 0
    for e in content:
        for x in [e] + e["top_logprobs"]:
            assert isinstance(x["bytes"], list) and all(isinstance(b, int) and 0 <= b < 256 for b in x["bytes"])
            try:
                assert bytes(x["bytes"]).decode("utf-8") == x["token"], x
            except UnicodeDecodeError:  # a partial character: its bytes rebuild it with the next tokens'
                partial += x is e
    assert partial >= 2
    wait_idle(server)


def test_pieces_of_a_text_that_leaves_out_a_stop_token(smollm2_dir):
    """Offline: a final token the text leaves out (EOS) and a text cut by a stop string still
    join to the text; text held back in a stream is taken as decoded."""
    from pagedserve.model.loader import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    ids = tok("東京 is a city", add_special_tokens=False)["input_ids"]
    p = TokenPieces(tok, [], SamplingParams())
    assert p.feed(ids + [tok.eos_token_id], "東京 is a city", True) == ["", "東", "", "京", " is", " a", " city", ""]
    assert TokenPieces(tok, [], SamplingParams()).feed(ids, "東京 is", True) == ["", "東", "", "京", " is", "", ""]
    s = TokenPieces(tok, [], SamplingParams())
    assert s.feed(ids[:5], "東京", False) == ["", "東", "", "京", " is"] and s.feed(ids[5:], " is a city", True) == [" a", " city"]
    assert TokenPieces.of_prompt(tok, ids, "東京 is a city") == ["", "東", "", "京", " is", " a", " city"]
