"""Scheduler unit tests with no model: each step is ``schedule()``, a fake worker that reads
the ``SchedulerOutput`` message as the model runner does, then ``update_from_output`` with
hand-made sampled tokens for the requests whose chunk reaches the end of their known tokens.

Ends with a property-based test (hypothesis) that drives Scheduler + KVCacheManager with a
fake model through random interleavings of add / step / abort / finish with shared prefixes,
a small pool and cache salts, and checks the invariants of design.md after every step.
"""
from __future__ import annotations

import random
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from core_utils import (
    EOS, TOK, B, StepResult, assert_scheduler_idle, check_invariants, drain, make_request, make_scheduler, plan, step,
)
from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

make_sched = make_scheduler
assert_sched_idle = assert_scheduler_idle
_uid = iter(range(10**9))


def add(sched, rid: str, prompt_len: int, max_tokens: int = 8, tokens: Optional[list[int]] = None, **params) -> Request:
    """Queue a request whose prompt is distinct from every other one unless ``tokens`` is given."""
    if tokens is None:
        base = 1000 + 100 * next(_uid)
        tokens = [base + i for i in range(prompt_len)]
    req = make_request(rid, tokens, max_tokens=max_tokens, **params)
    sched.add_request(req)
    return req


# --------------------------------------------------------------------------------------------
# Continuous batching, FCFS, limits
# --------------------------------------------------------------------------------------------
def test_continuous_batching_finished_leave_and_waiting_join():
    s = make_sched(max_num_seqs=2)
    r1 = add(s, "r1", 5, max_tokens=2)
    add(s, "r2", 5, max_tokens=4)
    add(s, "r3", 5, max_tokens=1)
    assert plan(step(s)) == {"r1": 5, "r2": 5}  # r3 waits: max_num_seqs
    assert plan(step(s)) == {"r1": 1, "r2": 1}  # r1 reaches max_tokens and leaves ...
    assert r1.status == RequestStatus.FINISHED_LENGTH_CAPPED and "r1" not in s.requests
    assert "r1" not in s.kv_cache_manager.req_to_blocks  # ... with its blocks freed in the same step
    assert plan(step(s)) == {"r2": 1, "r3": 5}  # ... and r3 joins the running batch
    assert plan(step(s)) == {"r2": 1}
    assert not s.has_unfinished_requests()
    assert_sched_idle(s)


def test_fcfs_a_blocked_head_is_not_overtaken():
    s = make_sched(num_blocks=6)
    add(s, "r0", 12, max_tokens=3)  # 3 blocks
    step(s)
    add(s, "r1", 16, max_tokens=1)  # 4 blocks: does not fit while r0 runs
    add(s, "r2", 4, max_tokens=1)  # 1 block: would fit, but r1 came first
    assert plan(step(s)) == {"r0": 1}
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    assert plan(step(s)) == {"r0": 1}  # r0 finishes here
    assert plan(step(s)) == {"r1": 16, "r2": 4}
    assert_sched_idle(s)


def test_fcfs_order_under_the_token_budget():
    s = make_sched(budget=10)
    for i in range(3):
        add(s, f"r{i}", 6, max_tokens=2)
    plans = drain(s)
    assert plans[0] == {"r0": 6, "r1": 4}  # r1 chunked by the budget, r2 waits
    assert plans[1] == {"r0": 1, "r1": 2, "r2": 6}  # oldest first
    assert all(sum(p.values()) <= 10 for p in plans)
    assert_sched_idle(s)


def test_token_budget_is_never_exceeded():
    s = make_sched(budget=7, max_num_seqs=16)
    for i in range(6):
        add(s, f"r{i}", 3 + 2 * i, max_tokens=3 + i)
    plans = drain(s)
    assert all(0 < sum(p.values()) <= 7 for p in plans)
    assert max(sum(p.values()) for p in plans) == 7
    assert_sched_idle(s)


def test_max_num_seqs_limits_the_running_batch():
    s = make_sched(max_num_seqs=2)
    for i in range(5):
        add(s, f"r{i}", 3, max_tokens=2 + i % 2)
    seen = []
    while s.has_unfinished_requests():
        out = step(s)
        assert len(out.scheduled) <= 2 and len(s.running) <= 2
        seen.extend(rid for rid in plan(out) if rid not in seen)
    assert seen == [f"r{i}" for i in range(5)]
    assert_sched_idle(s)


