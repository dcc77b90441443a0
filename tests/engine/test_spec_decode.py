"""Speculative decoding (n-gram drafts): the config, the proposer, the scheduler's bookkeeping
with a fake model (no torch), the rejection sampler's exactness, and the real engine's greedy
output against decoding one token at a time."""
from __future__ import annotations

import collections
import json
import time

import numpy as np
import pytest
import torch

from core_utils import EOS, assert_scheduler_idle, check_invariants, make_request, make_scheduler
from pagedserve.config import EngineConfig, dataclass_from_value
from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.sched.spec_decode import propose_ngram
from pagedserve.model.rejection_sampler import rejection_sample
from pagedserve.model.sampling_metadata import SamplingMetadata
from pagedserve.spec_decode_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# -- config ------------------------------------------------------------------------------------
def spec_config(value) -> SpeculativeConfig:
    return dataclass_from_value(SpeculativeConfig, value, "speculative_config")


def test_config_defaults_and_errors():
    c = spec_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's default
    c = spec_config({"num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    for bad, match in [({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": True}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
                       ({"num_speculative_tokens": 2, "model": "x"}, "unknown key"),
                       ("[1]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=match):
            spec_config(bad)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config=NGRAM, tensor_parallel_size=2)


def test_cli_flag_parses_json():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    cfg = EngineConfig.from_cli_args(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert cfg.speculative.num_speculative_tokens == 3 and cfg.speculative_config["prompt_lookup_max"] == 5


# -- proposer ------------------------------------------------------------------------------------
def test_propose_ngram():
    t = np.array
    # The longest suffix wins over a shorter, later match; among equals the latest.
    assert propose_ngram(t([1, 2, 3, 9, 9, 3, 7, 2, 3]), 2, 1, 3) == [9, 9]
    assert propose_ngram(t([5, 3, 8, 5, 3, 6, 3]), 3, 1, 3) == [6, 3]
    assert propose_ngram(t([1, 2, 3, 4, 1, 2, 3]), 5, 2, 3) == [4, 1, 2, 3]
    assert propose_ngram(t([1, 2, 3, 4, 1, 2, 3]), 2, 4, 5) == []  # no 4-token match
    assert propose_ngram(t([1, 2, 3]), 2, 1, 3) == []  # the last token never occurred before
    assert propose_ngram(t([4, 4, 4, 4]), 3, 1, 3) == [4]  # overlapping repeats; only what follows
    assert propose_ngram(t([7]), 3, 1, 1) == []


# -- scheduler with a fake model -----------------------------------------------------------------
def fake_model(seq: list[int]) -> int:
    """A deterministic next token: mostly a copy from 5 back (so n-grams match), with breaks."""
    n = len(seq)
    if n == seq[0]:  # each request's own EOS point
        return EOS
    if n % 7 == 0:
        return 500 + n % 3
    return seq[n - 5]


class SpecWorker:
    """Holds tokens from the messages alone and verifies drafts against ``fake_model`` greedily."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.num_drafts = 0

    def run(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
        c = so.scheduled_cached_reqs
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        for rid, toks, num_computed in zip(c.req_ids, c.new_token_ids, c.num_computed_tokens):
            self.tokens[rid].extend(toks)
            computed[rid] = num_computed
        out = ModelRunnerOutput()
        for rid, n in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            toks = self.tokens[rid]
            if drafts:
                assert n == 1 + len(drafts) and computed[rid] == len(toks) - 1
            if computed[rid] + n - len(drafts) != len(toks):
                continue
            a = 0
            while a < len(drafts) and drafts[a] == fake_model(toks + drafts[:a]):
                a += 1
            toks.extend(drafts[:a])
            tok = fake_model(toks)
            toks.append(tok)
            out.sampled[rid] = tok
            if drafts:
                out.num_accepted_tokens[rid] = a
                self.num_drafts += 1
        return out


def run_fake(spec, num_blocks=64, budget=64, prompts=None, max_tokens=40, **kw):
    s = make_scheduler(num_blocks=num_blocks, budget=budget, spec=spec, **kw)
    worker = SpecWorker()
    prompts = prompts or [[30 + i] + [10 + (i + j) % 4 for j in range(5 + 3 * i)] for i in range(6)]
    for i, p in enumerate(prompts):
        s.add_request(make_request(f"r{i}", p, max_tokens=max_tokens))
    outputs = collections.defaultdict(list)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert so.num_scheduled_tokens[rid] == 1 + len(drafts)
        res = s.update_from_output(so, worker.run(so))
        for o in res.outputs:
            outputs[o.request_id] += o.new_token_ids
        check_invariants(s, spare_tokens=spec["num_speculative_tokens"] if spec else 0)
    assert_scheduler_idle(s)
    return dict(outputs), s, worker


@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: preemptions
def test_drafts_do_not_change_output(num_blocks):
    base, s0, _ = run_fake(None, num_blocks=num_blocks)
    spec, s1, worker = run_fake(NGRAM, num_blocks=num_blocks)
    assert spec == base
    st = s1.stats
    assert worker.num_drafts == st.spec_decode_num_drafts > 10
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    assert sum(st.spec_decode_num_accepted_tokens_per_pos.values()) == st.spec_decode_num_accepted_tokens
    assert st.num_generation_tokens == s0.stats.num_generation_tokens == sum(map(len, base.values()))
    if num_blocks == 14:
        assert s1.stats.num_preemptions > 0


def test_eos_inside_accepted_drafts_ends_there():
    # The prompt repeats with period 5, so every draft matches until the EOS at length 24.
    prompt = [24, 11, 12, 13, 14, 24, 11, 12, 13, 14]
    base, _, _ = run_fake(None, prompts=[prompt])
    spec, s, _ = run_fake(dict(NGRAM, num_speculative_tokens=8), prompts=[prompt])
    assert spec == base and spec["r0"][-1] == EOS and len(spec["r0"]) == 24 - len(prompt) + 1
    assert s.stats.spec_decode_num_accepted_tokens > 0


def test_drafts_capped_by_max_tokens_and_budget():
    prompt = [99, 11, 12, 13, 14, 99, 11, 12, 13, 14]
    s = make_scheduler(spec=dict(NGRAM, num_speculative_tokens=8))
    s.add_request(make_request("a", prompt, max_tokens=3))
    so = s.schedule()
    assert not so.scheduled_spec_decode_tokens  # a prefill carries no drafts
    s.update_from_output(so, ModelRunnerOutput(sampled={"a": 99}))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [11]}  # max_tokens 3: one sampled, one draft, one after it
    assert s.requests["a"].num_computed_tokens == len(prompt) + 2
    res = s.update_from_output(so, ModelRunnerOutput(sampled={"a": 5}, num_accepted_tokens={"a": 0}))
    assert res.outputs[0].new_token_ids == [5] and s.requests["a"].num_computed_tokens == len(prompt) + 1
    # The step's token budget leaves one token to every other decode first.
    s = make_scheduler(budget=4, spec=dict(NGRAM, num_speculative_tokens=8))
    for rid in "ab":
        s.add_request(make_request(rid, prompt, max_tokens=20))
    while any(r.num_output_tokens == 0 for r in s.requests.values()):  # prefill both, 4 tokens a step
        so = s.schedule()
        s.update_from_output(so, ModelRunnerOutput(sampled={r.request_id: 99 for r in s.running if r.num_computed_tokens == r.num_tokens}))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3, "b": 1} and so.total_num_scheduled_tokens == 4


def test_which_requests_get_drafts_and_batch_size():
    """Position-dependent sampling (the worker handles it per row) gets drafts; a grammar only
    those it accepts, and none while the request thinks; a batch at disable_by_batch_size none."""
    prompt = [99, 11, 12, 13, 14, 99, 11, 12, 13, 14, 99]
    for params in ({"logprobs": 1}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"min_tokens": 5},
                   {"bad_words": ["x"]}):
        s = make_scheduler(spec=NGRAM)
        s.add_request(make_request("a", prompt, max_tokens=20, **params))
        so = s.schedule()
        s.update_from_output(so, ModelRunnerOutput(sampled={"a": 11}))
        assert s.schedule().scheduled_spec_decode_tokens == {"a": [12, 13, 14]}, params
    s = make_scheduler(spec=NGRAM)
    s.add_request(make_request("a", prompt, max_tokens=20))
    req = s.requests["a"]
    req.append_output_token_ids([11])
    assert s.drafter.draft_tokens(req, 3) == [12, 13, 14]


    class Grammar:  # accepts the first 2 of any drafts and never completes
        def validate_tokens(self, tokens):
            return min(2, len(tokens))

        def deep_copy(self):
            return self

        def consume_token(self, token):
            pass

        def is_error(self):
            return False

        def is_stopped(self):
            return False

    req.grammar = Grammar()
    assert s.drafter.draft_tokens(req, 3) == [12, 13]
    req.in_reasoning = True
    assert s.drafter.draft_tokens(req, 3) == []
    s = make_scheduler(spec=dict(NGRAM, disable_by_batch_size=2))
    for rid in "ab":
        s.add_request(make_request(rid, prompt, max_tokens=20))
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(sampled={"a": 11, "b": 11}))
    assert not s.schedule().scheduled_spec_decode_tokens


def test_no_preemption_for_drafts():
    prompt = [99, 11, 12, 13, 14, 99, 11, 12]  # 8 tokens = 2 blocks of 4
    s = make_scheduler(num_blocks=3, max_model_len=64, spec=dict(NGRAM, num_speculative_tokens=6))
    s.add_request(make_request("a", prompt, max_tokens=20))
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(sampled={"a": 13}))
    so = s.schedule()  # 3 free blocks hold 12 tokens: the step has 9 + 3 drafts at most
    assert len(so.scheduled_spec_decode_tokens["a"]) == 3 and not so.preempted_req_ids


def test_drafts_never_take_a_block_a_later_decode_needs():
    # a: 7 tokens (its 2nd block has 1 free slot); b: 9 (its next token needs a 3rd block); 1 free block.
    s = make_scheduler(num_blocks=5, max_model_len=20, spec=NGRAM)
    s.add_request(make_request("a", [11, 12, 13, 11, 12, 13], max_tokens=10))
    s.add_request(make_request("b", [21, 22, 23, 24, 25, 26, 27, 28], max_tokens=10))
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled={"a": 11, "b": 29}))
    so = s.schedule()
    assert not so.preempted_req_ids and so.num_scheduled_tokens == {"a": 2, "b": 1}
    assert so.scheduled_spec_decode_tokens == {"a": [12]}  # only the slot left in a's own block


# -- rejection sampler ---------------------------------------------------------------------------
def _meta(n, temperature=1.0, greedy=False, generators=None):
    return SamplingMetadata(temperature=torch.full((n,), temperature), all_greedy=greedy, all_random=not greedy,
                            greedy_mask=None, top_k=None, top_p=None, min_p=None, generators=generators or {},
                            max_num_logprobs=None, no_penalties=True, vocab_size=8, num_reqs=n,
                            **dict.fromkeys(["prompt_token_ids", "output_token_ids", "repetition_penalties", "frequency_penalties",
                                             "presence_penalties", "logit_bias_rows", "logit_bias_cols", "logit_bias_values",
                                             "min_tokens_rows", "min_tokens_cols"]))


def _verify_one(params, drafts, output=(5,), eos=(), bad_words=None, allowed=None):
    """ModelRunner._verify_drafts on one request (prompt [1], ``output`` so far) whose every row
    has the same raw logits over 8 tokens (3: 2.0, 2: 1.5, the rest 0): (kept, token, logprobs)."""
    from types import SimpleNamespace

    from pagedserve.model.sampler import torch_argmax
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.worker.input_batch import CachedRequestState, InputBatch
    from pagedserve.worker.model_runner import ModelRunner

    cpu = torch.device("cpu")
    runner = object.__new__(ModelRunner)
    runner.device = cpu
    runner.input_batch = batch = InputBatch(2, 32, 1, 8, cpu)
    runner.model = SimpleNamespace(compute_logits=lambda h: h, backend=SimpleNamespace(argmax=torch_argmax))
    sp = SamplingParams(temperature=0.0, **params)
    if bad_words is not None:
        sp._bad_words_token_ids = bad_words
    row = batch.add_request(CachedRequestState("r", sp, list(eos), None), [1], list(output), [0], 0)
    n = int(batch.num_tokens[row])
    batch.token_ids[row, n: n + len(drafts)] = drafts  # as execute_model places them
    hidden = torch.zeros(len(drafts) + 1, 8)
    hidden[:, 3], hidden[:, 2] = 2.0, 1.5
    out = ModelRunnerOutput()
    so = SimpleNamespace(scheduled_spec_decode_tokens={"r": drafts}, structured_output_request_ids=[], grammar_bitmask=None)
    if allowed is not None:  # a grammar's mask per row: the tokens each row allows
        so.structured_output_request_ids = ["other"] + ["r"] * len(allowed)
        so.grammar_bitmask = np.array([0] + [sum(1 << t for t in a) for a in allowed], dtype="<i4").tobytes()
    runner._verify_drafts(["r"], np.array([row]), np.array([len(drafts) + 1]), np.array([len(drafts)]), so, hidden, out)
    assert batch.token_ids[row, n: n + out.num_accepted_tokens["r"] + 1].tolist() == drafts[: out.num_accepted_tokens["r"]] + [out.sampled["r"]]
    return out.num_accepted_tokens["r"], out.sampled["r"], out.logprobs.get("r")


def test_verify_rows_see_the_drafts_before_them():
    """Each verify row's penalties, bad words and min_tokens count the drafts before it as
    output; logprobs come for every appended token."""
    assert _verify_one({"presence_penalty": 1.0}, [3, 3])[:2] == (1, 2)  # row 1 sees draft 3 as output
    assert _verify_one({"frequency_penalty": 0.3}, [3, 3, 3])[:2] == (2, 2)  # 3 at 2.0, 1.7, then 1.4 < 1.5
    assert _verify_one({"frequency_penalty": 0.3}, [3, 2, 3])[:2] == (1, 3)  # row 1: 3 still leads (1.7)
    assert _verify_one({}, [3, 3], bad_words=[[3, 3]])[:2] == (1, 2)  # 3 after 3 is banned from row 1 on
    assert _verify_one({"min_tokens": 2}, [2, 3], eos=[3])[:2] == (2, 3)  # EOS allowed once 2 tokens are out
    assert _verify_one({"min_tokens": 3}, [2, 3], eos=[3])[:2] == (1, 2)
    kept, tok, lps = _verify_one({"logprobs": 1}, [3, 2])
    raw = torch.log_softmax(torch.tensor([0, 0, 1.5, 2.0, 0, 0, 0, 0]), -1)
    assert (kept, tok) == (1, 3) and len(lps) == 2
    for ids, lp, rank in lps:
        assert ids == [3, 3] and rank == 1 and lp == pytest.approx([raw[3].item()] * 2)
    assert _verify_one({}, [3, 2])[2] is None
    # a grammar's mask per position: row 1 forbids 3, so draft 1 goes and 2 comes instead
    assert _verify_one({}, [3, 3], allowed=[{2, 3}, {1, 2}, {3}])[:2] == (1, 2)
    assert _verify_one({}, [3, 3], allowed=[{2, 3}, {3}, {1}])[:2] == (2, 1)


def test_rejection_sampler_greedy_keeps_the_argmax_run():
    logits = torch.tensor([[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0], [0, 0, 0, 5.0]])
    kept, toks = rejection_sample(logits, _meta(4, greedy=True), torch.tensor([1, 2, 3, -1]), [3])
    assert (kept, toks) == ([2], [0])  # drafts 1, 2 kept; 3 rejected, the argmax 0 instead
    kept, toks = rejection_sample(logits, _meta(4, greedy=True), torch.tensor([1, 2, 0, -1]), [3])
    assert (kept, toks) == ([3], [3])  # all kept, then the bonus token


def test_rejection_sampler_is_exact():
    """The first token out of a verified decode is distributed as the model's p, whatever the
    draft (a chi-square test over 20,000 draws at 0.1 %)."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = p.log().unsqueeze(0).repeat(2, 1)
    n = 20000
    for draft in (0, 3):
        counts = collections.Counter()
        L = logits.repeat(n, 1)
        drafts = torch.tensor([draft, -1]).repeat(n)
        kept, toks = rejection_sample(L, _meta(2 * n), drafts, [1] * n)
        for a, t in zip(kept, toks):
            counts[draft if a else t] += 1
        assert sum(kept) / n == pytest.approx(p[draft].item(), abs=0.02)
        observed = np.array([counts[i] for i in range(5)])
        chi2 = (((observed - n * p.numpy()) ** 2) / (n * p.numpy())).sum()
        assert chi2 < 18.47, (draft, observed)  # 4 degrees of freedom, p = 0.001


def test_rejection_sampler_seeded_rows_repeat():
    logits = torch.randn(6, 8)
    drafts = torch.tensor([1, 2, -1, 3, 4, -1])
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(7)
        g = {i: gen for i in range(3)}  # the seeded request's three rows share its generator
        runs.append(rejection_sample(logits, _meta(6, generators=g), drafts, [2, 2]))
    assert runs[0][0][0] == runs[1][0][0] and runs[0][1][0] == runs[1][1][0]


# -- the real engine ------------------------------------------------------------------------------
COPY_PROMPTS = [
    "Repeat this sentence exactly three times: The quick brown fox jumps over the lazy dog.",
    "Write the numbers from 1 to 30 separated by commas.",
    "def add(a, b):\n    return a + b\n\nRewrite the function above with type hints and a docstring.",
    "What is the capital of France?",
]


DAYS = [{"role": "user", "content": "List the days of the week, one per line, then list them again in the same order."}]


@pytest.fixture(scope="module")
def plain_bf16():
    """SmolLM2 in bfloat16 without drafts. The bf16 CPU kernels compute every row of a step the
    same way whatever else is in it, so a verified draft's row is bit-identical to a one-token
    decode's (float32, float16 and the PyTorch backend promise that only to rounding: README)."""
    from pagedserve import LLM

    llm = LLM(dtype="bfloat16", quantization="none", max_model_len=2048, num_threads=1, num_kv_blocks=200)
    yield llm
    del llm


def test_engine_greedy_output_unchanged(plain_bf16):
    from conftest import assert_engine_idle
    from pagedserve import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in plain_bf16.generate(COPY_PROMPTS, greedy, use_tqdm=False)]
    llm = LLM(dtype="bfloat16", quantization="none", max_model_len=256, num_threads=1, num_kv_blocks=24, speculative_config=dict(NGRAM, num_speculative_tokens=4))
    try:
        mixed = [greedy, SamplingParams(temperature=0.8, seed=3, max_tokens=64, ignore_eos=True), SamplingParams(temperature=0, max_tokens=64, logprobs=2, ignore_eos=True),
                 SamplingParams(temperature=0, max_tokens=64, repetition_penalty=1.3)]
        outs = llm.generate(COPY_PROMPTS * 2, [greedy] * 4 + mixed, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert got[:4] == base and got[4] == base[0] and got[6] == base[2]
        assert len(outs[6].outputs[0].logprobs) == len(got[6])
        decodes = [e for rec in llm.get_step_trace() for e in rec["scheduled"] if e.get("num_draft_tokens")]
        assert decodes and all(e["phase"] == "decode" and e["num_tokens"] == 1 + e["num_draft_tokens"] for e in decodes)
        stats = llm.llm_engine.get_stats()
        assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > 0  # 24 blocks: preempts
        # A stop string inside a step's accepted drafts: the ids end where they end one at a time.
        # It is cut from the drafted answer itself (what the model writes differs with the host's
        # bf16 rounding): it ends with the first token of a step that accepted drafts.
        free = llm.chat(DAYS, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0]
        ids, text = free.outputs[0].token_ids, free.outputs[0].text
        steps = [e for rec in llm.get_step_trace() for e in rec["scheduled"] if e["request_id"] == free.request_id and e["phase"] == "decode"]
        num_prompt = len(free.prompt_token_ids)
        # A decode step that starts with b tokens cached emits output tokens b - P + 1 .. b' - P (b' the next step's).
        firsts = [a["num_computed_tokens"] - num_prompt + 1 for a, b in zip(steps, steps[1:])
                  if a.get("num_draft_tokens") and b["num_computed_tokens"] - a["num_computed_tokens"] >= 2]
        assert firsts, "no step accepted a draft: pick a more repetitive prompt"
        t = firsts[0]
        end = len(llm.get_tokenizer().decode(ids[: t + 1], skip_special_tokens=True))
        assert 0 < end < len(text), (t, text)
        # The shortest string ending there that occurs nowhere earlier in the answer.
        k = next(k for k in range(1, end + 1) if text[end - k : end].strip() and text.find(text[end - k : end]) == end - k)
        stop_str = text[end - k : end]
        stop = SamplingParams(temperature=0, max_tokens=80, stop=[stop_str], logprobs=1)
        ref, got = (e.chat(DAYS, stop, use_tqdm=False)[0].outputs[0] for e in (plain_bf16, llm))
        assert ref.finish_reason == got.finish_reason == "stop" and got.text == ref.text and got.token_ids == ref.token_ids
        assert got.token_ids == ids[: t + 1] and got.text == text[: end - k], (stop_str, got.text, text)
        assert [list(e) for e in got.logprobs] == [list(e) for e in ref.logprobs]  # and their logprobs
        assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)
        assert_engine_idle(llm)
    finally:
        del llm


def _with_and_without_drafts(plain_bf16, prompts, params):
    """(outputs without drafts, outputs with k = 4 drafts) of the same requests; checks that every
    request had drafts, that some were kept and that the drafting engine ends idle."""
    from conftest import assert_engine_idle
    from pagedserve import LLM

    ref = plain_bf16.generate(prompts, params, use_tqdm=False)
    llm = LLM(dtype="bfloat16", quantization="none", max_model_len=256, num_threads=1, num_kv_blocks=64, speculative_config=dict(NGRAM, num_speculative_tokens=4))
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        drafted = {e["request_id"] for rec in llm.get_step_trace() for e in rec["scheduled"] if e.get("num_draft_tokens")}
        assert drafted == {o.request_id for o in got}
        assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
        assert_engine_idle(llm)
    finally:
        del llm
    return ref, got


def test_engine_position_dependent_sampling_with_drafts(plain_bf16):
    """Penalties, bad_words, min_tokens and logprobs with drafts: each row sees the drafts before
    it as output, so token ids, logprobs, top logprobs and ranks equal one-token-at-a-time
    decoding's, and every one of these requests had drafts."""
    from pagedserve import SamplingParams

    prompts = [COPY_PROMPTS[0], COPY_PROMPTS[1], COPY_PROMPTS[0], COPY_PROMPTS[3], COPY_PROMPTS[1], COPY_PROMPTS[0]]
    params = [SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.15),
              SamplingParams(temperature=0, max_tokens=48, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=0, max_tokens=48, bad_words=[" lazy dog"]),
              SamplingParams(temperature=0, max_tokens=48, min_tokens=40),
              SamplingParams(temperature=0, max_tokens=48, logprobs=3),
              SamplingParams(temperature=0, max_tokens=48, logprobs=0, repetition_penalty=1.1, bad_words=[" fox"]),
              SamplingParams(temperature=0, max_tokens=48)]
    prompts.append(COPY_PROMPTS[0])
    ref, got = _with_and_without_drafts(plain_bf16, prompts, params)
    for r, g in zip(ref, got):
        r, g = r.outputs[0], g.outputs[0]
        assert g.token_ids == r.token_ids and g.text == r.text
        assert (g.logprobs is None) == (r.logprobs is None)
        if r.logprobs is not None:
            assert len(g.logprobs) == len(g.token_ids)
            for a, b in zip(r.logprobs, g.logprobs):
                assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
                assert all(abs(a[t].logprob - b[t].logprob) <= 1e-6 for t in a)
            assert abs(g.cumulative_logprob - r.cumulative_logprob) <= 1e-4
    assert len(got[3].outputs[0].token_ids) >= 40  # min_tokens held through the drafts
    assert got[2].outputs[0].token_ids != got[6].outputs[0].token_ids  # the ban changed something


