"""End-to-end engine tests: batch invariance (batching, chunked prefill, preemption, prefix
caching), the SmolLM2 demo (offline API and CLI), input validation, and engine behaviours
(stops, ignore_eos, n, seeds, logprobs, stats, abort, block freeing, prompt forms, dtype).

Most scenarios run on a tiny random Llama (fast); a few on the real SmolLM2 in float32. Every
scenario ends with ``assert_engine_idle``.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest
import torch

from conftest import TINY_VOCAB, assert_engine_idle
from pagedserve import LLM, SamplingParams
from pagedserve.core.outputs import SchedulerStats
from pagedserve.model import loader

EOS = 2  # the tiny models' eos_token_id

GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _random_prompts(n: int, lengths: list[int], seed: int, shared_prefix_len: int = 64) -> list[dict]:
    """``n`` token-id prompts of the given lengths; every other one starts with one shared
    ``shared_prefix_len``-token prefix (so prefix caching has something to hit)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(shared_prefix_len)]
    prompts = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        ids = [rng.randrange(3, TINY_VOCAB) for _ in range(L)]
        if i % 2 == 0 and L > shared_prefix_len:
            ids[:shared_prefix_len] = prefix
        prompts.append({"prompt_token_ids": ids})
    return prompts


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    """A small float32 engine on the tiny Llama, shared by the behaviour tests."""
    return LLM(tiny_dir, dtype="float32", num_kv_blocks=128, max_model_len=512)


# -- 2. batch invariance ----------------------------------------------------------------------
BATCH_LENGTHS = [5, 300, 17, 64, 129, 8, 250, 33, 96, 12, 200, 47, 160, 6, 80, 270]


@pytest.fixture(scope="module")
def batch_prompts():
    prompts = _random_prompts(32, BATCH_LENGTHS, seed=0)
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    assert min(lens) == 5 and max(lens) == 300
    return prompts


@pytest.fixture(scope="module")
def reference_tokens(tiny_dir, batch_prompts):
    """Greedy tokens of each prompt run alone (no prefix cache, no chunking in effect)."""
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False)
    ref = [_tokens(llm.generate(p, GREEDY16, use_tqdm=False))[0] for p in batch_prompts]
    assert_engine_idle(llm)
    assert all(len(t) == 16 for t in ref)
    return ref


def test_batch_of_32_mixed_lengths_matches_alone(tiny_dir, batch_prompts, reference_tokens):
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=1024, max_model_len=512, enable_prefix_caching=False)
    assert _tokens(llm.generate(batch_prompts, GREEDY16, use_tqdm=False)) == reference_tokens
    assert llm.stats().num_preemptions == 0
    assert_engine_idle(llm)


def test_tiny_token_budget_chunked_prefill_matches_alone(tiny_dir, batch_prompts, reference_tokens):
    # 24 tokens per step: every prompt but the shortest is split into chunks that share steps
    # with other requests' decodes; block_size 8 changes the block tables too.
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=1024, max_model_len=512, max_num_batched_tokens=24, block_size=8)
    assert _tokens(llm.generate(batch_prompts, GREEDY16, use_tqdm=False)) == reference_tokens
    assert_engine_idle(llm)


def test_tiny_block_pool_preemption_matches_alone(tiny_dir, batch_prompts, reference_tokens):
    # 40 blocks = 640 tokens for 32 requests of up to 316 tokens: preemption by recompute.
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=40, max_model_len=320, max_num_batched_tokens=128)
    assert _tokens(llm.generate(batch_prompts, GREEDY16, use_tqdm=False)) == reference_tokens
    assert llm.stats().num_preemptions > 0
    assert_engine_idle(llm)