def test_chunked_prefill_samples_only_after_the_last_chunk():
    s = make_sched(budget=4)
    r = add(s, "r", 10, max_tokens=2)
    outs = []
    for want_computed in (4, 8, 10):
        out = step(s)
        outs.append(out)
        assert r.num_computed_tokens == want_computed
    assert [plan(o) for o in outs] == [{"r": 4}, {"r": 4}, {"r": 2}]
    assert [o.scheduled[0].samples for o in outs] == [False, False, True]
    assert [o.scheduled[0].num_computed_tokens for o in outs] == [0, 4, 8]
    assert r.output_token_ids == [TOK]  # nothing sampled mid-prefill
    assert plan(step(s)) == {"r": 1}
    assert_sched_idle(s)


def test_long_prefill_token_threshold_caps_one_requests_chunk():
    s = make_sched(budget=64, threshold=5)
    add(s, "a", 12, max_tokens=1)
    add(s, "b", 3, max_tokens=1)
    assert drain(s) == [{"a": 5, "b": 3}, {"a": 5}, {"a": 2}]
    assert_sched_idle(s)


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    s = make_sched(budget=8, chunked=False)
    add(s, "a", 6, max_tokens=2)
    add(s, "b", 6, max_tokens=1)
    assert plan(step(s)) == {"a": 6}  # b (6) does not fit in the 2 tokens left: not cut
    assert plan(step(s)) == {"a": 1, "b": 6}
    assert_sched_idle(s)


def test_duplicate_request_id_is_refused():
    s = make_sched()
    add(s, "x", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "x", 3)
    s.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    assert_sched_idle(s)


# --------------------------------------------------------------------------------------------
# design.md's worked example: budget 6, two decoders, a 12-token prompt arrives
# --------------------------------------------------------------------------------------------
def _two_decoders(s: Scheduler, max_tokens: int = 8) -> None:
    add(s, "d1", 2, max_tokens=max_tokens)
    add(s, "d2", 2, max_tokens=max_tokens)
    assert plan(step(s)) == {"d1": 2, "d2": 2}  # both are now decoding


def test_worked_example_with_chunks_of_four_nobody_stalls():
    s = make_sched(budget=6, threshold=4)
    _two_decoders(s)
    p = add(s, "p", 12, max_tokens=1)
    outs = [step(s) for _ in range(3)]
    # Each of the next three steps: 4 prompt tokens plus one token for each decoder.
    assert [plan(o) for o in outs] == [{"d1": 1, "d2": 1, "p": 4}] * 3
    assert [o.num_batched_tokens for o in outs] == [6, 6, 6]
    # The prompt finishes prefill (and samples its first token) in the third step.
    assert [next(sr.samples for sr in o.scheduled if sr.request_id == p.request_id) for o in outs] == [False, False, True]
    assert p.status == RequestStatus.FINISHED_LENGTH_CAPPED and p.output_token_ids == [TOK]
    drain(s)
    assert_sched_idle(s)


def test_worked_example_without_chunking_and_budget_6_the_prompt_never_runs():
    # Unchunked, the prompt needs a step whose budget holds it whole. The scheduler serves
    # running requests first, so the decoders never stall; the 12-token prompt cannot run at
    # all under a budget of 6 (the engine refuses that configuration: budget >= max_model_len).
    s = make_sched(budget=6, chunked=False)
    _two_decoders(s, max_tokens=4)
    p = add(s, "p", 12, max_tokens=1)
    assert [plan(step(s)) for _ in range(3)] == [{"d1": 1, "d2": 1}] * 3
    assert plan(step(s)) == {} and p.status == RequestStatus.WAITING
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert_sched_idle(s)