def test_engine_structured_output_with_drafts(plain_bf16):
    """A JSON schema and a regex with drafts: drafts are cut to what the grammar accepts and each
    verify row is masked by the grammar's state after the drafts before it, so the output equals
    one-token-at-a-time decoding's and stays valid; drafts were kept."""
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    record = '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": "the first computer program"}'
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "field": {"type": "string"},
                                               "known_for": {"type": "string"}},
              "required": ["name", "born", "field", "known_for"]}
    # The third: the drafts after "the answer is" run on to the prompt's end-of-turn token, past
    # where the choice completes (a matcher that took them could not be rolled back).
    say = plain_bf16.get_tokenizer().apply_chat_template([{"role": "user", "content": "Say exactly this: the answer is yes indeed"}],
                                                          tokenize=False, add_generation_prompt=True)
    prompts = [f"Copy this JSON record exactly:\n{record}\n", "Write the numbers from 1 to 30 separated by commas: ", say]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(regex=r"(\d+, ){5,40}\d+")),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["the answer is yes indeed", "no"]))]
    ref, got = _with_and_without_drafts(plain_bf16, prompts, params)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids and g.outputs[0].finish_reason == r.outputs[0].finish_reason
    # What the grammar guarantees, not what the model knows (its digits differ with the host's bf16 rounding).
    record_out = json.loads(got[0].outputs[0].text)
    assert set(record_out) == set(schema["properties"]) and isinstance(record_out["born"], int)
    assert all(isinstance(record_out[k], str) for k in ("name", "field", "known_for"))
    assert got[2].outputs[0].text in ("the answer is yes indeed", "no") and got[2].outputs[0].finish_reason == "stop"


