"""CI-sized soak (benchmarks/soak.py has the long one): 300 random requests against the real
app over a tiny random model, with aborts and mid-stream disconnects. No error answer, no
request or KV block left, no fd or thread growth after warm-up, RSS printed, and every
completed greedy answer equal to the offline engine's."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest
from app_utils import kv_idle, serve, tiny_async_llm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import soak  # noqa: E402

REQUESTS = int(os.environ.get("PAGEDSERVE_SOAK_REQUESTS", "300"))


@pytest.mark.slow
def test_soak_random_requests_aborts_and_disconnects(tiny_model_factory):
    from pagedserve import LLM

    model = tiny_model_factory("llama")
    llm = tiny_async_llm(model, max_num_seqs=16)
    try:
        with serve(llm) as base:
            asyncio.run(soak.run_soak(base, "tiny", 40, 8, 1, 60, 24))  # warm-up: pools, caches, threads
            kv_idle(llm, 30)
            before = soak.process_figures()
            figs, greedy = asyncio.run(soak.run_soak(base, "tiny", REQUESTS, 8, 0, 60, 24))
            kv_idle(llm, 30)
            after = soak.process_figures()
            offline = LLM(model, dtype="float32", kv_cache_memory_bytes=8_000_000, max_model_len=512, num_threads=1)
            soak.check_greedy(base, offline, greedy, figs)
    finally:
        llm.shutdown()
    print(f"\nsoak: {figs}\nbefore {before}\nafter {after}")
    assert figs.sent == REQUESTS and set(figs.statuses) == {200}, figs.statuses
    assert figs.completed + figs.aborted + figs.disconnected == REQUESTS
    assert figs.aborted > 0 and figs.disconnected > 0 and figs.completed > REQUESTS // 2
    assert not figs.greedy_mismatched, "\n".join(figs.greedy_mismatched[:5])
    assert figs.greedy_checked > REQUESTS // 5
    assert after["fds"] <= before["fds"] + 2, (before, after)
    assert after["threads"] <= before["threads"] + 1, (before, after)
    assert after["rss_kib"] - before["rss_kib"] < 100 * 1024, (before, after)


def test_near_tie_rule_of_the_greedy_check():
    from types import SimpleNamespace

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    ref = SimpleNamespace(token_ids=[0, 1, 2], logprobs=[{0: lp(-0.1)}, {1: lp(-1.0), 3: lp(-1.00001)}, {2: lp(-0.1)}])
    assert soak.near_tie(Tok(), ref, "adc")  # took the runner-up, 1e-5 nats behind
    assert not soak.near_tie(Tok(), ref, "aec")  # a token that was not the runner-up
    far = SimpleNamespace(token_ids=[0, 1, 2], logprobs=[{0: lp(-0.1)}, {1: lp(-1.0), 3: lp(-1.5)}, {2: lp(-0.1)}])
    assert not soak.near_tie(Tok(), far, "adc")  # 0.5 nats is no tie