def test_worked_example_without_chunking_the_prompt_step_stalls_the_decoders():
    # With a budget that holds the prompt (>= 12 + 2), the decoders' next token comes out of a
    # step that also runs the whole 12-token prefill: their inter-token latency is that of a
    # 14-token step instead of a 2-token one (chunks of 4 cap every step at 6 tokens).
    s = make_sched(budget=14, chunked=False)
    _two_decoders(s)
    p = add(s, "p", 12, max_tokens=1)
    out = step(s)
    assert plan(out) == {"d1": 1, "d2": 1, "p": 12}
    assert out.num_batched_tokens == 14
    assert p.is_finished()  # its own first token came one step in: the trade-off
    drain(s)
    assert_sched_idle(s)


def test_worked_example_unchunked_prompt_runs_once_decoders_finish():
    s = make_sched(budget=12, chunked=False)
    _two_decoders(s, max_tokens=3)
    add(s, "p", 12, max_tokens=2)
    plans = drain(s)
    assert plans == [{"d1": 1, "d2": 1}, {"d1": 1, "d2": 1}, {"p": 12}, {"p": 1}]
    assert_sched_idle(s)


# --------------------------------------------------------------------------------------------
# Preemption by recompute
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_frees_the_most_recent_and_requeues_it_at_the_front(caching):
    s = make_sched(num_blocks=5, caching=caching)
    a = add(s, "a", 8, max_tokens=3)
    b = add(s, "b", 8, max_tokens=3)
    assert plan(step(s)) == {"a": 8, "b": 8}  # 4 of 5 blocks used
    add(s, "c", 4, max_tokens=1)  # 1 block: would fit in the free one
    out = step(s)
    # a (admitted first) takes the last block for position 8; b cannot get one and is the most
    # recently admitted running request: preempted, back at the front of waiting.
    assert plan(out) == {"a": 1}
    assert out.preempted_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert "b" not in s.kv_cache_manager.req_to_blocks
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # and nothing was admitted this step
    assert s.get_stats().num_preemptions == 1
    check_invariants(s)
    # b (9 tokens now: 8 prompt + 1 output) needs 3 blocks: it waits for a to finish.
    assert plan(step(s)) == {"a": 1}
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    out = step(s)
    if caching:  # b's two full blocks stayed cached: only its last token is recomputed
        assert plan(out) == {"b": 1, "c": 4}
        assert out.scheduled[0].num_computed_tokens == 8
    else:  # recompute from scratch, prompt and output so far
        assert plan(out) == {"b": 9, "c": 4}
    assert b.output_token_ids == [TOK, TOK]  # the output survived the preemption
    drain(s)
    # Prefix-cache statistics count first admissions only, not b's resume.
    assert s.get_stats().prefix_cache_queries == 8 + 8 + 4
    assert s.get_stats().prefix_cache_hits == 0
    assert_sched_idle(s)


def test_preemption_takes_the_last_admitted_not_the_one_needing_a_block():
    s = make_sched(num_blocks=7)
    add(s, "r1", 8, max_tokens=5)
    r2 = add(s, "r2", 7, max_tokens=5)
    r3 = add(s, "r3", 7, max_tokens=5)
    assert plan(step(s)) == {"r1": 8, "r2": 7, "r3": 7}  # 6 blocks used
    assert plan(step(s)) == {"r1": 1, "r2": 1, "r3": 1}  # r1 takes the 7th block
    out = step(s)  # r2 needs a block for position 8: r3 is preempted, r2 goes on
    assert out.preempted_ids == ["r3"] and plan(out) == {"r1": 1, "r2": 1}
    assert r2.status == RequestStatus.RUNNING and r3.status == RequestStatus.PREEMPTED
    check_invariants(s)
    drain(s)
    assert r3.num_output_tokens == 5
    assert_sched_idle(s)


def test_a_request_alone_always_progresses_with_a_tiny_pool():
    # Capacity 4 blocks = 16 tokens = max_model_len: several requests that each fit alone.
    s = make_sched(num_blocks=4, budget=5)
    reqs = [add(s, f"r{i}", 5 + i, max_tokens=20) for i in range(4)]
    drain(s, max_steps=400)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 16 for r in reqs)
    assert s.get_stats().num_preemptions > 0
    assert_sched_idle(s)


