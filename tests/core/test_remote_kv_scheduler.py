"""The scheduler's side of prefill/decode disaggregation, with no model and no sockets: the real
NetworkConnector scheduler half, and a test playing the worker half (reporting loads and holds
as finished or failed)."""
from __future__ import annotations

from pagedserve.config import EngineConfig, KVTransferConfig
from pagedserve.core.outputs import KVConnectorOutput, ModelRunnerOutput
from pagedserve.core.request import RequestStatus
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.distributed.kv_transfer.params import producer_params
from pagedserve.distributed.kv_transfer.scheduler_side import NetworkConnectorScheduler

from core_utils import B, FakeWorker, assert_scheduler_idle, check_invariants, make_kv_manager, make_request


def make(role: str, num_blocks: int = 64, policy: str = "recompute", budget: int = 64) -> Scheduler:
    cfg = EngineConfig(block_size=B, max_num_batched_tokens=budget, max_num_seqs=8, max_step_ms=0.0,
                       kv_transfer_config={"kv_role": role, "kv_load_failure_policy": policy}).resolved(num_blocks * B)
    kv = make_kv_manager(num_blocks, True, "unit")
    sched = Scheduler(cfg, kv, None, NetworkConnectorScheduler(cfg.kv_transfer, B, kv.block_hashes, num_blocks))
    sched.fake_worker = FakeWorker()
    return sched


def step(sched: Scheduler, kv_out: KVConnectorOutput | None = None):
    so = sched.schedule()
    scheduled = sched.fake_worker.apply(so)
    out = sched.fake_worker.sampled(scheduled, lambda rid: 7)
    out.kv_connector_output = kv_out
    return so, sched.update_from_output(so, out)


def remote(num_blocks: int, tid: str = "t0") -> dict:
    return producer_params("prod", "127.0.0.1", 5555, tid, list(range(100, 100 + num_blocks)), num_blocks * B)


def loads(so) -> list:
    return so.kv_connector_metadata.loads if so.kv_connector_metadata else []


def test_load_then_compute_only_the_rest():
    s = make("kv_consumer")
    req = make_request("a", list(range(10, 31)), max_tokens=3)  # 21 tokens: 5 full blocks
    req.kv_transfer_params = remote(5)
    s.add_request(req)
    so, _ = step(s)
    (load,) = loads(so)
    assert load.block_indices == [0, 1, 2, 3, 4] and load.num_tokens == 20 and not so.num_scheduled_tokens
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and s.get_stats().num_waiting == 1
    step(s, KVConnectorOutput(finished_recving=["a"], received_tokens=20))
    so, _ = step(s, KVConnectorOutput(finished_recving=["a"]))  # a repeated report changes nothing
    assert so.num_scheduled_tokens == {"a": 1}  # only the last token: the 20 loaded are computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    while s.has_unfinished_requests():
        step(s)
    assert s.get_stats().kv_transfer_received_tokens == 20
    assert_scheduler_idle(s)


def test_failed_load_recomputes_and_siblings_wait_for_one_load():
    s = make("kv_consumer")
    kvp = remote(4)
    for rid in ("a#0", "a#1"):
        r = make_request(rid, list(range(10, 27)), max_tokens=2)
        r.kv_transfer_params = kvp
        s.add_request(r)
    so, _ = step(s)
    assert [x.req_id for x in loads(so)] == ["a#0"]  # the sibling waits on the same load
    assert set(s.remote_kv.waiting_for_remote) == {"a#0", "a#1"}
    step(s, KVConnectorOutput(failed_recving={"a#0": "timeout"}, failures={"timeout": 1}))
    so, _ = step(s)
    # a#0 computes its prompt; its sibling hits the blocks a#0 fills in this same step.
    assert so.num_scheduled_tokens == {"a#0": 17, "a#1": 1}
    assert not loads(so)  # never a second attempt
    while s.has_unfinished_requests():
        step(s)
        check_invariants(s)
    assert s.get_stats().kv_transfer_failures == {"timeout": 1}
    assert_scheduler_idle(s)


