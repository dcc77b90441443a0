"""Tests for pagedserve.model.sampler: greedy / random sampling, filters, penalties, logprobs.

The sampling metadata is built the way the worker builds it: each request a row of a
persistent ``InputBatch`` (``pagedserve.worker.input_batch``), gathered for the step."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

import numpy as np

from pagedserve.model.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_top_k_top_p,
)
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.input_batch import CachedRequestState, InputBatch

CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@dataclass
class FakeRequest:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    eos_token_ids: set[int] = field(default_factory=set)


def req(prompt=None, output=None, eos=None, **kw) -> FakeRequest:
    sp = SamplingParams(**kw)
    gen = CachedRequestState.create("r", sp, []).generator if sp.seed is not None else None  # the worker's seeding
    if sp.seed is not None and gen is None:  # greedy rows keep a generator here, as before
        gen = torch.Generator()
        gen.manual_seed(sp.seed)
    return FakeRequest(
        sampling_params=sp,
        prompt_token_ids=list(prompt if prompt is not None else [1, 2, 3]),
        output_token_ids=list(output or []),
        generator=gen,
        eos_token_ids=set(eos or ()),
    )


def build_metadata(reqs, vocab_size: int, device=CPU) -> SamplingMetadata:
    """Each request as a row of a fresh InputBatch, then the batch's metadata for those rows."""
    longest = max(len(r.prompt_token_ids) + len(r.output_token_ids) for r in reqs)
    batch = InputBatch(len(reqs), longest + 1, 1, vocab_size, torch.device(device))
    rows = []
    for i, r in enumerate(reqs):
        state = CachedRequestState(f"r{i}", r.sampling_params, sorted(r.eos_token_ids), r.generator)
        rows.append(batch.add_request(state, r.prompt_token_ids, r.output_token_ids, [0], 0))
    return batch.sampling_metadata(np.array(rows, dtype=np.int64))


def sample(logits: torch.Tensor, reqs, device=CPU) -> SamplerOutput:
    md = build_metadata(reqs, logits.shape[-1], device)
    return Sampler()(logits.to(device), md)


def dist_logits(probs, rows: int) -> torch.Tensor:
    """[rows, V] logits whose softmax is ``probs``."""
    return torch.log(torch.tensor(probs, dtype=torch.float32)).expand(rows, -1).contiguous()


def chi_square(counts: torch.Tensor, probs) -> float:
    n = counts.sum().item()
    return sum((counts[i].item() - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


# ---------------------------------------------------------------- metadata


def test_build_plain_greedy_is_cheap():
    md = build_metadata([req(temperature=0.0) for _ in range(4)], 32, CPU)
    assert md.all_greedy and not md.all_random
    assert md.no_penalties
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.prompt_token_ids is None and md.output_token_ids is None
    assert md.logit_bias_rows is None and md.min_tokens_rows is None
    assert md.max_num_logprobs is None and md.generators == {}
    assert md.greedy_mask is None
    assert md.temperature.shape == (4,)


def test_build_flags_mixed():
    reqs = [
        req(temperature=0.0, seed=3),  # greedy: seed irrelevant, no generator used
        req(temperature=0.7, top_k=5, seed=1),
        req(temperature=1.0, top_p=0.9, logprobs=2),
        req(temperature=1.0, min_p=0.1, presence_penalty=0.5, logprobs=5),
    ]
    md = build_metadata(reqs, 32, CPU)
    assert not md.all_greedy and not md.all_random
    assert md.greedy_mask.tolist() == [True, False, False, False]
    assert md.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0, 1.0])
    assert md.top_k.tolist() == [0, 5, 0, 0]
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.1])
    assert set(md.generators) == {1}
    assert md.max_num_logprobs == 5
    assert not md.no_penalties
    # Only the penalised row carries tokens; the others are all padding (= vocab size).
    assert md.prompt_token_ids[3].tolist() == [1, 2, 3]
    assert (md.prompt_token_ids[:3] == 32).all()


def test_top_k_at_least_vocab_means_off():
    md = build_metadata([req(top_k=100), req(top_k=-1)], 32, CPU)
    assert md.top_k is None


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    out = sample(logits, [req(temperature=0.0) for _ in range(8)])
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_greedy_bf16_logits():
    torch.manual_seed(1)
    logits = torch.randn(4, 64).to(torch.bfloat16)
    out = sample(logits, [req(temperature=0.0) for _ in range(4)])
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))


