"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's field): every prompt position is
scored against HF transformers on the same weights, and chunking, preemption, a warm prefix
cache, ``n > 1`` and the output kind change neither the values nor how often they are sent."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_engine_idle
from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import RequestOutputKind

TOL = 1e-3


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (1, 2, 37, 90, 150)]


def _values(out):
    """[(prompt token's logprob, its rank, the entry's ids: it, then the top-k)] for positions 1.."""
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    rows = []
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        lp = entry[ids[i]]
        rows.append((lp.logprob, lp.rank, list(entry)))
    return rows


def _run(llm, prompts, k=2, **kw):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, "prompt_logprobs": k, **kw})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_prompt_logprobs_match_hf(tiny_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=32)
    outs = _run(llm, prompts, k=3)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
        for i in range(1, len(p)):
            entry = out.prompt_logprobs[i]
            row = ref[i - 1]
            target = row[p[i]].item()
            assert entry[p[i]].logprob == pytest.approx(target, abs=TOL)
            lo, hi = int((row > target + TOL).sum()) + 1, int((row > target - TOL).sum()) + 1
            assert lo <= entry[p[i]].rank <= hi
            assert len(entry) in (3, 4)  # the prompt token, plus the top 3 (it may be one of them)
            top = sorted(lp.logprob for t, lp in entry.items() if t != p[i] or lp.rank <= 3)[::-1]
            assert top[:3] == pytest.approx(torch.topk(row, 3).values.tolist(), abs=TOL)
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(row[t].item(), abs=TOL)
    assert_engine_idle(llm)


def test_prompt_logprobs_are_the_same_through_chunking_preemption_and_prefix_cache(tiny_dir, prompts):
    whole = LLM(tiny_dir, dtype="float32", num_kv_blocks=256, max_model_len=512)
    ref = [_values(o) for o in _run(whole, prompts)]
    # 16-token chunks, and 12 blocks (192 tokens) for 10 prompts of up to 153 tokens: preemption.
    small = LLM(tiny_dir, dtype="float32", num_kv_blocks=12, block_size=16, max_model_len=192, max_num_batched_tokens=16)
    got = _run(small, prompts[::-1] + prompts, max_tokens=40)
    assert small.stats().num_preemptions > 0
    for r, o in zip(ref[::-1] + ref, got):
        got_o = _values(o)
        assert [a[2] for a in got_o] == [a[2] for a in r]  # the same top-k tokens
        assert [a[0] for a in got_o] == pytest.approx([a[0] for a in r], abs=1e-4)
        # Ranks deep in the vocabulary may move past near-ties (other chunk shapes, other float sums).
        assert all(abs(a[1] - b[1]) <= max(2, b[1] // 1000) for a, b in zip(got_o, r))
    assert_engine_idle(small)
    # A warm prefix cache does not skip positions: the prompt is recomputed and scored whole.
    whole.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(max_tokens=1), use_tqdm=False)
    queries = whole.stats().prefix_cache_queries
    again = _run(whole, prompts[-1:])[0]
    assert whole.stats().prefix_cache_queries == queries  # no lookup, so none counted (as vLLM)
    assert [a[0] for a in _values(again)] == pytest.approx([a[0] for a in ref[-1]], abs=1e-5)
    assert again.num_cached_tokens == 0
    assert_engine_idle(whole)


def test_prompt_logprobs_once_per_request(tiny_dir, prompts):
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=256, max_model_len=512)
    p = prompts[3]
    # n = 2: one list for the request, from its first completion.
    out = _run(llm, [p], n=2)[0]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == len(p)
    # DELTA: in the first output that carries tokens, never again.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    engine.add_request("d", {"prompt_token_ids": p}, params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs is not None for o in engine.step() if o.request_id == "d"]
    assert seen[0] and not any(seen[1:]) and len(seen) == 4
    # Without the field nothing is computed or sent.
    assert llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    assert_engine_idle(llm)


def test_scored_chunks_do_not_teach_the_step_cost_model(tiny_dir, prompts):
    """A chunk scored for prompt logprobs also runs the LM head on each token; the step-time
    bound's cost model must not learn that as the price of an ordinary prompt token."""
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, max_model_len=512, max_step_ms=200, max_num_batched_tokens=32)
    model = llm.llm_engine.core.scheduler.step_cost
    p = {"prompt_token_ids": prompts[-1]}  # 150 tokens: 5 chunks of 32
    llm.generate(p, SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    scored = model.num_observed
    assert scored == 1  # the one decode step: every chunk was scored (the last one samples the first token)
    llm.generate({"prompt_token_ids": prompts[-2]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert model.num_observed >= scored + 4  # an unscored prompt's 3 chunks (90 tokens) teach it, and its decode
    assert_engine_idle(llm)
