"""Tensor parallelism (``tensor_parallel_size``): greedy float32 output of TP=N equals TP=1 token
for token (random-weight GQA models at TP=2, SmolLM2 at TP=3), on the mp and the ray backend;
head counts that do not divide are refused at start; a dead worker fails the engine instead of
hanging it; every process started here is gone at the end."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Chunked prefill (budget 24 tokens), decodes mixed with prefill chunks, shared prefixes.
TINY_PROMPTS = [{"prompt_token_ids": [5 + i] * 20 + list(range(100, 100 + 7 * i))} for i in range(5)]
TINY_KW = dict(dtype="float32", num_kv_blocks=48, max_model_len=256, max_num_batched_tokens=24)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: qkv bias, tied embeddings
def tiny_pair(request, tiny_model_factory):
    """(TP=1 engine, TP=2 engine) of a random 4-query / 2-KV-head model; the TP=2 one is shut down
    at the end and its worker checked gone."""
    path = tiny_model_factory(request.param)
    ref = LLM(path, num_threads=1, **TINY_KW)
    tp = LLM(path, num_threads=2, tensor_parallel_size=2, **TINY_KW)
    pids = list(tp.llm_engine.core.worker.worker_pids().values())
    yield ref, tp
    tp.llm_engine.core.shutdown()
    assert not _wait_gone(pids, 10)


def test_tp2_equals_tp1_greedy(tiny_pair):
    ref, tp = tiny_pair
    want = _tokens(ref, TINY_PROMPTS)
    assert _tokens(tp, TINY_PROMPTS) == want
    # Again: prefix-cache hits this time, and the workers dropped the finished requests.
    assert _tokens(tp, TINY_PROMPTS) == want
    runner = tp.llm_engine.core.worker.model_runner
    attn = runner.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # rank 0's share, and only its weights
    qkv = attn.qkv_proj  # an nn.Linear or, where its weights are packed for oneDNN, a PackedLinear
    assert (qkv.out_features, qkv.in_features) == ((2 + 2 * 1) * attn.head_dim, 128)
    assert tuple(runner.model.embed_tokens.weight.shape) == (49152 // 2, 128)
    assert runner.kv_cache.shape[2:4] == (48, 1)  # the agreed num_blocks, one KV head per rank


def test_tp2_logprobs_close_to_tp1(tiny_pair):
    ref, tp = tiny_pair
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    a = ref.generate(TINY_PROMPTS[:2], params, use_tqdm=False)
    b = tp.generate(TINY_PROMPTS[:2], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(y.prompt_logprobs) == len(y.prompt_token_ids) and y.prompt_logprobs[0] is None
        for lx, ly in zip(x.outputs[0].logprobs + x.prompt_logprobs[1:], y.outputs[0].logprobs + y.prompt_logprobs[1:]):
            assert lx.keys() == ly.keys()
            for k in lx:
                assert abs(lx[k].logprob - ly[k].logprob) < 1e-4


@pytest.mark.slow
def test_tp3_smollm2_equals_tp1(smollm2_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _tokens(smollm2_llm, prompts, params)
    tp = LLM(dtype="float32", num_threads=3, tensor_parallel_size=3, kv_cache_memory_bytes=24 << 20, max_model_len=512)
    try:
        assert tp.llm_engine.core.worker.model_runner.model.layers[0].self_attn.num_kv_heads == 1
        assert _tokens(tp, prompts, params) == want
    finally:
        pids = list(tp.llm_engine.core.worker.worker_pids().values())
        tp.llm_engine.core.shutdown()
        assert not _wait_gone(pids, 10)


def test_indivisible_heads_refused_before_start():
    before = set(_children(os.getpid()))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's 9 query heads and 3 KV heads"):
        LLM(dtype="float32", tensor_parallel_size=2)
    assert set(_children(os.getpid())) <= before  # no worker was started
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_serve_indivisible_heads_is_one_line():
    """`serve -tp 2` on the default model: the engine core refuses before it starts, and the user
    sees one error line (the core's traceback is a debug-level log), a non-zero exit."""
    import subprocess
    import sys

    from app_utils import free_port

    r = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--tensor-parallel-size", "2",
                        "--port", str(free_port()), "--host", "127.0.0.1"], capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert [line for line in out.splitlines() if "must divide the model's 9 query heads" in line] == \
        ["pagedserve serve: error: tensor_parallel_size=2 must divide the model's 9 query heads and 3 KV heads (possible sizes: [1, 3])"]