def test_mixed_greedy_and_random_keeps_greedy_rows_exact():
    torch.manual_seed(2)
    reqs = [req(temperature=0.0) if i % 2 == 0 else req(temperature=1.5) for i in range(8)]
    md = build_metadata(reqs, 50, CPU)
    sampler = Sampler()
    random_differs = False
    for _ in range(30):
        logits = torch.randn(8, 50)
        toks = sampler(logits, md).sampled_token_ids
        assert torch.equal(toks[0::2], logits[0::2].argmax(-1))
        random_differs |= not torch.equal(toks[1::2], logits[1::2].argmax(-1))
    assert random_differs


def test_input_logits_not_modified():
    torch.manual_seed(3)
    logits = torch.randn(3, 20)
    before = logits.clone()
    reqs = [
        req(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1),
        req(repetition_penalty=1.5, logit_bias={1: 5.0}, min_tokens=2, eos=[0]),
        req(temperature=0.0),
    ]
    sample(logits, reqs)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- filters


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.3, min_p=0.5)],
)
def test_filters_that_leave_one_token_give_argmax(kw):
    torch.manual_seed(4)
    logits = torch.randn(16, 40)
    for _ in range(5):
        out = sample(logits, [req(temperature=1.0, **kw) for _ in range(16)])
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_k_2_never_outside_top2_and_renormalises():
    torch.manual_seed(5)
    probs = [0.05, 0.40, 0.10, 0.25, 0.20]
    n = 8000
    toks = sample(dist_logits(probs, n), [req(top_k=2) for _ in range(n)]).sampled_token_ids
    counts = torch.bincount(toks, minlength=5)
    assert set(toks.unique().tolist()) == {1, 3}
    expected = [0, 0.40 / 0.65, 0, 0.25 / 0.65, 0]
    assert chi_square(counts, expected) < 10.83  # chi2(df=1), p = 0.001


def test_top_p_half_restricts_to_smallest_set():
    torch.manual_seed(6)
    probs = [0.15, 0.45, 0.10, 0.30]  # sorted: 0.45, 0.30 (cum 0.75 >= 0.5), 0.15, 0.10
    n = 8000
    toks = sample(dist_logits(probs, n), [req(top_p=0.5) for _ in range(n)]).sampled_token_ids
    counts = torch.bincount(toks, minlength=4)
    assert set(toks.unique().tolist()) == {1, 3}
    assert chi_square(counts, [0, 0.6, 0, 0.4]) < 10.83


def test_top_k_top_p_mask_directly():
    probs = torch.tensor([[0.15, 0.45, 0.10, 0.30], [0.15, 0.45, 0.10, 0.30], [0.15, 0.45, 0.10, 0.30]])
    logits = probs.log()
    top_k = torch.tensor([0, 3, 0])
    top_p = torch.tensor([0.8, 1.0, 0.46])
    out = apply_top_k_top_p(logits, top_k, top_p)
    keep = torch.isfinite(out)
    # row 0: top_p 0.8 keeps 0.45, 0.30, 0.15 (cum 0.9); row 1: top 3; row 2: 0.45 < 0.46 -> two.
    assert keep.tolist() == [[True, True, False, True], [True, True, False, True], [False, True, False, True]]
    # Kept logits are unchanged.
    assert torch.equal(out[keep], logits[keep])
    # Top-p applies to the top-k-renormalised distribution: top 2 = {0.45, 0.30} -> 0.6/0.4.
    out = apply_top_k_top_p(logits[:1], torch.tensor([2]), torch.tensor([0.55]))
    assert torch.isfinite(out).tolist() == [[False, True, False, False]]
    out = apply_top_k_top_p(logits[:1], torch.tensor([2]), torch.tensor([0.65]))
    assert torch.isfinite(out).tolist() == [[False, True, False, True]]


def test_min_p_restricts():
    torch.manual_seed(7)
    probs = [0.05, 0.50, 0.15, 0.30]  # min_p 0.5 -> keep prob >= 0.25: tokens 1, 3
    n = 8000
    toks = sample(dist_logits(probs, n), [req(min_p=0.5) for _ in range(n)]).sampled_token_ids
    counts = torch.bincount(toks, minlength=4)
    assert set(toks.unique().tolist()) == {1, 3}
    assert chi_square(counts, [0, 0.5 / 0.8, 0, 0.3 / 0.8]) < 10.83


# ---------------------------------------------------------------- distribution


