"""The KV connector in one process: a producer and a consumer EngineCore (tiny float32 model,
real pyzmq sockets on loopback) stepped by hand, and the config/params checks."""
from __future__ import annotations

import time

import pytest

from pagedserve.config import EngineConfig, KVTransferConfig, dataclass_from_value
from pagedserve.core.request import RequestStatus
from pagedserve.distributed.kv_transfer import params as kvp
from kv_utils import add, idle, make_core, prompt, run  # noqa: F401  (shared with the kv_int8 and spec-decode tests)
from server_utils import free_port

@pytest.fixture(scope="module")
def pair(tiny_model_factory):
    model = tiny_model_factory("llama")
    P = make_core(model, "kv_producer", kv_lease_s=2)
    D = make_core(model, "kv_consumer", kv_transfer_timeout_s=1, kv_load_failure_policy="fail")
    yield P, D
    P.shutdown()
    D.shutdown()


def prefill(P, D, rid):
    add(P, rid, 1, {"do_remote_decode": True})
    outs = run([P, D], lambda: not P.scheduler.requests)[id(P)]
    final = [o for o in outs if o.finish_reason][-1]
    assert final.kv_transfer_params["remote_num_tokens"] == 64
    assert rid in P.scheduler.remote_kv.held_for_transfer  # kept for the reader
    return final.kv_transfer_params


def test_load_then_decode_and_hold_released(pair):
    P, D = pair
    params = prefill(P, D, "p0")
    add(D, "d0", 4, params)
    D.step()
    assert D.scheduler.remote_kv.waiting_for_remote["d0"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert D.get_stats().num_waiting == 1
    outs = run([P, D], lambda: idle(P) and idle(D))[id(D)]
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "d0") == 4
    assert D.get_stats().kv_transfer_received_tokens >= 64 and P.get_stats().kv_transfer_sent_tokens >= 64


def test_abort_while_loading_frees_after_the_load_reports(pair):
    P, D = pair
    params = prefill(P, D, "p1")
    add(D, "d1", 4, params)
    D.step()
    D.abort_requests(["d1"])
    assert "d1" in D.scheduler.remote_kv.waiting_for_remote  # blocks kept: the cancelled load may still write them
    with pytest.raises(ValueError, match="in use"):
        add(D, "d1", 4, None)
    run([P, D], lambda: idle(P) and idle(D))


def test_fail_policy_ends_the_request_with_an_error(pair, tmp_path, monkeypatch):
    P, D = pair
    params = dict(prefill(P, D, "p2"), remote_port=free_port())  # nobody listens there
    add(D, "d2", 4, params)
    outs = run([D], lambda: not D.scheduler.requests)[id(D)]
    (final,) = [o for o in outs if o.request_id == "d2"]
    assert final.finish_reason == "error" and "KV transfer" in final.error and "timeout" in final.error
    assert D.get_stats().kv_transfer_failures["timeout"] >= 1
    run([P, D], lambda: idle(P) and idle(D), timeout=10)  # P's hold goes at its 2 s lease
    assert P.get_stats().kv_transfer_failures["lease_expired"] >= 1


def test_bad_port_and_config_errors(tiny_model_factory):
    port = free_port()
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ValueError, match="cannot listen"):
            make_core(tiny_model_factory("llama"), "kv_producer", kv_port=port)
    finally:
        s.close(0)
        ctx.term()
    for bad, match in (({"kv_role": "prefill"}, "kv_role"), ({"kv_port": 0}, "kv_port"), ({"kv_lease_s": -1}, "kv_lease_s"),
                       ({"kv_connector": "NixlConnector"}, "not available"), ({"nope": 1}, "unknown key"),
                       ({"kv_load_failure_policy": "retry"}, "recompute or fail")):
        with pytest.raises(ValueError, match=match):
            dataclass_from_value(KVTransferConfig, bad, "kv_transfer_config")
    with pytest.raises(ValueError, match="JSON"):
        EngineConfig(kv_transfer_config="{not json")
    with pytest.raises(ValueError, match="kv_port"):
        EngineConfig(data_parallel_size=2, kv_transfer_config={"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="advertise_host"):
        dataclass_from_value(KVTransferConfig, {"kv_ip": "0.0.0.0"}, "kv_transfer_config")
    assert EngineConfig(kv_transfer_config={"kv_ip": "0.0.0.0", "kv_connector_extra_config": {"advertise_host": "10.0.0.5"}}).kv_transfer_config


def test_params_checks():
    good = kvp.producer_params("e", "127.0.0.1", 5000, "t", [1, 2], 32)
    assert kvp.check_params(good, 4, ["127.0.0.1"]) is good
    for bad in ({**good, "remote_port": "80"}, {**good, "remote_block_ids": [1, -2]}, {**good, "remote_block_ids": list(range(5))},
                {**good, "remote_host": "example.com"}, {**good, "remote_engine_id": ""}, {**good, "do_remote_decode": "yes"}, [1]):
        with pytest.raises(kvp.KVParamsError):
            kvp.check_params(bad, 4, ["127.0.0.1"])
    assert kvp.check_params({**good, "remote_host": "example.com"}, 4, None)  # "*" allows any host


def test_a_peer_down_is_one_engine_not_its_address():
    """After a load from a producer timed out, loads from that producer fail at once for
    ``peer_down_s``; a producer restarted on the same address (a new engine id) is tried."""
    import torch

    from pagedserve.distributed.kv_transfer.base import LoadSpec
    from pagedserve.distributed.kv_transfer.consumer import KVLoader
    from pagedserve.distributed.kv_transfer.wire import kv_layout

    loader = KVLoader(torch.zeros(2, 2, 4, 2, 16, 8), kv_layout("m", "float32", 16, 2, 2, 8, b"s"), timeout_s=1.0, peer_down_s=60)
    port = free_port()  # nobody answers there: a producer that died

    def load(rid: str, engine: str) -> tuple[str, float]:
        t0 = time.monotonic()
        loader.submit(LoadSpec(rid, engine, "127.0.0.1", port, "t-" + rid, [0], [b"\0" * 16], [0], [0], 16))
        deadline = t0 + 10
        while True:
            _, failed, *_ = loader.take_finished()
            if rid in failed:
                return failed[rid], time.monotonic() - t0
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        assert load("r1", "old")[0] == "timeout"
        reason, took = load("r2", "old")
        assert reason == "peer_down" and took < 0.9
        reason, took = load("r3", "new")  # the same address, another engine: tried again (and times out)
        assert reason == "timeout" and took >= 0.9
    finally:
        loader.shutdown()