def test_prefix_caching_on_matches_off(tiny_dir, batch_prompts, reference_tokens):
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=1024, max_model_len=512, enable_prefix_caching=True)
    first = llm.generate(batch_prompts, GREEDY16, use_tqdm=False)
    hits_first = llm.stats().prefix_cache_hits
    assert hits_first > 0  # the shared 64-token prefix
    assert_engine_idle(llm)
    # Second pass: every prompt's full blocks are cached now.
    second = llm.generate(batch_prompts, GREEDY16, use_tqdm=False)
    assert llm.stats().prefix_cache_hits > hits_first
    assert all(o.num_cached_tokens > 0 for o, p in zip(second, batch_prompts) if len(p["prompt_token_ids"]) > 16)
    assert _tokens(first) == reference_tokens
    assert _tokens(second) == reference_tokens
    assert_engine_idle(llm)


def test_bounded_step_time_matches_the_fixed_budget(tiny_dir, batch_prompts, reference_tokens):
    # max_step_ms sizes prefill chunks from measured step times: off (the fixed token budget),
    # a target no step can meet (after the 256-token cold start every chunk is the 16-token
    # floor, beside up to 32 decodes; the decode multiple off) and a small one with the default
    # multiple 4 of the decodes alone (chunk sizes follow the clock). The greedy tokens are the
    # same in all three.
    for target, multiple in ((0.0, 4.0), (0.001, 0.0), (3.0, 4.0)):
        llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=1024, max_model_len=512, enable_prefix_caching=False,
                  max_step_ms=target, max_step_decode_multiple=multiple, num_threads=1, trace_buffer_steps=100_000)
        assert _tokens(llm.generate(batch_prompts, GREEDY16, use_tqdm=False)) == reference_tokens, target
        trace = llm.get_step_trace()
        if target == 0.0:
            assert all(r["predicted_ms"] is None for r in trace)
            assert max(r["num_scheduled_tokens"] for r in trace) > 300  # whole prompts in one step
        elif target == 0.001:
            assert max(r["num_scheduled_tokens"] for r in trace) <= 256
            chunks = [e["num_tokens"] for r in trace[1:] for e in r["scheduled"] if e["phase"] == "prefill"]
            assert max(chunks) == 16 and chunks.count(16) > 100
            assert all(r["predicted_ms"] > 0 for r in trace[1:] if r["scheduled"])
            assert {r["target_ms"] for r in trace[1:] if r["target_ms"] is not None} == {0.001}
        else:
            targets = [r["target_ms"] for r in trace[1:] if r["target_ms"] is not None]
            assert targets and min(targets) >= 3.0
            assert max(targets) > 3.0  # 4x some steps' decodes alone is over 3 ms
        assert_engine_idle(llm)


def test_identical_prompts_in_one_step(tiny_llm, tiny_dir):
    """Copies of a prompt admitted in the same step hit the blocks the first copy fills in that
    very step (a 17-token copy then runs its last token as a one-token query), and n > 1
    children share the prompt the same way: all must match the prompt run alone."""
    rng = random.Random(5)
    p17 = [rng.randrange(3, TINY_VOCAB) for _ in range(17)]
    p40 = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]
    ref_llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=16, max_model_len=256, enable_prefix_caching=False)
    ref17, ref40 = (_tokens(ref_llm.generate({"prompt_token_ids": p}, GREEDY16, use_tqdm=False))[0] for p in (p17, p40))
    tiny_llm.reset_prefix_cache()
    prompts = [{"prompt_token_ids": p} for p in (p17, p40, p17, p40, p17)]
    assert _tokens(tiny_llm.generate(prompts, GREEDY16, use_tqdm=False)) == [ref17, ref40, ref17, ref40, ref17]
    assert tiny_llm.stats().prefix_cache_hits > 0
    params = SamplingParams(n=3, temperature=0.0, max_tokens=16, ignore_eos=True)
    out = tiny_llm.generate({"prompt_token_ids": p40}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [ref40] * 3
    assert_engine_idle(tiny_llm)


SMOL_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\nHere it is:",
    "Explain in one sentence why the sky is blue, using words a child would understand. The sky is blue because",
    "def add(a, b):\n    return",
]