def test_frequencies_match_probs_temperature_1():
    torch.manual_seed(8)
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 20000
    toks = sample(dist_logits(probs, n), [req(temperature=1.0) for _ in range(n)]).sampled_token_ids
    counts = torch.bincount(toks, minlength=4)
    assert chi_square(counts, probs) < 16.27  # chi2(df=3), p = 0.001


def test_temperature_sharpens_distribution():
    torch.manual_seed(9)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    temp = 0.5
    expected = torch.softmax(probs.log() / temp, -1).tolist()
    n = 20000
    toks = sample(dist_logits(probs.tolist(), n), [req(temperature=temp) for _ in range(n)]).sampled_token_ids
    counts = torch.bincount(toks, minlength=4)
    assert chi_square(counts, expected) < 16.27


def test_seeded_request_frequencies_match_probs():
    probs = [0.1, 0.2, 0.3, 0.4]
    r = req(seed=1234)
    md = build_metadata([r], 4, CPU)
    sampler = Sampler()
    logits = dist_logits(probs, 1)
    toks = torch.cat([sampler(logits, md).sampled_token_ids for _ in range(4000)])
    assert chi_square(torch.bincount(toks, minlength=4), probs) < 16.27


# ---------------------------------------------------------------- seeds


def _run_seeded(batch_fn, steps: int, row: int, logits_fn, device=CPU) -> list[int]:
    reqs = batch_fn()
    sampler = Sampler()
    toks = []
    for step in range(steps):
        logits = logits_fn(step, len(reqs))
        md = build_metadata(reqs, logits.shape[-1], device)
        toks.append(int(sampler(logits.to(device), md).sampled_token_ids[row]))
    return toks


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_seeded_request_independent_of_batch(device):
    V = 64
    base = torch.randn(40, V, generator=torch.Generator().manual_seed(10))

    def logits_fn(step, b):
        return base[step].expand(b, V).contiguous()

    alone = _run_seeded(lambda: [req(seed=123, temperature=1.0)], 40, 0, logits_fn, device)
    torch.manual_seed(11)
    batched = _run_seeded(
        lambda: [
            req(temperature=1.0),
            req(seed=999, temperature=0.8, top_k=5),
            req(seed=123, temperature=1.0),
            req(temperature=0.0),
            req(temperature=1.0, top_p=0.3, min_p=0.2),
        ],
        40,
        2,
        logits_fn,
        device,
    )
    assert alone == batched
    assert len(set(alone)) > 5  # it really samples
    # The global RNG state does not matter either.
    torch.manual_seed(12345)
    again = _run_seeded(lambda: [req(temperature=1.0), req(seed=123, temperature=1.0)], 40, 1, logits_fn, device)
    assert again == alone


def test_different_seeds_differ():
    V = 64
    base = torch.randn(50, V, generator=torch.Generator().manual_seed(13))

    def logits_fn(step, b):
        return base[step].expand(b, V).contiguous()

    a = _run_seeded(lambda: [req(seed=1)], 50, 0, logits_fn)
    b = _run_seeded(lambda: [req(seed=2)], 50, 0, logits_fn)
    a2 = _run_seeded(lambda: [req(seed=1)], 50, 0, logits_fn)
    assert a == a2
    assert sum(x != y for x, y in zip(a, b)) > 25
    # Any int64 seed: torch's CPU generator keeps 32 bits, so seeds 2**32 apart (or a negative
    # one and a small one) drew the same tokens before they were folded (found by review).
    for other in (1 + 2**32, 1 - 2**32, -(2**63) + 1):
        c = _run_seeded(lambda: [req(seed=other)], 50, 0, logits_fn)
        assert sum(x != y for x, y in zip(a, c)) > 25, other
    from pagedserve.worker.input_batch import fold_seed

    patterned = [k * 2**32 + j for k in (-(2**31), -3, -1, 0, 1, 7, 2**31 - 1) for j in (0, 1, 2, 2**31)]
    assert all(fold_seed(x) == x for x in (0, 1, 2**32 - 1))  # 32-bit seeds keep their tokens
    assert len({fold_seed(x) for x in patterned}) == len(patterned)


def test_unseeded_rows_follow_global_seed():
    logits = torch.zeros(6, 100)
    reqs = [req() for _ in range(6)]
    torch.manual_seed(14)
    a = sample(logits, reqs).sampled_token_ids
    torch.manual_seed(14)
    b = sample(logits, reqs).sampled_token_ids
    assert torch.equal(a, b)


# ---------------------------------------------------------------- penalties / bias / min_tokens


