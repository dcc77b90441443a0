"""The ``priority`` scheduling policy (vLLM's ``--scheduling-policy priority``): waiting requests
run by ``(priority, arrival_time)``, smaller first; when blocks run out the running request with
the largest key is preempted. Under ``fcfs`` (the default) a non-zero priority is refused."""
from __future__ import annotations

import numpy as np
import pytest

from core_utils import assert_scheduler_idle, check_invariants, drain, make_request, make_scheduler, plan, step
from pagedserve.core.request import RequestStatus
from pagedserve.core.sched.request_queue import FCFSQueue, PriorityQueue

_base = iter(range(10**6))


def add(s, rid, prompt_len, priority=0, arrival=None, max_tokens=4):
    base = 1000 + 100 * next(_base)
    req = make_request(rid, [base + i for i in range(prompt_len)], max_tokens=max_tokens, priority=priority, arrival_time=arrival)
    s.add_request(req)
    return req


@pytest.mark.parametrize("policy, order", [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])])
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy, order):
    s = make_scheduler(max_num_seqs=1, policy=policy)
    add(s, "a", 4, priority=1 if policy == "priority" else 0, arrival=1.0, max_tokens=1)
    add(s, "b", 4, priority=0, arrival=2.0, max_tokens=1)
    add(s, "c", 4, priority=0, arrival=3.0, max_tokens=1)
    assert [r.request_id for r in s.waiting] == order
    admitted = [next(iter(p)) for p in drain(s)]
    assert admitted == order
    assert_scheduler_idle(s)


def test_equal_keys_keep_insertion_order_and_a_negative_priority_goes_first():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for rid in ("x", "y", "z"):
        add(s, rid, 4, priority=0, arrival=5.0, max_tokens=1)
    add(s, "urgent", 4, priority=-3, arrival=9.0, max_tokens=1)
    assert [next(iter(p)) for p in drain(s)] == ["urgent", "x", "y", "z"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_preemption_takes_the_largest_key_not_the_latest_admitted(policy):
    s = make_scheduler(num_blocks=5, policy=policy)
    low = add(s, "low", 8, priority=5 if policy == "priority" else 0, arrival=1.0, max_tokens=3)
    assert plan(step(s)) == {"low": 8}
    high = add(s, "high", 8, priority=0, arrival=2.0, max_tokens=3)
    assert plan(step(s)) == {"low": 1, "high": 8}  # 4 blocks + low's third: all 5 used
    out = step(s)  # high needs a block for position 9 ... one of the two must go
    victim = "low" if policy == "priority" else "high"
    assert out.preempted_ids == [victim]
    assert (low if victim == "low" else high).status == RequestStatus.PREEMPTED
    check_invariants(s)
    drain(s)
    assert_scheduler_idle(s)


def test_a_preempted_request_waits_behind_a_smaller_priority():
    s = make_scheduler(num_blocks=5, policy="priority")
    add(s, "low", 8, priority=5, arrival=1.0, max_tokens=3)
    step(s)
    add(s, "high", 8, priority=0, arrival=2.0, max_tokens=3)
    step(s)
    add(s, "mid", 4, priority=2, arrival=3.0, max_tokens=1)
    assert step(s).preempted_ids == ["low"]
    assert [r.request_id for r in s.waiting] == ["mid", "low"]  # by key, not preempted-first
    drain(s)
    assert_scheduler_idle(s)


@pytest.mark.parametrize("queue_cls", [FCFSQueue, PriorityQueue])
def test_queue_remove_and_errors(queue_cls):
    q = queue_cls()
    reqs = [make_request(f"r{i}", [1, 2], priority=-i, arrival_time=float(i)) for i in range(5)]
    for r in reqs:
        q.add(r)
    q.remove(reqs[2])
    with pytest.raises(ValueError):
        q.remove(reqs[2])
    want = ["r0", "r1", "r3", "r4"] if queue_cls is FCFSQueue else ["r4", "r3", "r1", "r0"]
    assert [r.request_id for r in q] == want and q.peek().request_id == want[0] and len(q) == 4
    assert [q.pop().request_id for _ in range(4)] == want
    with pytest.raises(IndexError):
        q.pop()
    q.add(reqs[1])  # popped, then queued again (a preempted request), then aborted
    q.add(reqs[3])
    q.remove(reqs[1])
    assert [r.request_id for r in q] == ["r3"] and q.peek() is reqs[3] and len(q) == 1


def test_priority_queue_mass_abort_keeps_the_order():
    q = PriorityQueue()
    reqs = [make_request(f"r{i}", [1], priority=i % 7, arrival_time=float(i)) for i in range(3000)]
    for r in reqs:
        q.add(r)
    gone = set(range(0, 3000, 3))
    for i in sorted(gone, reverse=True):
        q.remove(reqs[i])
    left = sorted((r for i, r in enumerate(reqs) if i not in gone), key=lambda r: (r.priority, r.arrival_time))
    assert len(q) == len(left) and [r.request_id for r in q] == [r.request_id for r in left]
    assert len(q._heap) <= 2 * len(q) + 64  # dead entries do not pile up
    assert [q.pop() for _ in range(len(left))] == left and len(q) == 0


def test_offline_priority_orders_admission_and_keeps_greedy_tokens(tiny_model_factory):
    """LLM(scheduling_policy="priority"): generate(priority=...) admits by priority (the step
    trace's admissions), and a pool small enough to preempt gives the fcfs run's greedy tokens."""
    from conftest import assert_engine_idle
    from pagedserve import LLM, SamplingParams

    model = tiny_model_factory("llama")
    prompts = [[5 + i, 17, 23, 42 + i, 9] * 6 for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fcfs = LLM(model, dtype="float32", num_kv_blocks=64, max_model_len=128, num_threads=1)
    want = [o.outputs[0].token_ids for o in fcfs.generate(prompts, greedy, use_tqdm=False)]
    with pytest.raises(ValueError, match="priority"):
        fcfs.generate(prompts, greedy, use_tqdm=False, priority=[0, 1, 0, 0])
    assert_engine_idle(fcfs)

    llm = LLM(model, dtype="float32", num_kv_blocks=64, max_model_len=128, num_threads=1, scheduling_policy="priority",
              max_num_seqs=1, trace_buffer_steps=10_000)
    outs = llm.generate(prompts, greedy, use_tqdm=False, priority=np.array([3, 1, 2, 0]))  # NumPy integers too
    assert [o.outputs[0].token_ids for o in outs] == want  # results stay in input order
    admitted = [e["request_id"] for r in llm.get_step_trace() for e in r["scheduled"] if e["admitted"]]
    assert [int(rid) for rid in admitted] == [3, 1, 2, 0]  # ids count up in input order
    with pytest.raises(ValueError, match="one value per prompt"):
        llm.generate(prompts, greedy, use_tqdm=False, priority=[0])
    assert_engine_idle(llm)

    # 6 blocks of 16 tokens for 4 sequences of up to 54: preemption, in priority order.
    small = LLM(model, dtype="float32", num_kv_blocks=6, max_model_len=64, num_threads=1, scheduling_policy="priority")
    outs = small.generate(prompts, greedy, use_tqdm=False, priority=[0, 2, 1, 3])
    assert [o.outputs[0].token_ids for o in outs] == want
    assert small.stats().num_preemptions > 0
    assert_engine_idle(small)