def test_grammar_drafts_end_where_the_grammar_completes(plain_bf16):
    """valid_draft_prefix keeps the drafts up to the token that completes the grammar (not the
    EOS after it) and, like the mask rows for drafts, leaves the request's matcher as it was."""
    from pagedserve.core.structured_output import StructuredOutputManager
    from pagedserve.sampling_params import StructuredOutputsParams

    tok = plain_bf16.get_tokenizer()
    mgr = StructuredOutputManager(lambda: tok, 49152, lambda _: [tok.eos_token_id])
    m = mgr.new_matcher(StructuredOutputsParams(choice=["the answer is yes indeed", "no"]))
    ids = tok.encode("the answer is yes indeed")
    for t in ids[:2]:
        assert mgr.accept_token(m, t) is None
    eos = tok.eos_token_id
    assert mgr.valid_draft_prefix(m, ids[2:] + [eos]) == len(ids) - 2
    assert mgr.valid_draft_prefix(m, ids[3:]) == 0
    mask, slow = mgr.grammar_bitmask([m], [ids[2:]])
    rows = np.frombuffer(mask, dtype="<i4").reshape(len(ids) - 1, -1)
    bit = lambda row, t: (int(rows[row][t // 32]) >> (t % 32)) & 1  # noqa: E731
    assert [bit(j, ids[2 + j]) for j in range(len(ids) - 2)] == [1] * (len(ids) - 2) and bit(len(ids) - 2, eos) == 1
    assert not slow
    for t in ids[2:-1]:  # the matcher still stands after the second token
        assert mgr.accept_token(m, t) is None
    assert mgr.accept_token(m, ids[-1]) == "done"


def test_server_with_drafts_streams_the_same_text(plain_bf16):
    """The server path (engine core in its own process, HTTP, streamed deltas, a stop string)
    with n-gram drafts: the text equals the offline engine's without drafts, and /metrics counts
    the drafts."""
    import httpx

    from app_utils import serve
    from pagedserve import EngineConfig, SamplingParams
    from pagedserve.engine.async_llm import AsyncLLM

    messages = DAYS
    ref = plain_bf16.chat(messages, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0].outputs[0].text
    stop = " Monday, Wednesday"  # a slip the greedy text makes once, mid-way
    assert ref.count(stop) == 1
    cut = ref[: ref.index(stop)]
    config = EngineConfig(dtype="bfloat16", quantization="none", num_kv_blocks=160, max_model_len=2048, num_threads=1,
                          speculative_config=dict(NGRAM, num_speculative_tokens=4))
    llm = AsyncLLM(config, engine_process=True)
    try:
        with serve(llm) as base, httpx.Client(base_url=base, timeout=120) as http:
            body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "temperature": 0, "max_tokens": 80}
            whole = http.post("/v1/chat/completions", json=body).json()
            assert whole["choices"][0]["message"]["content"] == ref
            # usage counts the tokens up to a stop string, as without drafts
            cut_ref = plain_bf16.chat(messages, SamplingParams(temperature=0, max_tokens=80, stop=[" Sunday, Monday, Tuesday"]),
                                      use_tqdm=False)[0].outputs[0]
            stopped = http.post("/v1/chat/completions", json={**body, "stop": [" Sunday, Monday, Tuesday"]}).json()
            assert stopped["choices"][0]["message"]["content"] == cut_ref.text
            assert stopped["usage"]["completion_tokens"] == len(cut_ref.token_ids)
            parts = []
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "stop": [stop]}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        parts += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
            assert "".join(parts) == cut
            metrics = http.get("/metrics").text
            accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("pagedserve:spec_decode_num_accepted_tokens_total{")]
            assert accepted and accepted[0] > 0
            assert 'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name=' in metrics
        for _ in range(200):  # every block back (the stop string's abort included)
            st = llm.get_stats()
            if st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_total_blocks:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(llm.get_stats())
    finally:
        llm.shutdown()


