"""Smoke tests of the benchmarks: every script in benchmarks/ runs its ``--tiny`` mode (a tiny
random model, seconds) in a subprocess, and ``pagedserve bench kernels --tiny`` runs every op;
each must exit 0 and append one result line (benchmarks/results' format) to the directory that
``$PAGEDSERVE_BENCH_RESULTS`` names. Never how fast anything is: timings on a shared CPU are
noise. The scripts that start servers or several engines are marked slow."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")

# script -> the results file it appends to (None: it measures nothing)
FAST = {
    "llamacpp_setup.sh": None,
    "build_1b_model.py": None,
    "compute_ceiling.py": "compute_ceiling",
    "profile_step.py": "profile_step",
    "chunked_prefill_itl.py": "chunked_prefill_itl",
    "prefix_caching.py": "prefix_caching",
    "structured_output_cost.py": "structured_output_cost",
    "gguf_quality.py": "gguf_quality",  # SmolLM2's GGUF quantized and dequantized, ~400 tokens
    "embeddings_vs_hf.py": "embeddings_vs_hf",  # the tiny model, 8 inputs: LLM.embed against HF's AutoModel
    "lora_multi.py": "lora_multi",  # the tiny model, 4 PEFT adapters, 8 requests of 4 tokens: one LoRA engine, 4 merged engines, a plain one
    "swa_kv_memory.py": "swa_kv_memory",  # configs only: the core's allocator driven through one request per model
    "gpu_check.py": "gpu_check",  # --tiny = --cpu-smoke: the device check's sections at tiny sizes on the CPU (kernel under Triton's interpreter), without pydantic/fastapi/zmq/msgpack/gguf/llguidance
}
SLOW = {
    "compare_llamacpp.py": "compare_llamacpp",  # two processes (the script, then bench latency)
    "soak.py": "soak",
    "tp_step_time.py": "tp_step_time",
    "spec_decode.py": "spec_decode",
    "kv_int8.py": "kv_int8",
    "step_time.py": "step_time",
    "overload.py": "overload",
    "dp_routing.py": "dp_routing",
    "pd_disagg.py": "pd_disagg",
    "vs_llama_server.py": "vs_llama_server",
    "gguf_vs_llamacpp.py": "gguf_vs_llamacpp",  # bench latency, RSS processes, llama-bench where built
    "moe_vs_llamacpp.py": "moe_vs_llamacpp",  # each side that can run: pagedserve once it loads qwen3_moe, llama.cpp where built
}
HELPERS = {"bench_procs.py"}  # imported by vs_llama_server.py, not run


def test_every_script_is_smoke_tested():
    scripts = {f for f in os.listdir(BENCH) if f.endswith((".py", ".sh"))} - HELPERS
    assert scripts == set(FAST) | set(SLOW), "a benchmark script without a --tiny smoke test (or a stale entry here)"


def _run_tiny(script: str, tmp_path, timeout: float) -> subprocess.CompletedProcess:
    results = tmp_path / "results"
    env = dict(os.environ, PAGEDSERVE_BENCH_RESULTS=str(results), TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    path = os.path.join(BENCH, script)
    cmd = ["bash", path, "--tiny"] if script.endswith(".sh") else [sys.executable, path, "--tiny"]
    if script == "build_1b_model.py":
        cmd += ["--out", str(tmp_path / "model")]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _check_result(tmp_path, scenario: str, script: str) -> None:
    lines = (tmp_path / "results" / f"{scenario}.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["scenario"] == scenario and rec["tiny"] is True and rec["figures"]
    assert rec["host"]["class"] in ("amx", "avx512bf16", "avx2", "other") and rec["host"]["cpu"]
    assert rec["commit"] and script in rec["command"] and "--tiny" in rec["command"]


@pytest.mark.parametrize(
    "script", list(FAST) + [pytest.param(s, marks=pytest.mark.slow) for s in SLOW]
)
def test_script_tiny(script, tmp_path):
    done = _run_tiny(script, tmp_path, timeout=600)
    assert done.returncode == 0, f"{script} --tiny exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    scenario = {**FAST, **SLOW}[script]
    if scenario:
        _check_result(tmp_path, scenario, script)


def test_bench_kernels_tiny(tmp_path, monkeypatch, capsys):
    from pagedserve.bench.kernels import OPS
    from pagedserve.entrypoints.cli import main

    monkeypatch.setenv("PAGEDSERVE_BENCH_RESULTS", str(tmp_path))
    out = tmp_path / "kernels.json"
    assert main(["--log-level", "warning", "bench", "kernels", "--op", "all", "--tiny", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [o["op"] for o in res["ops"]] == list(OPS)
    for op in res["ops"]:
        assert op["cases"], op["op"]
        for case in op["cases"]:
            for side in case.get("sides", {}).values():
                assert side["median_ms"] > 0 and side["min_ms"] > 0, (op["op"], case["case"])
    lines = [json.loads(x) for x in (tmp_path / "kernels.jsonl").read_text().splitlines()]
    assert [x["figures"]["op"] for x in lines] == list(OPS) and all(x["tiny"] for x in lines)
    assert "kernels" in lines[0]["command"]
    assert "matmul |" in capsys.readouterr().out


def test_result_lines(tmp_path, monkeypatch):
    from pagedserve.bench import results

    monkeypatch.delenv(results.ENV, raising=False)
    assert results.results_dir(tiny=True) is None, "a smoke run must not land among the measured figures by default"
    monkeypatch.setenv(results.ENV, "0")
    assert results.record("x", {"a": 1}) is None
    monkeypatch.setenv(results.ENV, str(tmp_path))
    path = results.record("x", {"a": float("nan"), "b": {1: 2.5}}, command="pagedserve bench kernels --op matmul")
    results.record("x", {"a": 2})
    lines = [json.loads(x) for x in open(path).read().splitlines()]
    assert len(lines) == 2 and lines[0]["figures"] == {"a": None, "b": {"1": 2.5}}
    assert lines[0]["command"] == "pagedserve bench kernels --op matmul" and lines[0]["tiny"] is False
    assert len(lines[0]["commit"]) == 40 or lines[0]["commit"] == "unknown"
    assert results.cpu_class({"amx_bf16", "avx512_bf16", "avx2", "fma"}) == "amx"
    assert results.cpu_class({"avx512_bf16", "avx2", "fma"}) == "avx512bf16"
    assert results.cpu_class({"avx2", "fma"}) == "avx2"
    assert results.cpu_class(set()) == "other"