def _processed(logits, reqs):
    md = build_metadata(reqs, logits.shape[-1], CPU)
    return Sampler.process_logits(logits.float(), md)


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 2)
    reqs = [
        req(prompt=[0, 1], output=[3, 3, 4], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        req(prompt=[0, 1], output=[3, 3, 4]),  # no penalties: untouched
    ]
    out = _processed(logits, reqs)
    # tok0: prompt, 2 / 2 = 1; tok1: prompt, -1 * 2 = -2; tok2, tok5: untouched;
    # tok3: 3 / 2 - 0.5 * 2 - 0.25 = 0.25; tok4: -2 * 2 - 0.5 * 1 - 0.25 = -4.75
    expected = torch.tensor([1.0, -2.0, 0.5, 0.25, -4.75, 1.0])
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], logits[1])


@pytest.mark.parametrize(
    "kw, expected",
    [
        # repetition only: seen = prompt {0, 1} | output {3, 4}
        (dict(repetition_penalty=1.25), [2.0 / 1.25, -1.25, 0.5, 3.0 / 1.25, -2.5, 1.0]),
        # frequency only: output counts {3: 2, 4: 1}; prompt tokens untouched
        (dict(frequency_penalty=-1.0), [2.0, -1.0, 0.5, 5.0, -1.0, 1.0]),
        # presence only
        (dict(presence_penalty=1.5), [2.0, -1.0, 0.5, 1.5, -3.5, 1.0]),
    ],
)
def test_each_penalty_alone(kw, expected):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    out = _processed(logits, [req(prompt=[0, 1], output=[3, 3, 4], **kw)])
    torch.testing.assert_close(out[0], torch.tensor(expected))


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    out = sample(logits, [req(temperature=0.0, prompt=[2], output=[0], presence_penalty=2.0)])
    assert out.sampled_token_ids.tolist() == [1]


def test_allowed_token_ids_restrict_only_their_rows():
    torch.manual_seed(16)
    V = 40
    logits = torch.randn(6, V)
    allowed = [3, 17, 31]
    reqs = [req(temperature=0.0, allowed_token_ids=allowed), req(temperature=0.0)]
    reqs += [req(temperature=1.0, seed=i, allowed_token_ids=allowed) for i in range(3)] + [req(temperature=1.0, seed=9, logprobs=2)]
    for _ in range(20):
        out = sample(logits, reqs)
        toks = out.sampled_token_ids.tolist()
        assert toks[0] == max(allowed, key=lambda t: logits[0, t].item())  # greedy: the best allowed token
        assert toks[1] == int(logits[1].argmax())  # a row without the field is untouched
        assert all(t in allowed for t in toks[2:5])
    processed = _processed(logits, reqs)
    assert torch.isinf(processed[0]).sum() == V - len(allowed) and not torch.isinf(processed[1]).any()
    torch.testing.assert_close(processed[0, allowed], logits[0, allowed])


def test_allowed_token_ids_mask_leaves_with_its_row():
    """The mask is built once when a row is filled; a freed row's next request is unrestricted,
    and a restricted request in a reused row gets its own ids, not the previous one's."""
    V = 12
    batch = InputBatch(2, 8, 1, V, torch.device(CPU))

    def add(rid, **kw):
        return batch.add_request(CachedRequestState(rid, SamplingParams(temperature=0.0, **kw), [], None), [1, 2], [], [0], 0)

    row = add("a", allowed_token_ids=[4, 5])
    other = add("b")
    md = batch.sampling_metadata(np.array([other, row], dtype=np.int64))
    assert md.banned_mask[0].sum() == 0 and md.banned_mask[1].tolist() == [t not in (4, 5) for t in range(V)]
    batch.remove_request("a")
    assert add("c") == row and batch.sampling_metadata(np.array([row, other], dtype=np.int64)).banned_mask is None
    batch.remove_request("c")
    assert add("d", allowed_token_ids=[7]) == row
    md = batch.sampling_metadata(np.array([row], dtype=np.int64))
    assert torch.nonzero(~md.banned_mask[0]).flatten().tolist() == [7]


