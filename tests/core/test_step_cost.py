"""Bounded step time (``EngineConfig.max_step_ms``, issue 15): the torch-free step-cost model,
the per-step time budget, and the scheduler sizing prefill chunks from it with a fake clock (the
fake worker of core_utils; the "measured" duration of each step is a function of what it ran).
No model, no timing: every duration here is made up and every assertion is on values."""
from __future__ import annotations

import random

import pytest

from core_utils import B, Scheduled, check_invariants, make_request, make_scheduler, plan, step
from pagedserve.config import EngineConfig
from pagedserve.core.sched.step_cost import COLD_START_TOKENS, PLAN_FRACTION, StepCostModel, StepTimeBudget, attention_pairs, step_target_ms

_uid = iter(range(10**9))


def linear_cost(fixed: float, tok: float, pair: float = 0.0):
    """A fake clock: the step costs fixed + tok * tokens + pair * pairs / 1000 (ms)."""
    def cost(scheduled: list[Scheduled]) -> float:
        tokens = sum(s.num_new_tokens for s in scheduled)
        pairs = sum(attention_pairs(s.num_new_tokens, s.num_computed_tokens) for s in scheduled)
        return fixed + tok * tokens + pair * pairs / 1000.0
    return cost


def add(sched, rid: str, prompt_len: int, max_tokens: int = 8, **params):
    base = 1000 + 10_000 * next(_uid)
    req = make_request(rid, [base + i for i in range(prompt_len)], max_tokens=max_tokens, **params)
    sched.add_request(req)
    return req


# -- the cost model ------------------------------------------------------------------------
def test_attention_pairs():
    assert attention_pairs(1, 0) == 1 and attention_pairs(1, 9) == 10  # a decode at position 9
    assert attention_pairs(4, 0) == 1 + 2 + 3 + 4
    assert attention_pairs(3, 10) == 11 + 12 + 13


def test_fits_a_synthetic_linear_cost_exactly():
    m = StepCostModel()
    assert m.coefficients is None and m.predict(10, 10) is None
    rng = random.Random(0)
    for _ in range(200):
        t = rng.randint(1, 2048)
        p = attention_pairs(t, rng.randint(0, 4000))
        m.observe(t, p, 4.0 + 0.3 * t + 0.02 * p / 1000)
    fixed, tok, pair = m.coefficients
    assert fixed == pytest.approx(4.0, rel=1e-4) and tok == pytest.approx(0.3, rel=1e-5) and pair == pytest.approx(0.02, rel=1e-4)
    assert m.predict(100, 5000) == pytest.approx(4.0 + 30 + 0.1, rel=1e-5)


def test_coefficients_stay_non_negative():
    m = StepCostModel()
    for t in (1, 2, 4, 8, 16, 32):  # gets *faster* with more tokens: a negative slope, clamped
        m.observe(t, t, 10.0 - 0.1 * t)
    assert all(c >= 0 for c in m.coefficients)
    assert m.predict(64, 64) > 0


def test_invalid_measurements_are_ignored():
    m = StepCostModel()
    for args in ((0, 0, 5.0), (4, 4, float("nan")), (4, 4, float("inf")), (4, 4, -1.0)):
        m.observe(*args)
    assert m.num_observed == 0 and m.coefficients is None


