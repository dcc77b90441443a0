"""Data parallelism: the router's rules and the block pool's KV events alone, then real
``pagedserve serve --data-parallel-size 2`` servers (mp and Ray, one thread per replica):
greedy outputs equal one engine's, kv-aware routing follows the cached prefix (read from each
replica's prefix-cache counters in /metrics), round-robin spreads, and a replica killed with
SIGKILL is taken out of rotation while the server keeps answering."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil
import pytest

from core_utils import make_kv_manager, make_request
from pagedserve.core.block_pool import BlockPool
from pagedserve.distributed.dp_router import DPRouter, prompt_block_hashes
from server_utils import httpx, start_tiny_server

B = 16
SEED = b"s" * 16


# -- the router alone -------------------------------------------------------------------------
def _router(policy: str, n: int = 2, slack: int = 4) -> DPRouter:
    return DPRouter(n, policy, B, seeds=[SEED] * n, balance_slack=slack)


def test_front_hashes_equal_the_replicas():
    """The front hashes a prompt exactly as a replica's KV cache manager does (salt included),
    up to the replica's hit cap of num_tokens - 1."""
    kv = make_kv_manager()  # block size 4 in the unit helpers
    for salt in (None, "tenant-a"):
        tokens = list(range(3, 3 + 4 * 5))  # exactly 5 blocks: a hit covers at most 4
        req = make_request("r", tokens, salt=salt)
        kv.update_block_hashes(req)
        assert prompt_block_hashes(kv.seed_hash, tokens, 4, salt) == req.block_hashes[:4]
        assert prompt_block_hashes(kv.seed_hash, tokens + [9], 4, salt) == req.block_hashes[:5]



def test_front_hashes_carry_the_lora_adapter():
    """A LoRA adapter's digest is in the first block's hash on both sides: equal for the same
    adapter, different from the base model's and another adapter's (so KV never mixes)."""
    kv = make_kv_manager()
    tokens = list(range(3, 3 + 4 * 5))
    seen = set()
    for salt in (None, "tenant-a"):
        for key in (None, "digest-a", "digest-b"):
            req = make_request("r", tokens, salt=salt)
            req.lora_key = key
            kv.update_block_hashes(req)
            front = prompt_block_hashes(kv.seed_hash, tokens, 4, salt, key)
            assert front == req.block_hashes[:4]
            seen.add(front[0])
    assert len(seen) == 6  # every (salt, adapter) pair names its own blocks


def test_kv_aware_follows_the_prefix_then_spills_under_load():
    r = _router("kv-aware")
    hot = r.request_hashes(list(range(4 * B + 1)))
    r.apply_events(1, [["stored", hot[SEED]]])
    assert r.choose(hot) == 1  # the replica that holds every block
    r.load = [0, 4]
    assert r.choose(hot) == 1  # 4 ahead: within the slack for a full match
    r.load = [0, 5]
    assert r.choose(hot) == 0  # past it: spill to the shorter queue
    r.load = [0, 2]
    half = r.request_hashes(list(range(2 * B)) + [7] * (2 * B + 1))  # 2 of its 4 blocks cached
    assert r.matched_blocks(1, half[SEED]) == 2
    assert r.choose(half) == 1  # half the prefix: half the slack (2)
    r.load = [0, 3]
    assert r.choose(half) == 0
    cold = r.request_hashes([5] * (3 * B))
    r.load = [2, 1]
    assert r.choose(cold) == 1  # no hit anywhere: least loaded
    r.apply_events(1, [["removed", hot[SEED][2:]]])
    assert r.matched_blocks(1, hot[SEED]) == 2
    r.apply_events(1, [["stored", hot[SEED][2:3]], ["cleared", []], ["stored", hot[SEED][:1]]])
    assert r.matched_blocks(1, hot[SEED]) == 1  # events apply in order
    r.mark_dead(1)
    r.load = [9, 0]
    assert r.choose(hot) == 0 and not r.cached[1]
    r.mark_dead(0)
    with pytest.raises(RuntimeError, match="no engine replica"):
        r.choose(hot)