def test_logit_bias_forces_token():
    torch.manual_seed(15)
    logits = torch.randn(10, 30)
    reqs = [req(temperature=1.0, logit_bias={7: 100.0}) for _ in range(5)]
    reqs += [req(temperature=0.0, logit_bias={11: 100.0, 3: -100.0}) for _ in range(5)]
    out = sample(logits, reqs)
    assert out.sampled_token_ids.tolist() == [7] * 5 + [11] * 5
    processed = _processed(logits, reqs)
    torch.testing.assert_close(processed[5, 3], logits[5, 3] - 100.0)
    torch.testing.assert_close(processed[0, 7], logits[0, 7] + 100.0)
    torch.testing.assert_close(processed[0, :7], logits[0, :7])


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0, 10.0]])
    common = dict(temperature=0.0, min_tokens=3, stop_token_ids=[4], eos=[5])
    # Two tokens out (< 3): EOS 5 and stop id 4 are blocked.
    r = req(output=[0, 1], **common)
    assert sample(logits, [r]).sampled_token_ids.tolist() == [3]
    processed = _processed(logits, [r])
    assert processed[0, 4] == float("-inf") and processed[0, 5] == float("-inf")
    torch.testing.assert_close(processed[0, :4], logits[0, :4])
    # Three tokens out: no longer blocked.
    r = req(output=[0, 1, 2], **common)
    assert sample(logits, [r]).sampled_token_ids.tolist() == [5]
    # min_tokens wins over a logit_bias on the EOS token, and random rows obey it too.
    r = req(output=[], min_tokens=1, eos=[5], temperature=1.0, logit_bias={5: 100.0})
    toks = sample(logits.expand(200, -1), [r] * 200).sampled_token_ids
    assert 5 not in toks.tolist()


def test_min_tokens_only_affects_its_row():
    logits = torch.tensor([[0.0, 10.0, 1.0]] * 2)
    reqs = [req(temperature=0.0, min_tokens=2, eos=[1]), req(temperature=0.0, eos=[1])]
    assert sample(logits, reqs).sampled_token_ids.tolist() == [2, 1]


# ---------------------------------------------------------------- logprobs


def test_logprobs_raw_topk_and_ranks():
    torch.manual_seed(16)
    B, V = 6, 50
    logits = torch.randn(B, V) * 2
    reqs = [
        req(temperature=1.0, logprobs=3),
        req(temperature=0.0, logprobs=1),
        req(temperature=2.0),  # did not ask; still gets a row
        req(temperature=1.0, logprobs=0, logit_bias={int(logits[3].argmin()): 100.0}),
        req(temperature=0.0, logprobs=2, repetition_penalty=1.7, prompt=[int(logits[4].argmax())]),
        req(temperature=5.0, logprobs=3, top_k=10),
    ]
    out = sample(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    toks = out.sampled_token_ids
    assert out.logprobs.shape == (B, 4) and out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids.shape == (B, 4) and out.logprob_token_ids.dtype == torch.int64
    assert out.sampled_ranks.shape == (B,) and out.sampled_ranks.dtype == torch.int64
    # Column 0: the sampled token and its raw (unbiased, unpenalised) logprob.
    assert torch.equal(out.logprob_token_ids[:, 0], toks)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, toks[:, None]).squeeze(1))
    # Columns 1..k: torch.topk of the raw logprobs.
    top_lp, top_ids = torch.topk(raw, 3, dim=-1)
    torch.testing.assert_close(out.logprobs[:, 1:], top_lp)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    # Ranks: position of the sampled token in the raw distribution (1 = most likely).
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = [order[i].tolist().index(int(toks[i])) + 1 for i in range(B)]
    assert out.sampled_ranks.tolist() == expected_ranks
    # The biased row sampled the least likely token: rank V, raw logprob.
    assert int(toks[3]) == int(logits[3].argmin())
    assert int(out.sampled_ranks[3]) == V
    # The penalised greedy row moved off the raw argmax: rank 2.
    assert int(out.sampled_ranks[4]) == 2
    assert int(out.sampled_ranks[1]) == 1


def test_logprobs_zero_gives_only_sampled_column():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sample(logits, [req(temperature=0.0, logprobs=0)])
    assert out.logprobs.shape == (1, 1)
    assert out.logprob_token_ids.tolist() == [[2]]
    torch.testing.assert_close(out.logprobs[0, 0], torch.log_softmax(logits, -1)[0, 2])
    assert out.sampled_ranks.tolist() == [1]


def test_logprobs_k_larger_than_vocab_is_capped():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sample(logits, [req(temperature=0.0, logprobs=20)])
    assert out.logprobs.shape == (1, 4)
    assert out.logprob_token_ids.tolist() == [[2, 2, 1, 0]]