def test_smollm2_batch_invariance(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batched = _tokens(smollm2_llm.generate(SMOL_PROMPTS, params, use_tqdm=False))
    for i in (0, 2):  # the shortest and the longest prompt alone
        assert _tokens(smollm2_llm.generate(SMOL_PROMPTS[i], params, use_tqdm=False))[0] == batched[i]
    assert_engine_idle(smollm2_llm)

    # Token budget 16 (chunked prefill mixed with decodes) and a pool too small for all four:
    # preemption. No prefix cache, so the earlier runs cannot help.
    tok = smollm2_llm.get_tokenizer()
    needs = [-(-(len(tok(p)["input_ids"]) + 8) // 16) for p in SMOL_PROMPTS]
    num_blocks = max(needs) + 1
    assert sum(needs) > num_blocks
    small = LLM(dtype="float32", num_kv_blocks=num_blocks, max_model_len=num_blocks * 16, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _tokens(small.generate(SMOL_PROMPTS, params, use_tqdm=False)) == batched
    assert small.stats().num_preemptions > 0
    assert_engine_idle(small)


# -- 3. the end-to-end demo -------------------------------------------------------------------
def test_smollm2_chat_answers_and_ends_at_eos(smollm2_llm):
    """The chat template renders the conversation and the answer ends with the model's EOS
    (<|im_end|>) well before max_tokens. What the answer says is the 135M model's (it differs
    with the host's bf16 rounding), so it is not asserted."""
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    out = smollm2_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    c = out.outputs[0]
    tok = smollm2_llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids) == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert c.finish_reason == "stop" and c.stop_reason is None, (c.finish_reason, c.text)  # EOS, not max_tokens
    assert 1 < len(c.token_ids) < 32 and c.token_ids[-1] in smollm2_llm.llm_engine.input_processor.eos_token_ids
    assert c.text.strip() and c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_engine_idle(smollm2_llm)


def test_cli_generate_prints_the_engines_answer(smollm2_llm):
    """`pagedserve generate` prints the offline engine's greedy chat answer to the same prompt
    with the same settings (float32, as the session's engine), whatever the model wrote."""
    prompt = "What is the capital of France?"
    cmd = [
        sys.executable, "-m", "pagedserve.entrypoints.cli", "--log-level", "warning", "generate",
        "--prompt", prompt, "--kv-cache-memory", "100000000", "--max-tokens", "32", "--dtype", "float32",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert res.returncode == 0, res.stderr[-2000:]
    want = smollm2_llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert want.text.strip() and res.stdout == want.text + "\n", (res.stdout, want.text, res.stderr[-2000:])
    assert_engine_idle(smollm2_llm)


# -- 4. bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("max_tokens", dict(max_tokens=0)),
        ("max_tokens", dict(max_tokens=-3)),
        ("temperature", dict(temperature=-0.5)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("truncate_prompt_tokens", dict(truncate_prompt_tokens=True)),  # a bool is not a count
        ("bad_words", dict(bad_words="Paris")),  # a list of words, not one string
    ],
)
def test_invalid_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_keeps_serving(tiny_llm):
    llm = tiny_llm
    V = llm.llm_engine.vocab_size
    max_len = llm.llm_engine.max_model_len
    bad = [
        ("prompt", ""),
        ("prompt", {"prompt_token_ids": []}),
        ("max_model_len", {"prompt_token_ids": [5] * (max_len + 10)}),
        ("max_model_len", {"prompt_token_ids": [5] * max_len}),  # no room for one token
        ("prompt_token_ids", {"prompt_token_ids": [5, V, 6]}),
        ("prompt_token_ids", {"prompt_token_ids": [5, -1, 6]}),
        ("stop_token_ids", "hello"),  # with stop_token_ids outside the vocabulary, below
    ]
    for field, prompt in bad:
        params = SamplingParams(max_tokens=4, stop_token_ids=[V + 1] if field == "stop_token_ids" else None)
        with pytest.raises(ValueError, match=field):
            llm.generate(prompt, params, use_tqdm=False)
        assert_engine_idle(llm)
    # A bad prompt in the middle of a list queues nothing (the good ones before it are dropped).
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["hello", {"prompt_token_ids": [V]}, "world"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert_engine_idle(llm)

    # The engine still serves.
    outs = llm.generate(["hello", "world"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert_engine_idle(llm)


def test_prompt_plus_max_tokens_is_capped_at_max_model_len(tiny_llm):
    max_len = tiny_llm.llm_engine.max_model_len
    out = tiny_llm.generate(
        {"prompt_token_ids": [7] * (max_len - 3)}, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].finish_reason == "length"
    assert_engine_idle(tiny_llm)


# -- 5. engine behaviours ---------------------------------------------------------------------
def test_stop_strings(smollm2_llm):
    """Stop strings cut the text where they first occur (inside a token or across several). They
    are taken from the greedy answer itself, whatever the model wrote on this host."""
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    full = smollm2_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    words = [m.group() for m in re.finditer(r"\w{3,}", full) if m.start() >= 2]
    assert len(full) >= 9 and words, full  # room for a word after the start and a 7-character span
    word, cross = words[0], full[2:9]  # a word the model wrote; a span of several tokens
    assert "never-generated" not in full
    cases = [
        (dict(stop=[word, "never-generated"]), word, full[: full.index(word)]),
        (dict(stop=[cross]), cross, full[: full.index(cross)]),
        # include_stop_str_in_output keeps the stop string.
        (dict(stop=word, include_stop_str_in_output=True), word, full[: full.index(word) + len(word)]),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=16, **kw) for kw, _, _ in cases]
    outs = smollm2_llm.chat([conv] * len(cases), params, use_tqdm=False)
    for (_, stop, expected), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.text == expected, (stop, c.text, full)
        assert c.finish_reason == "stop" and c.stop_reason == stop
    assert_engine_idle(smollm2_llm)


def test_stop_token_ids(tiny_llm):
    full = tiny_llm.generate("The capital of France is", GREEDY16, use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[5]
    cut = full.token_ids.index(stop_tok)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_tok])
    out = tiny_llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: cut + 1]  # the stop token is the last token
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert_engine_idle(tiny_llm)


def test_eos_and_ignore_eos(tiny_llm):
    # logit_bias makes EOS the greedy choice at every step.
    force_eos = dict(temperature=0.0, logit_bias={EOS: 100.0})
    out = tiny_llm.generate("hello", SamplingParams(max_tokens=5, **force_eos), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EOS] and out.finish_reason == "stop" and out.stop_reason is None
    out = tiny_llm.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True, **force_eos), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EOS] * 5 and out.finish_reason == "length"
    # ignore_eos with free sampling: exactly max_tokens tokens.
    outs = tiny_llm.generate(["a", "b c d"], SamplingParams(max_tokens=7, ignore_eos=True, seed=3), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 7 and o.outputs[0].finish_reason == "length" for o in outs)
    assert_engine_idle(tiny_llm)


def test_n_with_seed(tiny_llm):
    params = SamplingParams(n=2, seed=42, temperature=1.0, max_tokens=8, ignore_eos=True)
    out = tiny_llm.generate("Tell me a story", params, use_tqdm=False)
    assert len(out) == 1
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in comps)
    assert comps[0].token_ids != comps[1].token_ids  # each child has its own seed
    again = tiny_llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in again] == [c.token_ids for c in comps]
    assert_engine_idle(tiny_llm)