def test_kv_aware_follows_a_request_in_flight():
    """A burst sharing a new prefix follows its first request before any event arrives, and
    the replica stops counting as a holder once that request is done (no event ever came)."""
    r = _router("kv-aware")
    burst = r.request_hashes(list(range(3 * B + 1)))
    first = r.choose(burst)
    r.note_routed(first, burst[SEED])
    r.load[first] += 1
    assert r.choose(burst) == first and r.matched_blocks(first, burst[SEED]) == 3
    r.note_done(first, burst[SEED])
    r.load[first] -= 1
    assert r.matched_blocks(first, burst[SEED]) == 0 and not r.pending[first]


def test_least_loaded_and_round_robin():
    r = _router("least-loaded", 3)
    r.load = [3, 1, 2]
    assert r.choose() == 1
    r.load = [1, 1, 1]
    assert [r.choose() for _ in range(3)] == [2, 0, 1]  # ties rotate
    rr = _router("round-robin", 3)
    rr.load = [0, 9, 9]  # load does not matter
    assert [rr.choose() for _ in range(4)] == [0, 1, 2, 0]
    rr.mark_dead(1)
    assert [rr.choose() for _ in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError):
        DPRouter(2, "random")


def test_block_pool_events():
    """Stored when a hash enters the index, removed when a cached block is reused, cleared on
    reset; nothing is recorded unless enabled, and a twin block's hash is not stored twice."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h1")
    assert pool.kv_events is None and pool.take_kv_events() is None
    pool.enable_kv_events()
    pool.cache_block(b, b"h2")
    c = pool.get_new_blocks(1)[0]
    pool.cache_block(c, b"h2")  # same content as b: stays unregistered
    assert pool.take_kv_events() == [["stored", [b"h2"]]]
    assert pool.take_kv_events() is None
    pool.free_blocks([a, b, c])
    reused = pool.get_new_blocks(3)  # c (unhashed) first, then b and a (a chain's last block goes first)
    assert pool.take_kv_events() == [["removed", [b"h2", b"h1"]]]
    pool.cache_block(reused[0], b"h3")
    pool.free_blocks(reused)
    assert pool.reset_prefix_cache()
    assert pool.take_kv_events() == [["cleared", []]]


def test_utility_fanout_combines_answers_and_survives_a_dead_replica():
    from pagedserve.engine.dp_utility import UtilityFanout
    from pagedserve.messages import EngineCoreEventType, UtilityResult

    def U(call_id, result, error):
        return (EngineCoreEventType.UTILITY, UtilityResult(call_id, result, error))

    f = UtilityFanout()
    alive = [True, False, True]
    assert f.targets("reset_prefix_cache", alive) == [0, 2]
    assert f.targets("get_block_map", alive) == [0]
    assert f.start(1, "reset_prefix_cache", [0, 2]) == []
    assert f.answer(0, 1, True, None) == []
    assert f.answer(2, 1, False, None) == [U(1, False, None)]  # True only when each reset
    assert f.answer(2, 1, True, None) == []  # unknown or finished id: ignored
    f.start(2, "reset_prefix_cache", [0, 2])
    f.answer(0, 2, True, None)
    assert f.replica_died(2, "replica 2 died") == [U(2, True, None)]  # answered by the live one
    f.start(3, "get_block_map", [0])
    assert f.replica_died(0, "replica 0 died") == [U(3, None, "replica 0 died")]
    assert f.start(4, "get_block_map", []) == [U(4, None, "no engine replica is alive")]
    f.start(5, "get_step_trace", [1])
    assert f.answer(1, 5, None, "ValueError: bad") == [U(5, None, "ValueError: bad")]


def test_offline_engine_refuses_data_parallel(tiny):
    from pagedserve import LLM

    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(tiny, data_parallel_size=2)


# -- real servers -------------------------------------------------------------------------------
SERVER_ARGS = ("--data-parallel-size", "2", "--threads-per-replica", "1", "--num-kv-blocks", "64", "--max-model-len", "256",
               "--max-num-seqs", "8", "--served-model-name", "x")


def _tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def _stop(proc) -> None:
    """SIGTERM the server: it exits 0, and every process it started (replicas, a Ray head
    and its agents and actors) is gone within a minute. A server that already exited (a
    test took it down) only has its processes checked."""
    if proc.poll() is not None:
        return
    procs = _tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(45)
    except Exception:
        proc.kill()
        proc.wait(10)
        raise
    finally:
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            p.kill()
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert rc == 0


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama")


MP_PROC: dict = {}


@pytest.fixture(scope="module")
def mp_server(tiny, tmp_path_factory):
    proc, base, _ = start_tiny_server(tiny, tmp_path_factory.mktemp("dp-mp"), *SERVER_ARGS)
    MP_PROC["proc"] = proc
    yield base
    _stop(proc)


@pytest.fixture(scope="module")
def ray_server(tiny, tmp_path_factory):
    proc, base, _ = start_tiny_server(tiny, tmp_path_factory.mktemp("dp-ray"), *SERVER_ARGS, "--data-parallel-backend", "ray",
                                      "--router", "round-robin")
    yield base
    _stop(proc)


@pytest.fixture(scope="module")
def reference(tiny):
    from pagedserve import LLM

    return LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=256, num_threads=1)


def _complete(base: str, prompt: list[int], max_tokens: int = 6) -> str:
    r = httpx.post(base + "/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _engine_metrics(base: str, name: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(rf'^pagedserve:{name}\{{([^}}]*)\}} (\S+)$', text, re.M):
        engine = re.search(r'engine="(\d+)"', m.group(1)).group(1)
        out[engine] = out.get(engine, 0.0) + float(m.group(2))
    return out


def _health(base: str) -> dict:
    r = httpx.get(base + "/health", timeout=10)
    return {"status_code": r.status_code, **r.json()}


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    return [[100 + seed * 7 + i * 13 + j for j in range(20 + 5 * i)] for i in range(n)]


def _check_matches_reference(base: str, reference, seed: int) -> None:
    from pagedserve import SamplingParams

    prompts = _prompts(seed)
    want = [o.outputs[0].text for o in reference.generate([{"prompt_token_ids": p} for p in prompts],
                                                          SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)]
    assert [_complete(base, p) for p in prompts] == want


def test_mp_outputs_equal_one_engine(mp_server, reference):
    _check_matches_reference(mp_server, reference, 1)


def test_kv_aware_sends_a_prefix_to_its_replica(mp_server):
    before = _engine_metrics(mp_server, "prefix_cache_hits_total")
    prefix = [300 + j for j in range(4 * B)]
    for i in range(4):
        _complete(mp_server, prefix + [20 + i, 30 + i], max_tokens=2)
    after = _engine_metrics(mp_server, "prefix_cache_hits_total")
    gained = {e: after.get(e, 0) - before.get(e, 0) for e in ("0", "1")}
    assert sorted(gained.values()) == [0, 3 * 4 * B], gained  # every repeat hit the same replica's whole prefix
    totals = _engine_metrics(mp_server, "prefix_cache_queries_total")
    assert set(totals) == {"0", "1"}  # each replica's series, side by side
    holder = max(gained, key=gained.get)
    replicas = _health(mp_server)["replicas"]
    assert all(x["in_flight"] == 0 for x in replicas), replicas  # every finish was counted
    assert replicas[int(holder)]["cached_blocks"] >= 4, replicas  # the router mirrors its cache


def _stream_until_killed(base: str, pid_of) -> tuple[int, str]:
    """Start a long streaming request, SIGKILL the replica running it once a token arrived,
    and return the rest of the stream."""
    body = {"model": "x", "prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        busy = [x for x in _health(base)["replicas"] if x["in_flight"] > 0]
        assert len(busy) == 1, busy
        os.kill(pid_of(busy[0]), signal.SIGKILL)
        return busy[0]["engine"], "\n".join(lines)


def _check_replica_death(base: str, pid_of) -> None:
    engine, rest = _stream_until_killed(base, pid_of)
    events = [json.loads(x[6:]) for x in rest.splitlines() if x.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["code"] == 503 and f"engine replica {engine} died" in errors[0]["message"], rest[-2000:]
    deadline = time.monotonic() + 20
    while True:
        h = _health(base)
        dead = [x for x in h["replicas"] if not x["alive"]]
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert h["status_code"] == 200 and h["status"] == "degraded", h
    assert [x["engine"] for x in dead] == [engine] and dead[0]["error"], h
    for i in range(3):  # the other replica answers everything from now on
        assert _complete(base, [40 + i, 41, 42, 43], max_tokens=2)
    up = _engine_metrics(base, "engine_replica_up")
    assert up == {str(engine): 0.0, str(1 - engine): 1.0}, up


def test_mp_killed_replica(mp_server):
    _check_replica_death(mp_server, lambda r: r["pid"])


def test_mp_last_replica_killed_server_fails(mp_server):
    """With no replica left the server fails as a one-engine server does: /health 503, then
    exit status 1 for a supervisor, leaving no process behind."""
    proc = MP_PROC["proc"]
    procs = _tree(proc.pid)
    last = [x for x in _health(mp_server)["replicas"] if x["alive"]]
    assert len(last) == 1
    os.kill(last[0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(mp_server + "/health", timeout=5).status_code != 503:  # for ENGINE_DEAD_GRACE_S (2 s) before the exit
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    assert proc.wait(30) == 1
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_ray_outputs_equal_one_engine_and_round_robin_spreads(ray_server, reference):
    h = _health(ray_server)
    assert [r["backend"] for r in h["replicas"]] == ["ray", "ray"], h
    before = _engine_metrics(ray_server, "request_success_total")
    _check_matches_reference(ray_server, reference, 2)
    _complete(ray_server, [9, 9, 9], max_tokens=2)
    after = _engine_metrics(ray_server, "request_success_total")
    assert {e: after.get(e, 0) - before.get(e, 0) for e in ("0", "1")} == {"0": 2, "1": 2}, (before, after)


def test_ray_killed_actor_before_any_output_moves_its_request(ray_server, reference):
    """A request whose replica dies before it produced anything is run again on another
    replica: freeze one actor (SIGSTOP), let round-robin hand it a request, SIGKILL it; the
    request still answers, with the same greedy text, and the server carries on degraded."""
    import threading

    from pagedserve import SamplingParams

    prompt = [60, 61, 62, 63, 64]
    want = reference.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    frozen = _health(ray_server)["replicas"][0]
    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        for _ in range(3):  # round-robin reaches the frozen replica within two requests
            got: list = []
            t = threading.Thread(target=lambda: got.append(_complete(ray_server, prompt)), daemon=True)
            t.start()
            deadline = time.monotonic() + 20
            while t.is_alive() and _health(ray_server)["replicas"][0]["in_flight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            if t.is_alive():
                break
            assert got == [want.outputs[0].text]
        assert t.is_alive() and _health(ray_server)["replicas"][0]["in_flight"] == 1
    finally:
        os.kill(frozen["pid"], signal.SIGKILL)
    t.join(30)
    assert got == [want.outputs[0].text]
    h = _health(ray_server)
    assert h["status"] == "degraded" and [x["alive"] for x in h["replicas"]] == [False, True], h
    assert _complete(ray_server, [70, 71, 72], max_tokens=2)
