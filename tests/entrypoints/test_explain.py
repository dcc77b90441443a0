"""``pagedserve explain``: each scenario on a tiny random model, in-process; the step table's
values are the engine's trace (design.md's worked example for chunked prefill)."""
from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.entrypoints.explain import explain, format_table


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def engine(model: str) -> dict:
    return dict(model=model, dtype="float32", num_threads=1)


def shape(rec) -> dict:
    return {e["request_id"]: (e["phase"], e["num_tokens"]) for e in rec["scheduled"]}


def test_chunked_prefill_worked_example(tiny_dir):
    ex = explain("chunked-prefill", engine(tiny_dir), token_budget=6, prompt_tokens=12, decoders=2)
    with_long = [r for r in ex.records if "long" in shape(r)]
    chunk = {"decoder-0": ("decode", 1), "decoder-1": ("decode", 1), "long": ("prefill", 4)}
    assert [shape(r) for r in with_long] == [chunk, chunk, chunk, {**chunk, "long": ("decode", 1)}]
    assert [r["num_scheduled_tokens"] for r in with_long] == [6, 6, 6, 3]
    assert shape(ex.records[0]) == {"decoder-0": ("prefill", 3), "decoder-1": ("prefill", 3)}  # the decoders' prompts
    text = format_table(ex)
    assert "3 chunks of 4, 4, 4 tokens" in text and "Every decoder got its token in every step." in text
    rows = [line for line in text.splitlines() if line.startswith(str(with_long[0]["step"]) + " ")]
    assert rows and rows[0].count("decode 1") == 2 and "prefill 4" in rows[0] and "6/6" in rows[0]


def test_chunked_prefill_cli_json(tiny_dir, capsys):
    rc = main(["explain", "chunked-prefill", "--model", tiny_dir, "--dtype", "float32", "--num-threads", "1",
               "--token-budget", "6", "--prompt-tokens", "12", "--decoders", "2", "--json"])
    assert rc == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in recs] == list(range(len(recs)))
    longs = [e for r in recs for e in r["scheduled"] if e["request_id"] == "long"]
    assert [(e["phase"], e["num_tokens"]) for e in longs] == [("prefill", 4)] * 3 + [("decode", 1)]
    assert set(recs[0]["scheduled"][0]) >= {"request_id", "phase", "num_tokens"}


def test_prefix_caching_second_request_reuses_the_system_prompt(tiny_dir):
    ex = explain("prefix-caching", engine(tiny_dir), prefix_tokens=64, suffix_tokens=8)
    adm = {e["request_id"]: e for r in ex.records for e in r["scheduled"] if e["admitted"]}
    assert adm["first"]["prefix_hit_tokens"] == 0 and adm["first"]["num_tokens"] == 72
    assert adm["second"]["prefix_hit_tokens"] == 64 and adm["second"]["num_tokens"] == 8
    text = format_table(ex)
    assert "prefix hit of 64 tokens (4 blocks of 16)" in text and "prefill 8 (+64 hit)" in text
    assert "Cached-evictable blocks in the pool before: 4." in text  # the first request's 4 full blocks


def test_preemption_names_who_is_preempted_and_recomputed(tiny_dir):
    ex = explain("preemption", engine(tiny_dir), num_requests=3, prompt_tokens=20, max_tokens=40)
    assert ex.records[0]["num_total_blocks"] == 6
    preempted = [rid for r in ex.records for rid in r["preempted"]]
    assert preempted and preempted[0] == "r2"
    text = format_table(ex)
    assert "PREEMPTED" in text and "r2 preempted with" in text and "r2 resumed:" in text
    assert "every request finished: True" in text
    assert f"{len(preempted)} preemptions" in text


def test_bad_scenarios_are_value_errors(tiny_dir):
    with pytest.raises(ValueError, match="unknown scenario"):
        explain("nope", engine(tiny_dir))
    with pytest.raises(ValueError, match="token-budget"):
        explain("chunked-prefill", engine(tiny_dir), token_budget=2, decoders=2)