def test_decode_instance_with_drafts_after_a_remote_prefill():
    """Prefill/decode disaggregation: the decode instance speculates on a prompt whose KV came
    over the network; its tokens equal one engine's without drafts."""
    from server_utils import free_port
    from kv_utils import idle, run
    from pagedserve.core.outputs import EngineCoreRequest
    from pagedserve.engine.core import EngineCore
    from pagedserve.sampling_params import SamplingParams

    def core(role=None, spec=None):
        kv = {"kv_transfer_config": {"kv_role": role, "kv_port": free_port(), "kv_load_failure_policy": "fail"}} if role else {}
        return EngineCore(EngineConfig(dtype="bfloat16", num_threads=1, num_kv_blocks=64, max_model_len=1024, speculative_config=spec, **kv))

    prompt = [1000 + (i % 7) * 13 for i in range(40)]  # a repeating pattern the model continues

    def add(c, n, params):
        c.add_request(EngineCoreRequest("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), [2],
                                        time.monotonic(), None, None, params))

    P, D, C = core("kv_producer"), core("kv_consumer", dict(NGRAM, num_speculative_tokens=4)), core()
    try:
        add(P, 1, {"do_remote_decode": True})
        final = [o for o in run([P, D], lambda: not P.scheduler.requests)[id(P)] if o.finish_reason][-1]
        add(D, 40, final.kv_transfer_params)
        got = [t for o in run([P, D], lambda: idle(P) and idle(D), timeout=60)[id(D)] if o.request_id == "r" for t in o.new_token_ids]
        add(C, 40, None)
        want = [t for o in run([C], lambda: idle(C), timeout=60)[id(C)] for t in o.new_token_ids]
        stats = D.get_stats()
        assert got == want and len(got) == 40
        assert stats.kv_transfer_received_tokens == 32 and stats.spec_decode_num_accepted_tokens > 0
    finally:
        for c in (P, D, C):
            c.shutdown()