def test_fail_policy_reports_an_error():
    s = make("kv_consumer", policy="fail")
    r = make_request("a", list(range(10, 27)))
    r.kv_transfer_params = remote(4)
    s.add_request(r)
    step(s)
    _, outs = step(s, KVConnectorOutput(failed_recving={"a": "digest"}))
    (o,) = outs.outputs
    assert o.finish_reason == "error" and "digest" in o.error
    assert_scheduler_idle(s)


def test_loaded_but_waiting_requests_give_blocks_back_when_nothing_can_run():
    s = make("kv_consumer", num_blocks=16, budget=64)
    a, b = make_request("a", list(range(10, 31)), max_tokens=2), make_request("b", list(range(40, 61)), max_tokens=2)
    a.kv_transfer_params, b.kv_transfer_params = remote(5, "ta"), remote(5, "tb")
    s.add_request(a)
    s.add_request(b)
    step(s)  # both hold 5 blocks, 6 free
    step(s, KVConnectorOutput(finished_recving=["a", "b"]))  # back in the queue, holding their blocks
    big = make_request("c", list(range(70, 95)), max_tokens=2)  # 25 tokens: 7 blocks
    s.waiting.prepend(big)  # ahead of both (as a request resumed after preemption would be)
    s.requests["c"] = big
    step(s)
    # c could not get 7 blocks and nothing ran, so a and b gave theirs back (kept in the prefix
    # cache) and c ran.
    assert big.status == RequestStatus.RUNNING
    rehit = 0
    for _ in range(50):
        if not s.has_unfinished_requests():
            break
        so, _ = step(s)
        rehit += sum(n.num_computed_tokens for n in so.scheduled_new_reqs if n.req_id in ("a", "b"))
        check_invariants(s)
    assert_scheduler_idle(s)
    assert rehit > 0  # a or b found its loaded blocks in the prefix cache again


def test_producer_holds_until_finished_sending():
    s = make("kv_producer")
    r = make_request("p", list(range(10, 27)), max_tokens=1)  # 17 tokens: 4 full blocks held
    r.kv_transfer_params = {"do_remote_decode": True}
    s.add_request(r)
    _, outs = step(s)
    (o,) = outs.outputs
    assert o.finish_reason == "length" and o.kv_transfer_params["remote_block_ids"] == s.kv_cache_manager.get_block_ids("p")[:4]
    assert len(o.kv_transfer_params["remote_block_ids"]) == 4 and "p" in s.remote_kv.held_for_transfer
    so, _ = step(s)
    (hold,) = so.kv_connector_metadata.holds
    assert hold.transfer_id == o.kv_transfer_params["remote_request_id"] and len(hold.block_hashes) == 4
    assert s.kv_cache_manager.num_free_blocks == 60  # the partial last block went back at once
    step(s, KVConnectorOutput(finished_sending=["p"]))
    step(s, KVConnectorOutput(finished_sending=["p", "unknown"]))  # duplicated and unknown notices
    assert_scheduler_idle(s)
    aborted = make_request("q", list(range(10, 27)))
    aborted.kv_transfer_params = {"do_remote_decode": True}
    s.add_request(aborted)
    s.finish_requests(["q"], RequestStatus.FINISHED_ABORTED)
    assert not s.remote_kv.held_for_transfer  # nothing is kept for an aborted request
    assert_scheduler_idle(s)


def test_config_roles():
    assert KVTransferConfig(kv_role="kv_both").is_producer and KVTransferConfig(kv_role="kv_both").is_consumer
    s = make("kv_producer")  # a producer ignores do_remote_prefill: it computes the prompt itself
    r = make_request("a", list(range(10, 27)), max_tokens=1)
    r.kv_transfer_params = remote(4)
    s.add_request(r)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 17} and not s.remote_kv.waiting_for_remote
    assert isinstance(ModelRunnerOutput().kv_connector_output, type(None))