# --------------------------------------------------------------------------------------------
# Finishing frees blocks in the same step; abort
# --------------------------------------------------------------------------------------------
def _tokens(seq: list[int]) -> Callable[[Request], int]:
    it = iter(seq)
    return lambda r: next(it)


def test_eos_finishes_and_frees_in_the_same_step():
    s = make_sched()
    r = add(s, "r", 6, max_tokens=10)
    step(s, _tokens([TOK]))
    assert s.kv_cache_manager.req_to_blocks["r"]
    step(s, _tokens([EOS]))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.status.finish_reason == "stop"
    assert r.stop_reason is None and r.output_token_ids == [TOK, EOS]
    assert_sched_idle(s)


def test_ignore_eos_and_min_tokens_keep_going():
    s = make_sched()
    r = add(s, "r", 3, max_tokens=3, ignore_eos=True)
    drain(s, token=lambda _: EOS)
    assert r.output_token_ids == [EOS] * 3 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    r = add(s, "m", 3, max_tokens=5, min_tokens=2)
    drain(s, token=lambda _: EOS)
    assert r.output_token_ids == [EOS] * 2 and r.status == RequestStatus.FINISHED_STOPPED
    assert_sched_idle(s)


def test_stop_token_ids_finish_with_stop_reason():
    s = make_sched()
    r = add(s, "r", 3, max_tokens=10, stop_token_ids=[42])
    drain(s, token=_tokens([TOK, 42]))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert_sched_idle(s)


def test_max_tokens_and_max_model_len_cap_the_length():
    s = make_sched(max_model_len=10)
    a = add(s, "a", 3, max_tokens=2)
    b = add(s, "b", 8, max_tokens=100)
    drain(s)
    assert a.num_output_tokens == 2 and a.status.finish_reason == "length"
    assert b.num_tokens == 10 and b.status.finish_reason == "length"
    assert_sched_idle(s)


def test_abort_waiting_running_midprefill_and_preempted_requests():
    s = make_sched(num_blocks=5, budget=6)
    a = add(s, "a", 8, max_tokens=10)
    b = add(s, "b", 12, max_tokens=10)
    w = add(s, "w", 3)
    step(s)  # a: 6 of 8 (mid-prefill)
    assert a.num_computed_tokens == 6
    done = s.finish_requests(["a", "w"], RequestStatus.FINISHED_ABORTED)
    assert done == [a, w] and a.status.finish_reason == "abort"
    assert "a" not in s.kv_cache_manager.req_to_blocks and list(s.waiting) == [b]
    step(s)
    step(s)  # b: 12 computed, sampled
    assert s.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED) == [b]
    assert s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    assert_sched_idle(s)
    # A preempted (waiting) request can be aborted too.
    add(s, "p1", 8, max_tokens=4)
    p2 = add(s, "p2", 8, max_tokens=4)
    s.step_budget.max_num_batched_tokens = 64  # a larger token budget from here on
    step(s)
    step(s)  # p2 is preempted here (5 blocks: p1 takes the last one)
    assert p2.status == RequestStatus.PREEMPTED
    s.finish_requests(["p2"], RequestStatus.FINISHED_ABORTED)
    drain(s)
    assert_sched_idle(s)


def test_abort_between_schedule_and_update():
    s = make_sched()
    a = add(s, "a", 5)
    add(s, "b", 5, max_tokens=2)
    out = s.schedule()
    s.fake_worker.apply(out)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    s.fake_worker.token_ids["b"].append(TOK)  # the worker sampled for both
    result = s.update_from_output(out, ModelRunnerOutput(sampled={"a": TOK, "b": TOK}))
    assert [o.request_id for o in result.outputs] == ["b"] and result.outputs[0].new_token_ids == [TOK]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert step(s).output.finished_req_ids == ["a"]  # the worker hears of it in the next message
    drain(s)
    assert_sched_idle(s)


def test_id_reused_between_schedule_and_update_does_not_inherit_the_old_token():
    s = make_sched()
    add(s, "a", 5)
    out = s.schedule()
    s.fake_worker.apply(out)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    fresh = add(s, "a", 7)  # the id is free again
    result = s.update_from_output(out, ModelRunnerOutput(sampled={"a": TOK}))
    assert result.outputs == [] and fresh.output_token_ids == [] and fresh.num_computed_tokens == 0
    drain(s)
    assert fresh.num_output_tokens == fresh.max_tokens
    assert_sched_idle(s)