def test_seeded_sampling_independent_of_batch(tiny_llm):
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = "Seeded sampling must not depend on the batch:"
    alone = tiny_llm.generate(prompt, target, use_tqdm=False)[0].outputs[0].token_ids
    neighbours = [
        ("short", SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)),  # unseeded
        ("a much longer neighbour prompt " * 8, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
        ("x", SamplingParams(temperature=1.3, seed=7, max_tokens=12, ignore_eos=True)),
    ]
    prompts = [p for p, _ in neighbours[:2]] + [prompt] + [neighbours[2][0]]
    params = [sp for _, sp in neighbours[:2]] + [target] + [neighbours[2][1]]
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    assert_engine_idle(tiny_llm)


def test_logprobs(tiny_llm):
    out = tiny_llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy: the sampled token is the top one
        assert len(entry) == 3  # sampled (= top-1) plus the rest of the top-3
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        assert entry[tok].logprob == max(lp.logprob for lp in entry.values())
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # Random sampling: the sampled token may sit outside the top-k (k + 1 entries then).
    c = tiny_llm.generate("hello world", SamplingParams(temperature=1.5, seed=0, max_tokens=6, ignore_eos=True, logprobs=1), use_tqdm=False)[0].outputs[0]
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and 1 <= len(entry) <= 2 and entry[tok].rank >= 1
    no_lp = tiny_llm.generate("hello world", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert no_lp.logprobs is None
    assert_engine_idle(tiny_llm)


def test_stats_are_typed_and_count_tokens(tiny_llm):
    before = tiny_llm.stats()
    assert isinstance(before, SchedulerStats)
    assert before.num_total_blocks == before.num_free_blocks == 128 and before.kv_cache_usage == 0.0
    outs = tiny_llm.generate([[5] * 20, [6] * 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    after = tiny_llm.stats()
    assert after.num_prompt_tokens - before.num_prompt_tokens == 27
    assert after.num_generation_tokens - before.num_generation_tokens == sum(len(o.outputs[0].token_ids) for o in outs) == 6
    assert after.prefix_cache_queries - before.prefix_cache_queries == 27
    assert (after.num_running, after.num_waiting) == (0, 0)
    assert_engine_idle(tiny_llm)


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.llm_engine
    total = engine.get_stats().num_total_blocks
    engine.add_request("long", {"prompt_token_ids": list(range(10, 110))}, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("waiting-too", "hi", SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_free_blocks < total
    engine.abort_request(["long", "waiting-too"])
    assert engine.get_stats().num_free_blocks == total
    assert engine.step() == []
    assert_engine_idle(tiny_llm)
    # Abort while still waiting (never scheduled).
    engine.add_request("never-run", "hello", SamplingParams(max_tokens=4))
    engine.abort_request("never-run")
    assert_engine_idle(tiny_llm)


def test_finished_request_frees_blocks_in_same_step(tiny_llm):
    engine = tiny_llm.llm_engine
    kv = engine.core.scheduler.kv_cache_manager
    total = engine.get_stats().num_total_blocks
    engine.add_request("one", {"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=1))
    engine.add_request("many", {"prompt_token_ids": list(range(200, 220))}, SamplingParams(max_tokens=50, ignore_eos=True))
    outs = {o.request_id: o for o in engine.step()}  # both prefill; "one" samples its only token
    assert outs["one"].finished and outs["one"].outputs[0].finish_reason == "length"
    assert not outs["many"].finished
    assert "one" not in kv.req_to_blocks and "one" not in engine.core.scheduler.requests
    assert engine.get_stats().num_free_blocks == total - len(kv.get_block_ids("many"))
    engine.abort_request("many")
    assert_engine_idle(tiny_llm)

    # The other ways to finish: EOS, a stop token id, a stop string (the last is decided by the
    # frontend after the scheduler's update, and must free blocks in that step too).
    prompt = {"prompt_token_ids": list(range(300, 333))}
    ref = tiny_llm.generate(prompt, GREEDY16, use_tqdm=False)[0].outputs[0]
    assert_engine_idle(tiny_llm)
    stop_str = ref.text[len(tiny_llm.get_tokenizer().decode(ref.token_ids[:3])) :][:2]
    assert stop_str.strip()
    engine.add_request("eos", prompt, SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0}))
    engine.add_request("stop-id", prompt, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ref.token_ids[2]]))
    engine.add_request("stop-str", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop_str))
    engine.add_request("keeps-going", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    finished = {}
    for _ in range(20):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
                assert out.request_id not in kv.req_to_blocks and out.request_id not in engine.core.scheduler.requests
        if len(finished) == 3:
            break
    assert finished["eos"].token_ids == [EOS] and finished["eos"].finish_reason == "stop"
    assert finished["stop-id"].stop_reason == ref.token_ids[2]
    assert finished["stop-str"].stop_reason == stop_str
    assert engine.get_stats().num_free_blocks == total - len(kv.get_block_ids("keeps-going"))
    engine.abort_request("keeps-going")
    assert_engine_idle(tiny_llm)


def test_generate_prompt_forms(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    ids = tok("hello there")["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def toks(x):
        outs = tiny_llm.generate(x, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    ref = toks("hello there")
    assert len(ref) == 1 and len(ref[0]) == 3
    assert toks({"prompt_token_ids": ids}) == ref
    assert toks(ids) == ref  # a bare list of ints is one prompt
    assert toks({"prompt": "hello there"}) == ref
    assert toks(["hello there", {"prompt_token_ids": ids}, "other"])[:2] == ref * 2
    assert toks([{"prompt_token_ids": ids}, {"prompt_token_ids": ids}]) == ref * 2
    assert toks([ids, ids]) == ref * 2  # a list of token-id lists
    out = tiny_llm.generate("hello there", params, use_tqdm=False)[0]
    assert out.prompt == "hello there" and out.prompt_token_ids == ids and out.finished
    c = out.outputs[0]
    assert isinstance(c.text, str) and c.token_ids == ref[0] and c.finish_reason == "length"
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # Per-prompt sampling params, in input order.
    outs = tiny_llm.generate(["a", "b"], [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    assert_engine_idle(tiny_llm)


def test_dtype_auto(tiny_dir):
    llm = LLM(tiny_dir, num_kv_blocks=16, max_model_len=256)  # dtype="auto"
    engine = llm.llm_engine
    cpu_bf16 = loader.cpu_has_bf16() or loader.avx2_bf16_packed()  # AVX-512 BF16 or AMX, or the AVX2 bf16 matmul
    expected = torch.bfloat16 if (engine.core.worker.device.type == "cuda" or cpu_bf16) else torch.float32
    assert engine.core.worker.dtype == expected
    assert engine.core.worker.model_runner.kv_cache.dtype == expected
    assert next(engine.core.worker.model_runner.model.parameters()).dtype == expected
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_engine_idle(llm)


def test_review_findings_offline(tiny_model_factory):
    """Inputs a fresh-eyes review found mishandled: each is a clear ValueError (or works)."""
    import numpy as np

    llm = LLM(tiny_model_factory("llama"), dtype="float32", num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    ref = llm.generate({"prompt_token_ids": [1, 504, 3575]}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ([np.int64(1), np.int64(504), np.int64(3575)], (1, 504, 3575), np.array([1, 504, 3575]), torch.tensor([1, 504, 3575])):
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == ref
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(None, greedy)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("hi", SamplingParams(prompt_logprobs=-1))
    for kwargs, field in (({"n": 10**9}, "n"), ({"seed": 2**70}, "seed"), ({"temperature": float("inf")}, "temperature"),
                          ({"top_p": float("nan")}, "top_p")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert llm.generate({"prompt_token_ids": [1, 504, 3575]}, greedy, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert_engine_idle(llm)


def test_cli_errors_are_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "generate", "--prompt", "hi", "--model", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "error:" in r.stderr and "not found" in r.stderr and "Traceback" not in r.stderr