def test_decode_steps_do_not_push_out_what_prefills_taught():
    m = StepCostModel(per_bucket=8)
    cost = lambda t, p: 5.0 + 0.25 * t + 0.01 * p / 1000
    for t, c in ((512, 0), (512, 1024), (1024, 0), (256, 2048), (700, 3000)):
        m.observe(t, attention_pairs(t, c), cost(t, attention_pairs(t, c)))
    for i in range(5000):  # a long run of decode-only steps of 16-31 sequences
        t = 16 + i % 16
        m.observe(t, t * (100 + i // 10), cost(t, t * (100 + i // 10)))
    assert m.predict(1024, attention_pairs(1024, 0)) == pytest.approx(cost(1024, attention_pairs(1024, 0)), rel=1e-4)
    assert sum(len(b) for b in m.buckets.values()) <= 8 * len(m.buckets)


def test_follows_a_machine_that_slows_down():
    m = StepCostModel(per_bucket=4)
    for scale in (1.0, 2.0):
        for _ in range(4):
            for t in (1, 30, 300, 1000):
                m.observe(t, t, scale * (3.0 + 0.5 * t))
    assert m.predict(500, 500) == pytest.approx(2.0 * (3.0 + 250), rel=1e-4)


def test_chunk_that_fits_is_the_largest_under_the_limit():
    m = StepCostModel()
    rng = random.Random(1)
    for _ in range(50):
        t = rng.randint(1, 1500)
        p = attention_pairs(t, rng.randint(0, 3000))
        m.observe(t, p, 2.0 + 0.2 * t + 0.05 * p / 1000)
    assert m.chunk_that_fits(100.0, 0, 0, 0) is not None
    for base_t, base_p, ctx in ((0, 0, 0), (16, 16 * 500, 0), (32, 32 * 900, 3000), (8, 8000, 6000)):
        n = m.chunk_that_fits(100.0, base_t, base_p, ctx)
        assert n > 0
        assert m.predict(base_t + n, base_p + attention_pairs(n, ctx)) <= 100.0 + 0.01
        assert m.predict(base_t + n + 1, base_p + attention_pairs(n + 1, ctx)) > 100.0
    assert m.chunk_that_fits(1.0, 32, 0, 0) == 0  # the decodes alone are over the limit
    assert StepCostModel().chunk_that_fits(100.0, 0, 0, 0) is None  # nothing measured yet


def test_the_fit_is_trusted_to_twice_the_largest_step_measured():
    m = StepCostModel()
    assert m.max_step_tokens() == COLD_START_TOKENS
    m.observe(20, 20, 10.0)
    assert m.max_step_tokens() == COLD_START_TOKENS
    m.observe(300, 300, 60.0)
    assert m.max_step_tokens() == 600


# -- one step's time budget --------------------------------------------------------------
def _model(fixed: float, tok: float, n: int = 600) -> StepCostModel:
    m = StepCostModel()
    for t in (1, 16, 100, 300, n):
        m.observe(t, 0, fixed + tok * t)  # pairs 0 throughout: the pair term stays unknown (0)
    return m


def test_budget_reserves_the_decodes_and_respects_the_target():
    m = _model(2.0, 0.5)
    budget = StepTimeBudget(m, 50.0, decode_tokens=16, decode_pairs=0, floor_tokens=16, block_size=B)
    n = budget.prefill_chunk(1000, 0)
    assert n == 80  # 2 + 0.5 * (16 + 80) = 50 ms; (50 - 2) / 0.5 - 16 = 80 is on a block boundary
    budget.add(n, 0)
    assert budget.prefill_chunk(1000, 0) == 0  # nothing left for a second chunk


def test_budget_floor_guarantees_progress_and_chunks_end_on_blocks():
    m = _model(2.0, 0.5)
    # 64 decodes alone are 34 ms, over a 10 ms target: the first chunk still gets the floor.
    budget = StepTimeBudget(m, 10.0, decode_tokens=64, decode_pairs=0, floor_tokens=16, block_size=B)
    assert budget.prefill_chunk(1000, 0) == 16
    assert budget.prefill_chunk(5, 0) == 5  # or all that is left of the prompt
    budget.add(16, 0)
    assert budget.prefill_chunk(1000, 0) == 0  # later chunks get only what fits: nothing
    # 2 + 0.5 * (1 + n) <= 20 -> n = 35, cut back to end on a block (context 3 + 33 = 36).
    budget = StepTimeBudget(m, 20.0, decode_tokens=1, decode_pairs=0, floor_tokens=16, block_size=B)
    assert budget.prefill_chunk(1000, 3) == 33
    # The token budget still wins when it is the smaller.
    assert budget.prefill_chunk(7, 3) == 7


def test_budget_before_any_measurement_is_the_cold_start_size():
    budget = StepTimeBudget(StepCostModel(), 50.0, decode_tokens=10, decode_pairs=0, floor_tokens=16, block_size=B)
    assert budget.prefill_chunk(1000, 0) == COLD_START_TOKENS - 10


# -- the scheduler with a fake clock -------------------------------------------------------
def test_config_field_and_flag():
    from pagedserve.config import SERVING_MAX_STEP_MS

    assert EngineConfig().max_step_ms is None  # offline: off (throughput is the point)
    assert EngineConfig().with_serving_defaults().max_step_ms == SERVING_MAX_STEP_MS == 200.0  # the server: on
    assert EngineConfig(max_step_ms=0).with_serving_defaults().max_step_ms == 0.0  # an explicit 0 stays off
    assert EngineConfig(max_step_ms=75).with_serving_defaults().max_step_ms == 75.0
    for bad in (-1.0, float("nan"), float("inf"), "100", True):
        with pytest.raises(ValueError, match="max_step_ms"):
            EngineConfig(max_step_ms=bad)
    import argparse
    ap = argparse.ArgumentParser()
    EngineConfig.add_cli_args(ap)
    assert EngineConfig.from_cli_args(ap.parse_args(["--max-step-ms", "75"])).max_step_ms == 75.0
    assert EngineConfig.from_cli_args(ap.parse_args(["--max-step-ms", "0"])).max_step_ms == 0.0
    assert EngineConfig().max_step_decode_multiple == 4.0
    assert EngineConfig.from_cli_args(ap.parse_args(["--max-step-decode-multiple", "0"])).max_step_decode_multiple == 0.0
    for bad in (-1.0, 0.5, float("nan"), float("inf"), "4", True):
        with pytest.raises(ValueError, match="max_step_decode_multiple"):
            EngineConfig(max_step_decode_multiple=bad)


def test_a_prefill_alone_is_cut_to_the_target_after_a_cold_start():
    s = make_scheduler(num_blocks=512, budget=2048, max_step_ms=50.0)
    add(s, "long", 1000, max_tokens=1)
    cost = linear_cost(2.0, 0.5)
    plans = []
    while s.has_unfinished_requests():
        r = step(s, step_ms=cost)
        plans.append(plan(r)["long"])
    # Cold start: 256 tokens; then at most twice the largest step measured, and the fit (exact
    # after three measurements), planned at 90 % of the target: (45 - 2) / 0.5 = 86 -> 84 tokens
    # to end on a block.
    assert PLAN_FRACTION == 0.9
    assert plans[0] == COLD_START_TOKENS
    assert sum(plans) == 1000 and len(plans) > 6
    assert all(p == 84 for p in plans[3:-1]) and plans[-1] <= 84
    assert all(cost([Scheduled("long", 0, p, [], [], False)]) <= 45.0 for p in plans[3:])


def _eight_decoding(**kw):
    """A scheduler (``make_scheduler(num_blocks=512, budget=2048, max_num_seqs=16, **kw)``) with 8
    requests decoding under the clock fixed 2 ms + 0.5 ms per token, measured for 5 steps."""
    s = make_scheduler(num_blocks=512, budget=2048, max_num_seqs=16, **kw)
    cost = linear_cost(2.0, 0.5)
    for i in range(8):
        add(s, f"d{i}", 6, max_tokens=200)
    for _ in range(5):
        step(s, step_ms=cost)
    return s, cost


def test_decodes_run_every_step_and_the_prefill_gets_the_rest():
    s, cost = _eight_decoding(max_step_ms=30.0)  # 8 decoders, measured
    add(s, "long", 400, max_tokens=1)
    chunks = []
    while "long" in s.requests:
        r = step(s, step_ms=cost)
        p = plan(r)
        assert all(p.get(f"d{i}") == 1 for i in range(8))  # no decoder skips a step
        chunks.append(p.get("long", 0))
        check_invariants(s)
    # 8 decodes take 2 + 4 = 6 ms of the 27 planned (90 % of 30): 42 -> 40 tokens (a block
    # boundary) of prefill per step (the decode steps and the decoders' own prefill already pin
    # the fit: fixed 2 ms, 0.5 ms per token, 0 per pair).
    assert chunks == [40] * 10


def test_a_target_below_the_decode_cost_still_advances_the_prefill_by_the_floor():
    s, cost = _eight_decoding(max_step_ms=5.0)  # 8 decoders, measured
    add(s, "long", 100, max_tokens=1)
    add(s, "next", 40, max_tokens=1)
    chunks = []
    while "long" in s.requests:
        p = plan(step(s, step_ms=cost))
        assert all(p.get(f"d{i}") == 1 for i in range(8))
        chunks.append(p["long"])
        if len(chunks) > 1:
            assert "next" not in p  # only the step's first prefill chunk gets the floor
    assert chunks[1:-1] == [16] * (len(chunks) - 2)  # 16 = max(16, block_size) tokens per step


def test_the_token_budget_still_caps_the_step():
    s = make_scheduler(num_blocks=512, budget=20, max_num_seqs=16, max_step_ms=1000.0)
    add(s, "long", 100, max_tokens=1)
    assert [plan(step(s, step_ms=linear_cost(2.0, 0.5)))["long"] for _ in range(5)] == [20] * 5


def test_bound_off_or_unchunked_leaves_the_plain_rule():
    for kw in ({"max_step_ms": 0.0}, {"max_step_ms": 50.0, "chunked": False}):
        s = make_scheduler(num_blocks=256, budget=1024, max_model_len=1024, **kw)
        assert s.step_cost is None
        add(s, "long", 600, max_tokens=1)
        assert plan(step(s, step_ms=linear_cost(2.0, 0.5))) == {"long": 600}


def test_random_arrivals_with_a_noisy_clock_keep_the_invariants():
    rng = random.Random(7)
    s = make_scheduler(num_blocks=96, budget=256, max_num_seqs=6, max_step_ms=40.0)
    base = linear_cost(3.0, 0.2, 0.05)
    noisy = lambda sc: base(sc) * rng.uniform(0.8, 1.5)
    n = 0
    for _ in range(600):
        if rng.random() < 0.15:
            add(s, f"r{n}", rng.randint(1, 150), max_tokens=rng.randint(1, 20))
            n += 1
        if s.has_unfinished_requests():
            running_decodes = {r.request_id for r in s.running if r.num_tokens - r.num_computed_tokens == 1}
            r = step(s, step_ms=noisy)
            p = plan(r)
            if not r.preempted_ids:
                assert running_decodes <= set(p)  # decodes are never held back for time
            assert sum(p.values()) <= 256
            check_invariants(s)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        step(s, step_ms=noisy)
    assert not s.has_unfinished_requests() and n > 50


# -- a target relative to the decodes (max_step_decode_multiple) ----------------------------
def test_step_target_is_the_larger_of_the_bound_and_the_decode_multiple():
    m = _model(2.0, 0.5)
    assert step_target_ms(StepCostModel(), 200.0, 4.0, 16, 0) == 200.0  # nothing measured yet
    assert step_target_ms(m, 200.0, 0.0, 300, 0) == 200.0  # multiple off: the fixed target
    assert step_target_ms(m, 200.0, 4.0, 16, 0) == 200.0  # 4 x (2 + 8) = 40 ms < 200
    assert step_target_ms(m, 200.0, 4.0, 300, 0) == pytest.approx(4 * (2 + 150))  # decodes alone 152 ms
    assert step_target_ms(m, 5.0, 4.0, 0, 0) == pytest.approx(4 * 2.5)  # no decodes: a one-token step


def test_slow_decodes_leave_prefill_the_multiple_of_their_own_time():
    # 8 decodes cost 2 + 4 = 6 ms against a 5 ms bound: with a fixed target the prefill crawls by
    # the 16-token floor (test above); with multiple 4 the step may last 24 ms, planned at 90 %:
    # 2 + 0.5 * (8 + n) <= 21.6 -> n = 31, cut to 28 to end on a block (B = 4).
    s, cost = _eight_decoding(max_step_ms=5.0, max_step_decode_multiple=4.0)  # 8 decoders, measured
    add(s, "long", 400, max_tokens=1)
    chunks, targets = [], []
    while "long" in s.requests:
        p = plan(step(s, step_ms=cost))
        assert all(p.get(f"d{i}") == 1 for i in range(8))
        chunks.append(p["long"])
        targets.append(s.step_budget.last_target_ms)
        assert cost([Scheduled("x", 0, 8 + p["long"], [], [], False)]) <= 24.0  # every step within its target
    assert targets[0] == pytest.approx(24.0)
    assert chunks == [28] * 14 + [8]


def test_the_multiple_waits_for_a_fit_it_can_trust():
    # One 256-token step of 1,500 ms: the fit's fixed cost is a guess (a third of it or so), and
    # 4x a one-token step from it would be ~2 s. Until 3 measurements in 2 size ranges, and one
    # within 16x the decodes' size, the target is max_step_ms.
    m = StepCostModel()
    m.observe(256, 0, 1500.0)
    assert m.predict(1, 0) > 200 / 4  # the guess that would have inflated the target
    assert step_target_ms(m, 200.0, 4.0, 0, 0) == 200.0
    m.observe(256, 0, 1500.0)
    m.observe(300, 0, 1700.0)
    assert step_target_ms(m, 200.0, 4.0, 0, 0) == 200.0  # one size range: still a guess
    m.observe(40, 0, 300.0)
    assert step_target_ms(m, 200.0, 4.0, 0, 0) == 200.0  # 40 tokens: over 16x a one-token step
    assert step_target_ms(m, 200.0, 4.0, 8, 0) == pytest.approx(4 * m.predict(8, 0))  # 8 decodes: within 16x
    m.observe(10, 0, 110.0)
    assert step_target_ms(m, 200.0, 4.0, 0, 0) == pytest.approx(4 * m.predict(1, 0))


def test_the_decodes_attention_pairs_count_in_their_time_alone():
    m = StepCostModel()
    for t, p in ((1, 100), (8, 4000), (16, 2000), (64, 30000), (200, 20000), (300, 90000)):
        m.observe(t, p, 2.0 + 0.5 * t + 0.2 * p / 1000)
    running = [type("R", (), {"num_tokens": c + 1, "num_computed_tokens": c})() for c in (999, 1999, 2999)]
    budget = StepTimeBudget.for_step(m, 1.0, running, True, B, decode_multiple=4.0)
    pairs = 1000 + 2000 + 3000  # each decode attends to its context and itself
    assert budget.step_target_ms == pytest.approx(4 * (2.0 + 0.5 * 3 + 0.2 * pairs / 1000), rel=1e-6)
    assert budget.num_pairs == pairs


def test_target_ms_only_for_steps_that_prefill():
    s = make_scheduler(num_blocks=512, budget=2048, max_num_seqs=2, max_step_ms=5.0, max_step_decode_multiple=4.0)
    cost = linear_cost(2.0, 0.5)
    add(s, "a", 6, max_tokens=50)
    add(s, "b", 6, max_tokens=50)
    assert plan(step(s, step_ms=cost)) == {"a": 6, "b": 6} and s.step_budget.last_target_ms == 5.0  # cold: max_step_ms
    add(s, "c", 6, max_tokens=1)  # waits: max_num_seqs is full
    for _ in range(4):
        assert plan(step(s, step_ms=cost)) == {"a": 1, "b": 1}
        assert s.step_budget.last_target_ms is None  # nothing prefilled