def test_logprobs_from_bf16_logits():
    torch.manual_seed(17)
    logits = torch.randn(2, 32).to(torch.bfloat16)
    out = sample(logits, [req(temperature=0.0, logprobs=2)] * 2)
    raw = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(out.logprobs[:, 1:], torch.topk(raw, 2, -1).values)
    assert math.isclose(out.logprobs[0, 0].item(), raw[0].max().item(), rel_tol=1e-6)


@pytest.mark.parametrize("device", DEVICES[1:], ids=str)
def test_cuda_matches_cpu_for_deterministic_paths(device):
    torch.manual_seed(18)
    logits = torch.randn(4, 100)
    reqs = [
        req(temperature=0.0, logprobs=2, repetition_penalty=1.3, output=[int(logits[0].argmax())]),
        req(temperature=1.0, top_k=1),
        req(temperature=0.0, logit_bias={5: 100.0}),
        req(temperature=1.0, min_tokens=1, eos=[int(logits[3].argmax())], min_p=1.0),
    ]
    cpu = sample(logits, reqs)
    gpu = sample(logits, reqs, device)
    assert torch.equal(cpu.sampled_token_ids, gpu.sampled_token_ids.cpu())
    torch.testing.assert_close(cpu.logprobs, gpu.logprobs.cpu())


def _dense_penalties(logits, prompt_ids, output_ids, rep, freq, pres):
    """The penalties over the whole ``[B, V]`` (the reference the sparse version must equal)."""
    B, V = logits.shape
    counts = torch.zeros((B, V + 1)).scatter_add_(1, output_ids, torch.ones(output_ids.shape))[:, :V]
    seen = torch.zeros((B, V + 1), dtype=torch.bool).scatter_(1, prompt_ids, True)[:, :V] | (counts > 0)
    r = rep.unsqueeze(1)
    out = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return out - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).float()


def test_penalties_equal_the_dense_formula_bit_for_bit():
    """Rows with repeats, padding, -inf entries, no prompt, nothing seen at all, and neutral
    penalties: the sparse computation gives the dense one's bits, and leaves its input alone."""
    from pagedserve.model.sampler import apply_penalties

    g = torch.Generator().manual_seed(0)
    B, V = 6, 300
    logits = torch.randn(B, V, generator=g) * 3
    logits[:, ::11] = float("-inf")
    logits[:, 0] = 1.5  # where a row that has seen nothing points its padding
    prompt = torch.randint(0, V, (B, 40), generator=g)
    output = torch.randint(0, 50, (B, 30), generator=g)  # many repeats
    prompt[1, 25:] = V
    output[1, 10:] = V
    prompt[2] = V  # no prompt tokens (output only)
    prompt[3], output[3] = V, V  # nothing seen
    output[4] = V  # prompt only
    rep = torch.rand(B, generator=g) + 0.5
    freq = torch.rand(B, generator=g) - 0.3
    pres = torch.rand(B, generator=g)
    rep[5], freq[5], pres[5] = 1.0, 0.0, 0.0
    before = logits.clone()
    got = apply_penalties(logits, prompt, output, rep, freq, pres)
    assert torch.equal(logits, before)
    assert torch.equal(got.view(torch.int32), _dense_penalties(logits, prompt, output, rep, freq, pres).view(torch.int32))
    assert torch.equal(got[3], logits[3]) and not torch.equal(got[0], logits[0])


def test_top_logprobs_break_ties_by_the_smaller_id_whatever_k():
    """Equal logprobs: the smaller token id first and at the cut, so top-j is the first j of top-k
    (torch.topk alone orders ties differently for different k, and k is the batch's largest)."""
    from pagedserve.model.logprobs import gather_logprobs, top_k_by_id

    g = torch.Generator().manual_seed(0)
    x = torch.log_softmax(torch.randn(3, 5000, generator=g), -1)
    x[0, [4000, 100, 2500, 3000]] = -0.5  # a 4-way tie at the top
    x[1, [7, 4999, 1234]] = x[1].max() + 1  # ties at the top, and below them another at the cut of k = 4
    x[1, [900, 30, 2000]] = x[1].max() - 0.25
    full_vals, full_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    for k in (1, 2, 3, 4, 5, 20):
        vals, ids = top_k_by_id(x, k)
        assert torch.equal(ids, full_ids[:, :k]) and torch.equal(vals, full_vals[:, :k]), k
    assert full_ids[0, :4].tolist() == [100, 2500, 3000, 4000]
    lp, tids, _ = gather_logprobs(x, torch.tensor([5, 6, 7]), 3)
    assert tids[:, 1:].tolist() == full_ids[:, :3].tolist()