def test_stats_count_prefix_cache_tokens_at_admission():
    s = make_sched()
    shared = list(range(100, 112))
    add(s, "a", 0, tokens=shared + [1, 3], max_tokens=1)
    drain(s)
    add(s, "b", 0, tokens=shared + [5], max_tokens=1)
    drain(s)
    st_ = s.get_stats()
    assert st_.prefix_cache_queries == 14 + 13
    assert st_.prefix_cache_hits == 12
    assert_sched_idle(s)


# --------------------------------------------------------------------------------------------
# Property-based: random interleavings against the design invariants
# --------------------------------------------------------------------------------------------
PREFIXES = [
    [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9],
    [3, 4, 5, 6, 9, 9, 9, 9, 3, 3, 3, 3, 4, 4, 4, 4],
    [8, 7, 6, 5, 4, 3, 8, 7, 6, 5, 4, 3, 8, 7, 6, 5],
]
ALPHABET = [3, 4, 5, 6, 7, 8, 9]  # small: generated blocks sometimes equal other prompts' blocks
STOP = 1


class Harness:
    """Scheduler + KVCacheManager + a fake model. The fake forward writes (salt, token) into a
    simulated KV slot array for every scheduled token; every scheduled request then checks that
    each slot it reads holds its own (salt, token), which catches a wrong prefix hit, a stale
    hash, a block reused while still referenced, or a block shared across cache salts."""

    def __init__(self, num_blocks, budget, max_num_seqs, threshold, chunked, caching, max_model_len, policy="fcfs"):
        max_model_len = min(max_model_len, num_blocks * B)  # every request fits alone
        if not chunked:
            budget = max(budget, max_model_len)  # the engine enforces this
        self.sched = make_sched(num_blocks, budget, max_num_seqs, max_model_len, chunked, threshold, caching, policy=policy)
        self.slots: dict[int, tuple] = {}
        self.n = 0
        self.all_reqs: list[Request] = []

    def add(self, prefix, prefix_len, suffix, max_tokens, salt, stop, ignore_eos, priority=0) -> None:
        tokens = (PREFIXES[prefix][:prefix_len] + suffix)[: self.sched.config.max_model_len - 1] or [3]
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=[STOP] if stop else None
        )
        req = Request(f"q{self.n}", tokens, params, eos_token_ids={EOS}, cache_salt=salt, priority=priority)
        self.n += 1
        self.sched.add_request(req)
        self.all_reqs.append(req)

    def _execute(self, out: StepResult) -> None:
        salt = {r.request_id: r.cache_salt for r in self.all_reqs}
        for sr in out.scheduled:
            bt = sr.block_ids
            for p in range(sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens):
                self.slots[bt[p // B] * B + p % B] = (salt[sr.request_id], sr.token_ids[p])
        for sr in out.scheduled:
            bt = sr.block_ids
            assert len(bt) * B >= sr.num_computed_tokens + sr.num_new_tokens
            for p in range(sr.num_computed_tokens + sr.num_new_tokens):
                assert self.slots.get(bt[p // B] * B + p % B) == (salt[sr.request_id], sr.token_ids[p]), (sr, p)

    @staticmethod
    def _sampled(out: StepResult, rnd: random.Random) -> ModelRunnerOutput:
        def tok() -> int:
            x = rnd.random()
            return EOS if x < 0.03 else STOP if x < 0.05 else rnd.choice(ALPHABET)

        return ModelRunnerOutput(sampled={sr.request_id: tok() for sr in out.scheduled if sr.samples})

    def step(self, seed: int, abort_index: Optional[int] = None) -> None:
        s = self.sched
        before = {r.request_id: r.num_computed_tokens for r in s.running}
        had_work = s.has_unfinished_requests()
        so = s.schedule()
        out = StepResult(so, s.fake_worker.apply(so))
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        assert len({sr.request_id for sr in out.scheduled}) == len(out.scheduled)
        if had_work:
            assert out.scheduled, "no progress"  # the oldest request always runs
        for sr in out.scheduled:
            assert sr.num_new_tokens > 0
            assert sr.num_computed_tokens == before.get(sr.request_id, sr.num_computed_tokens)
        if out.preempted_ids:  # nothing admitted in a step that preempted
            assert all(sr.request_id in before for sr in out.scheduled)
            event("preemption")
        if any(sr.request_id not in before and sr.num_computed_tokens > 0 for sr in out.scheduled):
            event("prefix hit at admission")
        if abort_index is not None and out.scheduled:  # abort between schedule and update
            victim = out.scheduled[abort_index % len(out.scheduled)].request_id
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        self._execute(out)  # the batch runs as scheduled (the runner does not look at status)
        runner_out = self._sampled(out, random.Random(seed))
        for rid, tok in runner_out.sampled.items():
            s.fake_worker.token_ids[rid].append(tok)
        s.update_from_output(so, runner_out)
        check_invariants(s)

    def finish(self, index: int, status: RequestStatus) -> None:
        """Abort, or finish as a stop string would (engine side), any live request."""
        live = list(self.sched.requests.values())
        if live:
            req = live[index % len(live)]
            assert self.sched.finish_requests([req.request_id], status) == [req]
        check_invariants(self.sched)

    def drain(self) -> None:
        """Never deadlocks: each step the first running request (the oldest; under the priority
        policy the smallest key) advances and is never preempted (it fits alone), so every request finishes within max_model_len steps of becoming the
        oldest. Afterwards: nothing leaked."""
        s = self.sched
        bound = (len(s.requests) + 1) * s.config.max_model_len + 5
        for i in range(bound):
            if not s.has_unfinished_requests():
                break
            self.step(seed=i)
        assert not s.has_unfinished_requests(), f"deadlock: {s.requests}"
        assert_sched_idle(s)
        for req in self.all_reqs:
            assert req.is_finished()
            assert req.num_tokens <= s.config.max_model_len
            assert req.num_output_tokens <= req.max_tokens


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.one_of(st.integers(12, 20), st.integers(12, 40)),
    budget=st.one_of(st.integers(16, 40), st.integers(1, 40)),
    max_num_seqs=st.integers(1, 8),
    threshold=st.sampled_from([0, 0, 3, 8]),
    chunked=st.sampled_from([True, True, True, False]),
    caching=st.sampled_from([True, True, True, False]),
    max_model_len=st.integers(12, 48),
    p_add=st.floats(0.1, 0.5),
    num_ops=st.integers(40, 150),
    seed=st.integers(0, 2**32 - 1),
    policy=st.sampled_from(["fcfs", "fcfs", "priority"]),
)
def test_random_interleavings_keep_the_invariants(
    num_blocks, budget, max_num_seqs, threshold, chunked, caching, max_model_len, p_add, num_ops, seed, policy
):
    """Hypothesis draws the configuration and a seed; the seed drives the op sequence (random
    ops explore tight pools, shared prefixes and preemption far better than drawn op lists)."""
    h = Harness(num_blocks, budget, max_num_seqs, threshold, chunked, caching, max_model_len, policy)
    rnd = random.Random(seed)
    for _ in range(num_ops):
        x = rnd.random()
        if x < p_add:
            h.add(
                rnd.randrange(len(PREFIXES)),
                rnd.choice([rnd.randint(0, 16), 16, 12, 8]),  # mostly whole shared blocks
                [rnd.choice(ALPHABET) for _ in range(rnd.randint(0, 8))],
                rnd.randint(1, 30),
                rnd.choice([None, None, None, "s1", "s2"]),
                rnd.random() < 0.3,
                rnd.random() < 0.3,
                rnd.randint(-2, 2) if policy == "priority" else 0,
            )
        elif x < p_add + 0.05:
            h.finish(rnd.randrange(10**6), rnd.choice([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]))
        elif x < p_add + 0.08:
            h.step(rnd.randrange(2**32), abort_index=rnd.randrange(10**6))
        else:
            h.step(rnd.randrange(2**32))
    h.drain()
