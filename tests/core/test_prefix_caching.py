"""Prefix caching end to end: greedy outputs with caching on equal outputs with it off, on a
small random Llama and on SmolLM2, for shared system prompts, a conversation continued turn by
turn (the previous answer's blocks are reused), and under preemption; cache_salt isolation,
reset_prefix_cache, the exact hit statistics, and the defaults (on unless turned off).

The block-pool mechanics are unit-tested in test_block_pool.py; the scheduler invariants with
random interleavings in test_scheduler.py.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from conftest import assert_engine_idle
from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig

GREEDY = dict(temperature=0.0, ignore_eos=True)
TB = 4  # block size of the tiny engines: many blocks per prompt


def run_engine(engine, requests: list[tuple[list[int], SamplingParams, str | None]]):
    """Queue (prompt ids, params, cache_salt) requests on an LLMEngine and step them to the end."""
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp, cache_salt=salt) for p, sp, salt in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def gen(llm: LLM, prompts: list[list[int]], max_tokens: int = 8):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    assert_engine_idle(llm)
    return outs


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def full_blocks(n: int, block_size: int = TB) -> int:
    """Tokens in the full blocks of the first n tokens."""
    return n // block_size * block_size


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These models are small and the steps short: one intra-op thread is as fast, and on a
    loaded 2-core machine two OpenMP threads were measured 7-15x slower (spinning workers)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------
# Tiny random Llama (fast): exact hit counts
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def _tiny(tiny_dir, caching: bool, num_kv_blocks: int = 128, max_model_len: int = 256, **kw) -> LLM:
    return LLM(
        tiny_dir, dtype="float32", block_size=TB, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
        enable_prefix_caching=caching, **kw,
    )


@pytest.fixture(scope="module")
def tiny_off(tiny_dir):
    return _tiny(tiny_dir, caching=False)


@pytest.fixture
def tiny_on(tiny_dir):
    llm = _tiny(tiny_dir, caching=True)
    yield llm
    assert_engine_idle(llm)


def rand_tokens(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(3, 49152) for _ in range(n)]


def test_prefix_caching_is_on_by_default_and_can_be_turned_off(tiny_off):
    import argparse

    assert EngineConfig().enable_prefix_caching is True
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_cli_args(p.parse_args([])).enable_prefix_caching is True
    assert EngineConfig.from_cli_args(p.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    # Off: nothing is hashed or hit, the statistics still count the queries.
    rnd = random.Random(0)
    prompt = rand_tokens(rnd, 20)
    before = tiny_off.stats()
    outs = gen(tiny_off, [prompt, prompt])
    after = tiny_off.stats()
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert after.prefix_cache_hits == before.prefix_cache_hits == 0
    assert after.prefix_cache_queries - before.prefix_cache_queries == 40
    assert not tiny_off.llm_engine.core.scheduler.kv_cache_manager.block_pool.cached_blocks


def test_shared_system_prompts_equal_outputs_and_exact_hits(tiny_dir, tiny_on, tiny_off):
    rnd = random.Random(1)
    systems = [rand_tokens(rnd, 23) for _ in range(3)]  # 5 full blocks + 3 tokens each
    prompts = [s + rand_tokens(rnd, rnd.randint(5, 9)) for s in systems for _ in range(4)]
    want = tokens(gen(tiny_off, prompts))

    outs = gen(tiny_on, prompts)
    assert tokens(outs) == want
    # One batch: the first request of each system prompt computes its 5 full blocks and
    # registers them when scheduled; the 3 others, admitted later in the same step, hit them.
    assert [o.num_cached_tokens for o in outs] == [0, 20, 20, 20] * 3
    stats = tiny_on.stats()
    assert stats.prefix_cache_queries == sum(map(len, prompts))
    assert stats.prefix_cache_hits == 9 * 20

    # Again: every full block of every prompt is cached now (hit capped below the last token).
    outs = gen(tiny_on, prompts)
    assert tokens(outs) == want
    hits = [full_blocks(len(p) - 1) for p in prompts]
    assert [o.num_cached_tokens for o in outs] == hits
    stats2 = tiny_on.stats()
    assert stats2.prefix_cache_queries == 2 * sum(map(len, prompts))
    assert stats2.prefix_cache_hits == 9 * 20 + sum(hits)
    assert stats2.prefix_cache_hit_rate == pytest.approx(stats2.prefix_cache_hits / stats2.prefix_cache_queries)


def test_conversation_turn_by_turn_reuses_the_previous_answer(tiny_on, tiny_off):
    rnd = random.Random(2)
    convo = rand_tokens(rnd, 18)
    for turn in range(3):
        convo_before = list(convo)
        out_on = gen(tiny_on, [convo], max_tokens=11)[0]
        out_off = gen(tiny_off, [convo], max_tokens=11)[0]
        assert out_on.outputs[0].token_ids == out_off.outputs[0].token_ids
        if turn > 0:
            # The previous turn computed K/V for its prompt and all but its last sampled token;
            # blocks filled during decode were hashed too, so this turn hits all of them.
            assert out_on.num_cached_tokens == min(full_blocks(prev_computed), full_blocks(len(convo_before) - 1))
            assert out_on.num_cached_tokens > prev_prompt_len
        prev_prompt_len = len(convo_before)
        prev_computed = len(convo_before) + 11 - 1
        convo = convo_before + out_on.outputs[0].token_ids + rand_tokens(rnd, 6)  # the next user message


def test_outputs_equal_under_preemption_with_eviction(tiny_dir, tiny_off):
    rnd = random.Random(3)
    shared = rand_tokens(rnd, 16)
    prompts = [shared + rand_tokens(rnd, 4) for _ in range(6)]
    want = tokens(gen(tiny_off, prompts, max_tokens=24))
    # 16 blocks of 4 = 64 tokens; each request grows to 44 tokens (11 blocks): preemption,
    # cached blocks evicted for other requests and recomputed later.
    small = _tiny(tiny_dir, caching=True, num_kv_blocks=16, max_model_len=64)
    outs = gen(small, prompts, max_tokens=24)
    assert tokens(outs) == want
    stats = small.stats()
    assert stats.num_preemptions > 0
    # Hit statistics count first admissions only: the queries are exactly the prompts.
    assert stats.prefix_cache_queries == sum(map(len, prompts))
    assert 0 < stats.prefix_cache_hits <= 5 * 16
    # The small pool also works with a chunked, tight token budget.
    tight = _tiny(tiny_dir, caching=True, num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=7)
    assert tokens(gen(tight, prompts, max_tokens=24)) == want
    assert tight.stats().num_preemptions > 0


def test_cache_salt_isolates_requests(tiny_on):
    engine = tiny_on.llm_engine
    rnd = random.Random(4)
    prompt = rand_tokens(rnd, 21)
    sp = SamplingParams(max_tokens=5, **GREEDY)
    [plain] = run_engine(engine, [(prompt, sp, None)])
    assert plain.num_cached_tokens == 0
    outs = run_engine(engine, [(prompt, sp, "tenant-a")])
    outs += run_engine(engine, [(prompt, sp, "tenant-b")])
    outs += run_engine(engine, [(prompt, sp, "tenant-a")])
    outs += run_engine(engine, [(prompt, sp, None)])
    assert [o.num_cached_tokens for o in outs] == [0, 0, 20, 20]  # a different salt: no hit
    assert all(o.outputs[0].token_ids == plain.outputs[0].token_ids for o in outs)
    assert_engine_idle(engine)


def test_reset_prefix_cache_and_logged_hit_rate(tiny_on, caplog):
    rnd = random.Random(5)
    prompt = rand_tokens(rnd, 17)
    first = gen(tiny_on, [prompt])[0]
    assert gen(tiny_on, [prompt])[0].num_cached_tokens == 16
    engine = tiny_on.llm_engine
    # Refused while a request holds blocks; the cache is untouched.
    engine.add_request("busy", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    assert tiny_on.reset_prefix_cache() is False
    assert engine.core.scheduler.kv_cache_manager.block_pool.cached_blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert tiny_on.reset_prefix_cache() is True
    assert not engine.core.scheduler.kv_cache_manager.block_pool.cached_blocks
    again = gen(tiny_on, [prompt])[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # 4 admissions of 17 tokens; hits 16 (2nd) + 16 (busy one); reset keeps the counters.
    stats = tiny_on.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (68, 32)
    assert stats.prefix_cache_hit_rate == pytest.approx(32 / 68)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        engine._maybe_log_stats(interval_s=0.0)
    assert "Prefix cache hit rate: 47.1%" in caplog.text


# --------------------------------------------------------------------------------------------
# SmolLM2 (float32): chat prompts, caching on (small pool, preempting) vs off
# --------------------------------------------------------------------------------------------
SMOL_BLOCK = 16
SYSTEM = (
    "You are a concise assistant for a hardware store. Answer in one short sentence. "
    "Store hours are 8am to 6pm, Monday to Saturday. We sell tools, paint, garden supplies and lumber."
)
QUESTIONS = ["Do you sell paint?", "When do you open on Saturday?", "Can I buy a hammer here?"]


@pytest.fixture(scope="module")
def smol_pair():
    """(on, off): caching on with a small pool (8 blocks of 16 = 128 tokens, so three chat
    requests at once preempt each other), caching off with a roomy one."""
    on = LLM(dtype="float32", num_kv_blocks=8, max_model_len=128, enable_prefix_caching=True)
    off = LLM(dtype="float32", num_kv_blocks=32, max_model_len=128, enable_prefix_caching=False)
    yield on, off
    del on, off


def test_smollm2_shared_system_prompt_and_preemption(smol_pair):
    on, off = smol_pair
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    want = off.chat(convs, sp, use_tqdm=False)
    got = on.chat(convs, sp, use_tqdm=False)
    assert tokens(got) == tokens(want)
    for o in (on, off):
        assert_engine_idle(o)
    prompt_len = len(got[0].prompt_token_ids)
    sys_len = len(on.apply_chat_template(convs[0][:1], add_generation_prompt=False))
    # Requests 2 and 3 share at least the system prompt's full blocks with request 1.
    assert all(o.num_cached_tokens >= full_blocks(sys_len, SMOL_BLOCK) > 0 for o in got[1:])
    stats = on.stats()
    assert stats.num_preemptions > 0, stats  # 3 shared + 3 x 2 own blocks > 8
    assert stats.prefix_cache_hits > 0 and prompt_len > SMOL_BLOCK


def test_smollm2_conversation_turn_by_turn(smol_pair):
    on, off = smol_pair
    sp = SamplingParams(max_tokens=12, **GREEDY)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell paint?"}]
    turn1_on = on.chat(conv, sp, use_tqdm=False)[0]
    turn1_off = off.chat(conv, sp, use_tqdm=False)[0]
    assert turn1_on.outputs[0].token_ids == turn1_off.outputs[0].token_ids
    conv = conv + [
        {"role": "assistant", "content": turn1_on.outputs[0].text},
        {"role": "user", "content": "And lumber?"},
    ]
    turn2_on = on.chat(conv, sp, use_tqdm=False)[0]
    turn2_off = off.chat(conv, sp, use_tqdm=False)[0]
    assert turn2_on.outputs[0].token_ids == turn2_off.outputs[0].token_ids
    # Turn 2 reuses turn 1's whole prompt and at least one block of its answer.
    assert turn2_on.num_cached_tokens > full_blocks(len(turn1_on.prompt_token_ids), SMOL_BLOCK)
    for o in (on, off):
        assert_engine_idle(o)


def test_smollm2_cache_salt_gives_no_hits(smol_pair):
    on, _ = smol_pair
    engine = on.llm_engine
    prompt = on.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    sp = SamplingParams(max_tokens=4, **GREEDY)
    a = run_engine(engine, [(prompt, sp, None)])[0]
    b = run_engine(engine, [(prompt, sp, "other-tenant")])[0]
    c = run_engine(engine, [(prompt, sp, None)])[0]
    assert b.num_cached_tokens == 0
    assert c.num_cached_tokens == full_blocks(len(prompt) - 1, SMOL_BLOCK) > 0
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert_engine_idle(engine)
