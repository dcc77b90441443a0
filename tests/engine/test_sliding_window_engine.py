"""The sliding window's block freeing through the whole engine, on a tiny random Mistral
(every layer a 16-token window, blocks of 16) in float32 against HF transformers: a 100-token
prompt and 60 decodes equal HF's greedy tokens while the blocks in use stay flat once past the
window, in a pool smaller than the request (so the request only finishes because blocks are
freed); with the prompt in one chunk, in chunks that straddle the window's edge, under
preemption, and with a prefix hit after the first blocks were evicted.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from conftest import TINY_VOCAB, assert_engine_idle
from pagedserve import LLM, SamplingParams

WINDOW = 16
PROMPT = [(i * 37) % (TINY_VOCAB - 50) + 50 for i in range(100)]
PROMPT2 = [(i * 53 + 11) % (TINY_VOCAB - 50) + 50 for i in range(90)]
N_OUT = 60
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tiny_model_factory):
    """(model dir, HF float32 model) of a tiny Mistral with a 16-token window."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("mistral", sliding_window=WINDOW)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``ids`` (``n`` tokens), with its own (windowed) KV cache."""
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out: list[int] = []
    with torch.no_grad():
        o = hf(torch.tensor([ids]), use_cache=True)
        while True:
            out.append(int(o.logits[0, -1].argmax()))
            if len(out) == n:
                return out
            o = hf(torch.tensor([[out[-1]]]), use_cache=True, **{cache_kw: o.past_key_values})


@pytest.fixture(scope="module")
def expected(mistral):
    return hf_greedy(mistral[1], PROMPT, N_OUT)


@pytest.fixture(scope="module")
def expected2(mistral):
    return hf_greedy(mistral[1], PROMPT2, N_OUT)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list, list[int]]:
    """Step the engine to the end; returns (finished outputs in order, blocks in use after each step)."""
    engine = llm.llm_engine
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    ids = [engine.add_request(None, {"prompt_token_ids": p}, GREEDY) for p in prompts]
    done, used = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        used.append(pool.num_used_blocks)
    assert_engine_idle(llm)
    return [done[i] for i in ids], used


@pytest.mark.parametrize("budget,num_blocks", [(128, 10), (24, 8)], ids=["one-chunk", "chunks-of-24"])
def test_long_decode_equals_hf_with_flat_block_usage(mistral, expected, budget, num_blocks):
    """160 tokens in a pool of at most 10 blocks of 16 (max_model_len 512 is larger than the
    pool: a windowed request holds only the window's blocks and one chunk's)."""
    llm = LLM(mistral[0], dtype="float32", num_kv_blocks=num_blocks, max_model_len=512, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    assert llm.llm_engine.config.max_model_len == 512
    (out,), used = run(llm, [PROMPT])
    assert list(out.outputs[0].token_ids) == expected
    decode_steps = used[-(N_OUT - 1) : -1]  # after the prefill (1st token); the last step freed everything
    assert max(decode_steps) <= -(-WINDOW // 16) + 1, used
    assert max(used) <= -(-(WINDOW + budget + 14) // 16), used
    assert used[-1] == 0


def test_preemption_with_a_window_equals_hf(mistral, expected, expected2):
    """Two requests in 5 blocks: a 48-token chunk holds up to 5 blocks, so the second one is
    preempted (and recomputed) while the first prefills; both still equal HF."""
    llm = LLM(mistral[0], dtype="float32", num_kv_blocks=5, max_model_len=512, max_num_batched_tokens=48, enable_chunked_prefill=True)
    outs, used = run(llm, [PROMPT, PROMPT2])
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected, expected2]
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert max(used) <= 5


def test_prefix_hit_after_the_first_blocks_were_evicted(mistral, expected):
    """The first run fills 10 blocks of an 8-block pool, so two of its early (cached, released)
    blocks are reused for its last tokens; the second run still hits 96 tokens (its window
    needs only block 5) and equals HF."""
    llm = LLM(mistral[0], dtype="float32", num_kv_blocks=8, max_model_len=512, max_num_batched_tokens=96, enable_chunked_prefill=True)
    from pagedserve.core.request import Request

    (first,), _ = run(llm, [PROMPT])
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    hashes = kv.block_hashes(Request("probe", PROMPT, GREEDY))
    cached = [kv.block_pool.get_cached_block(h) is not None for h in hashes]
    assert cached[:6].count(False) == 2 and cached[5], cached
    (second,), _ = run(llm, [PROMPT])
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 96
    assert list(first.outputs[0].token_ids) == list(second.outputs[0].token_ids) == expected



def test_kv_transfer_is_refused_for_a_sliding_window_model(mistral):
    """Prefill/decode disaggregation sends every prompt block, which the window frees."""
    with pytest.raises(ValueError, match="not supported for sliding-window models"):
        LLM(mistral[0], dtype="float32", num_kv_blocks=10, max_model_len=512, max_num_batched_tokens=64, kv_transfer_config={"kv_role": "kv_producer", "kv_port": 1})


def test_a_pool_smaller_than_the_window_and_one_chunk_is_refused(mistral):
    """A lone request holds up to ceil((16 + 64 + 14) / 16) = 6 blocks with chunks of 64."""
    with pytest.raises(ValueError, match="one request holds up to 6 blocks"):
        LLM(mistral[0], dtype="float32", num_kv_blocks=5, max_model_len=512, max_num_batched_tokens=64)
    assert LLM(mistral[0], dtype="float32", num_kv_blocks=6, max_model_len=512, max_num_batched_tokens=64).llm_engine.config.max_model_len == 512
