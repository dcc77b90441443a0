"""The engine's step trace and block map (issue 14): what a dashboard or ``pagedserve explain``
reads. The worked example of design.md shows up step by step, prefix hits and preemptions are
named, block counts add up, the JSON-lines file parses, the trace can be turned off, and both
readers cross the engine-core process boundary (msgpack)."""
from __future__ import annotations

import asyncio
import json

import pytest

from core_utils import B, drain, make_request, make_scheduler, step
from pagedserve.config import EngineConfig
from pagedserve.core.trace import BLOCK_STATES, CACHED, FREE, SHARED, USED, StepTracer, block_map
from pagedserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def make_engine(model: str, **kw):
    from pagedserve.engine.llm_engine import LLMEngine

    kw.setdefault("dtype", "float32")
    kw.setdefault("num_threads", 1)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=model, **kw))


def sp(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def add(engine, rid: str, tokens: list[int], max_tokens: int) -> None:
    engine.add_request(rid, {"prompt_token_ids": tokens}, sp(max_tokens))


def shape(rec) -> dict:
    return {e["request_id"]: (e["phase"], e["num_tokens"]) for e in rec["scheduled"]}


def check_counts(rec) -> None:
    assert rec["num_used_blocks"] + rec["num_free_blocks"] == rec["num_total_blocks"]
    assert 0 <= rec["num_cached_free_blocks"] <= rec["num_free_blocks"]
    assert rec["num_scheduled_tokens"] == sum(e["num_tokens"] for e in rec["scheduled"]) <= rec["token_budget"]


def test_worked_example_of_design_md_is_visible_in_the_trace(tiny_dir):
    """Token budget 6, two requests decoding, a 12-token prompt arrives: three steps of 4 prompt
    tokens + one token for each decoder, then the long request decodes too."""
    eng = make_engine(tiny_dir, max_num_batched_tokens=6)
    for i in range(2):
        add(eng, f"dec{i}", [200 + 10 * i + j for j in range(3)], 30)
    eng.step()  # both 3-token prompts in one step of 6
    eng.step()
    first = eng.get_step_trace()[-1]["step"] + 1
    add(eng, "long", list(range(500, 512)), 2)
    for _ in range(4):
        eng.step()
    recs = eng.get_step_trace(first)
    assert [r["step"] for r in recs] == list(range(first, first + 4))
    chunk = {"dec0": ("decode", 1), "dec1": ("decode", 1), "long": ("prefill", 4)}
    assert [shape(r) for r in recs[:3]] == [chunk] * 3
    assert [r["num_scheduled_tokens"] for r in recs[:3]] == [6, 6, 6] and all(r["token_budget"] == 6 for r in recs)
    longs = [next(e for e in r["scheduled"] if e["request_id"] == "long") for r in recs]
    assert [e["num_computed_tokens"] for e in longs] == [0, 4, 8, 12]
    assert [e["admitted"] for e in longs] == [True, False, False, False] and longs[0]["prefix_hit_tokens"] == 0
    assert longs[0]["queued_s"] >= 0.0 and all("queued_s" not in e for e in longs[1:])
    assert all(e["num_prompt_tokens"] == 12 for e in longs)
    assert shape(recs[3]) == {"dec0": ("decode", 1), "dec1": ("decode", 1), "long": ("decode", 1)}
    assert recs[3]["finished"] == [{"request_id": "long", "finish_reason": "length"}]  # max_tokens=2
    assert all(r["preempted"] == [] for r in recs)
    assert [r["num_running"] for r in recs] == [3, 3, 3, 2] and all(r["num_waiting"] == 0 for r in recs)
    assert all(r["duration_ms"] > 0 and r["time"] > 0 for r in recs)
    for r in recs:
        check_counts(r)
    eng.abort_request(["dec0", "dec1"])
    eng.step()
    last = eng.get_step_trace()[-1]
    assert sorted(f["request_id"] for f in last["finished"]) == ["dec0", "dec1"]
    assert {f["finish_reason"] for f in last["finished"]} == {"abort"} and last["scheduled"] == []
    assert last["num_used_blocks"] == 0 and not eng.has_unfinished_requests()


def test_prefix_hit_tokens_and_shared_blocks(tiny_dir):
    eng = make_engine(tiny_dir)
    prefix = list(range(1000, 1032))  # two full blocks of 16
    add(eng, "a", prefix + list(range(1100, 1108)), 3)
    eng.step()
    add(eng, "b", prefix + list(range(2000, 2010)), 3)
    eng.step()
    rec = eng.get_step_trace()[-1]
    b = next(e for e in rec["scheduled"] if e["request_id"] == "b")
    assert b["admitted"] and b["phase"] == "prefill"
    assert b["prefix_hit_tokens"] == b["num_computed_tokens"] == 32 and b["num_tokens"] == 10
    assert shape(rec)["a"] == ("decode", 1)
    assert rec["num_used_blocks"] == 4  # a: 2 shared + 1, b: the same 2 + 1
    bm = eng.get_block_map()
    assert bm["state_names"] == list(BLOCK_STATES) and bm["num_blocks"] == 64 == len(bm["state"]) == len(bm["owner"])
    assert bm["request_ids"] == ["a", "b"] and bm["block_size"] == 16
    states = bm["state"]
    assert states.count(SHARED) == 2 and states.count(USED) == 2 and states.count(CACHED) + states.count(FREE) == 60
    assert {bm["owner"][i] for i, s in enumerate(states) if s == SHARED} == {0}  # a holds them first
    assert {bm["owner"][i] for i, s in enumerate(states) if s == USED} == {0, 1}
    assert all(bm["ref_cnt"][i] == 2 for i, s in enumerate(states) if s == SHARED)
    while eng.has_unfinished_requests():
        eng.step()
    last = eng.get_step_trace()[-1]
    assert last["num_used_blocks"] == 0
    assert last["num_cached_free_blocks"] == 2  # the shared prompt blocks stay reusable
    bm = eng.get_block_map()
    assert bm["state"].count(CACHED) == 2 and bm["request_ids"] == [] and set(bm["owner"]) == {-1}
    assert eng.get_stats().prefix_cache_hits == 32


def test_preemption_shows_in_a_tiny_pool(tiny_dir):
    eng = make_engine(tiny_dir, num_kv_blocks=6, max_model_len=96)
    for i in range(3):
        add(eng, f"r{i}", [3000 + 100 * i + j for j in range(20)], 40)  # 60 tokens = 4 blocks each, 6 in the pool
    pool = eng.core.scheduler.kv_cache_manager.block_pool
    while eng.has_unfinished_requests():
        eng.step()
        assert pool.num_cached_free_blocks == sum(1 for b in pool.free_queue if b.block_hash is not None)
    recs = eng.get_step_trace()
    assert recs[0]["step"] == 0
    for r in recs:
        check_counts(r)
        assert r["num_total_blocks"] == 6
    preempted = [(r["step"], rid) for r in recs for rid in r["preempted"]]
    assert preempted and preempted[0][1] == "r2"  # the most recently admitted goes first
    assert len(preempted) == eng.get_stats().num_preemptions
    step0, victim = preempted[0]
    resumed = next(e for r in recs if r["step"] > step0 for e in r["scheduled"] if e["request_id"] == victim and e["admitted"])
    assert resumed["phase"] == "prefill"
    assert resumed["num_computed_tokens"] + resumed["num_tokens"] > resumed["num_prompt_tokens"]  # its outputs are recomputed too
    finished = {f["request_id"]: f["finish_reason"] for r in recs for f in r["finished"]}
    assert finished == {"r0": "length", "r1": "length", "r2": "length"}


def test_trace_file_is_json_lines_and_equals_the_buffer(tiny_dir, tmp_path):
    path = tmp_path / "trace.jsonl"
    eng = make_engine(tiny_dir, trace_file=str(path))
    add(eng, "x", list(range(700, 740)), 4)
    add(eng, "y", list(range(800, 805)), 2)
    while eng.has_unfinished_requests():
        eng.step()
    lines = path.read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert len(recs) == 4 and recs == eng.get_step_trace()
    assert shape(recs[0]) == {"x": ("prefill", 40), "y": ("prefill", 5)}


def test_trace_off_records_nothing(tiny_dir, tmp_path):
    eng = make_engine(tiny_dir, trace_buffer_steps=0)
    assert eng.core.tracer is None
    add(eng, "x", list(range(700, 720)), 2)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_step_trace() == [] and eng.get_step_trace(0) == []
    # A file alone still traces (nothing buffered).
    eng = make_engine(tiny_dir, trace_buffer_steps=0, trace_file=str(tmp_path / "t.jsonl"))
    add(eng, "x", list(range(700, 720)), 2)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_step_trace() == [] and len((tmp_path / "t.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="trace_buffer_steps"):
        EngineConfig(trace_buffer_steps=-1)


class _Out:
    def __init__(self):
        self.outputs = []


class _So:
    def __init__(self):
        self.total_num_scheduled_tokens = 0
        self.preempted_req_ids = []


def test_ring_buffer_since_step_and_limit():
    s = make_scheduler()
    t = StepTracer(4)
    for _ in range(10):
        t.record(0.0, [], s, _So(), _Out())
    assert [r["step"] for r in t.get()] == [6, 7, 8, 9]
    assert [r["step"] for r in t.get(8)] == [8, 9]
    assert [r["step"] for r in t.get(0)] == [6, 7, 8, 9]  # older ones are gone: the gap says so
    assert t.get(10) == [] and t.get(99) == []
    assert [r["step"] for r in t.get(7, limit=2)] == [7, 8] and t.get(limit=0) == []


def test_block_map_states_and_owners_without_a_model():
    s = make_scheduler(num_blocks=8)
    s.add_request(make_request("r1", list(range(1, 9)), max_tokens=4))  # two full blocks of B=4
    step(s)
    s.add_request(make_request("r2", list(range(1, 9)) + [50, 51], max_tokens=2))
    step(s)
    bm = block_map(s.kv_cache_manager, [r.request_id for r in s.running])
    assert bm["block_size"] == B and bm["request_ids"] == ["r1", "r2"]
    st = bm["state"]
    assert st.count(SHARED) == 2 and st.count(USED) == 2 and st.count(FREE) == 4
    r1_blocks = s.kv_cache_manager.get_block_ids("r1")
    r2_blocks = s.kv_cache_manager.get_block_ids("r2")
    assert [st[i] for i in r1_blocks] == [SHARED, SHARED, USED] and r2_blocks[:2] == r1_blocks[:2]
    assert [bm["owner"][i] for i in r1_blocks + r2_blocks[2:]] == [0, 0, 0, 1]
    drain(s)
    bm = block_map(s.kv_cache_manager)
    pool = s.kv_cache_manager.block_pool
    assert bm["state"].count(CACHED) == pool.num_cached_free_blocks > 0
    assert bm["state"].count(CACHED) + bm["state"].count(FREE) == 8 and set(bm["owner"]) == {-1}


def test_async_llm_reads_the_trace_and_block_map_from_the_core_process(tiny_dir):
    from pagedserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM(EngineConfig(model=tiny_dir, dtype="float32", num_kv_blocks=32, max_model_len=256, num_threads=1), log_level="warning")
    try:
        async def go():
            outs = [o async for o in llm.generate({"prompt_token_ids": list(range(300, 340))}, sp(3), "a")]
            recs = await llm.get_step_trace(0)
            later = await llm.get_step_trace(recs[-1]["step"] + 1)
            some = await llm.get_step_trace(None, 1)
            bm = await llm.get_block_map()
            return outs, recs, later, some, bm
        outs, recs, later, some, bm = asyncio.run(go())
    finally:
        llm.shutdown()
    assert outs[-1].finished
    assert [shape(r) for r in recs] == [{"a": ("prefill", 40)}, {"a": ("decode", 1)}, {"a": ("decode", 1)}]
    assert recs[-1]["finished"] == [{"request_id": "a", "finish_reason": "length"}]
    assert later == [] and some == recs[:1]
    assert len(bm["state"]) == 32 and bm["state"].count(CACHED) == 2 and bm["request_ids"] == []


def test_trace_flags_are_engine_flags_of_every_command():
    from pagedserve.entrypoints.cli import build_parser

    p = build_parser()
    for argv in (["generate", "--prompt", "x"], ["serve"], ["bench", "throughput"], ["bench", "latency"]):
        args = p.parse_args(argv + ["--trace-file", "t.jsonl", "--trace-buffer-steps", "8"])
        cfg = EngineConfig.from_cli_args(args)
        assert cfg.trace_file == "t.jsonl" and cfg.trace_buffer_steps == 8, argv
    assert EngineConfig.from_cli_args(p.parse_args(["generate", "--prompt", "x"])).trace_buffer_steps == 1024


def test_trace_file_errors_are_clear_and_a_failed_write_keeps_the_engine_serving(tmp_path):
    import os

    import pytest as _pytest

    from pagedserve.config import EngineConfig
    from pagedserve.core.trace import StepTracer

    for bad in (str(tmp_path), str(tmp_path / "no" / "such" / "dir.jsonl")):
        with _pytest.raises(ValueError, match="trace_file"):
            EngineConfig(trace_file=bad)
    if not os.path.exists("/dev/full"):
        _pytest.skip("no /dev/full here")
    tracer = StepTracer(4, "/dev/full")  # every write fails with ENOSPC

    class Out:
        total_num_scheduled_tokens = 0
        preempted_req_ids = ()
        outputs = ()

    class Pool:
        num_free_blocks = num_blocks = num_cached_free_blocks = 8

    class Sched:
        config = EngineConfig(max_num_batched_tokens=64, max_model_len=64)
        kv_cache_manager = type("KV", (), {"block_pool": Pool()})()
        running, waiting = [], []

    for _ in range(3):
        tracer.record(0.0, [], Sched(), Out(), Out())  # no exception
    assert [r["step"] for r in tracer.get()] == [0, 1, 2] and tracer._file is None