def test_cli_flags():
    import argparse

    ap = argparse.ArgumentParser()
    EngineConfig.add_cli_args(ap)
    cfg = EngineConfig.from_cli_args(ap.parse_args(["--tensor-parallel-size", "3", "--distributed-executor-backend", "ray"]))
    assert (cfg.tensor_parallel_size, cfg.distributed_executor_backend, cfg.distributed_host) == (3, "ray", None)
    assert EngineConfig.from_cli_args(ap.parse_args(["-tp", "2"])).tensor_parallel_size == 2


def test_ray_backend_equals_tp1(tiny_model_factory):
    ray = pytest.importorskip("ray")
    path = tiny_model_factory("llama")
    ref = LLM(path, num_threads=1, **TINY_KW)
    want = _tokens(ref, TINY_PROMPTS)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        tp = LLM(path, num_threads=2, tensor_parallel_size=2, distributed_executor_backend="ray", **TINY_KW)
        try:
            assert _tokens(tp, TINY_PROMPTS) == want
            pids = list(tp.llm_engine.core.worker.worker_pids().values())
        finally:
            tp.llm_engine.core.shutdown()
        assert ray.is_initialized()  # the executor leaves a Ray it did not start running
        assert not _wait_gone(pids, 15)
    finally:
        ray.shutdown()


@pytest.mark.parametrize("when", ["between_steps", "mid_step"])
def test_killed_worker_fails_the_engine(tiny_model_factory, when):
    """SIGKILL of rank 1 while the engine is idle (caught before the next step is sent) or
    inside a step (rank 0's collective fails): the step raises, naming the rank, in bounded time."""
    tp = LLM(tiny_model_factory("llama"), num_threads=2, tensor_parallel_size=2, **TINY_KW)
    executor = tp.llm_engine.core.worker
    try:
        _tokens(tp, TINY_PROMPTS[:1])
        (pid,) = executor.worker_pids().values()

        def kill() -> None:
            os.kill(pid, signal.SIGKILL)
            assert not _wait_gone([pid], 10)

        if when == "between_steps":
            kill()
        else:  # after the step was sent to rank 1, before rank 0's forward
            real = executor.worker.execute_model
            executor.worker.execute_model = lambda so: (kill(), real(so))[1]
        t0 = time.monotonic()
        expected = "tensor-parallel worker rank 1" if when == "between_steps" else "tensor-parallel step failed: .*rank 1"
        with pytest.raises(RuntimeError, match=expected):
            _tokens(tp, TINY_PROMPTS[:1])
        assert time.monotonic() - t0 < 30
    finally:
        tp.llm_engine.core.shutdown()


def test_tp_with_kv_transfer_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 together with kv_transfer_config"):
        EngineConfig(tensor_parallel_size=3, kv_transfer_config={"kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579})
    EngineConfig(tensor_parallel_size=1, kv_transfer_config={"kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579})


def test_serve_tp2_and_core_death_stops_workers(tiny_model_factory, tmp_path):
    """``pagedserve serve --tensor-parallel-size 2``: the engine-core process hosts rank 0 and
    starts rank 1; the server answers like TP=1; when the core dies (SIGKILL) its worker exits."""
    from server_utils import httpx, start_tiny_server

    path = tiny_model_factory("llama")
    want = LLM(path, num_threads=1, **TINY_KW).generate("Hello there", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                                       use_tqdm=False)[0].outputs[0].text
    proc, base, log = start_tiny_server(path, tmp_path, "--tensor-parallel-size", "2", "--num-threads", "2", "--max-model-len", "256")
    try:
        r = httpx.post(base + "/v1/completions", json={"model": os.path.basename(path), "prompt": "Hello there", "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        (core,) = [p for p in _children(proc.pid) if "core_proc" in open(f"/proc/{p}/cmdline").read()]
        workers = [p for p in _children(core) if "executor.worker_proc" in open(f"/proc/{p}/cmdline").read()]
        assert len(workers) == 1
        os.kill(core, signal.SIGKILL)
        assert not _wait_gone(workers, 10), log.read_text()[-2000:]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except Exception:
            proc.kill()
            proc.wait(5)
