"""Smoke tests of ``pagedserve bench``: every subcommand on tiny sizes (a random 2-layer model,
a few prompts, a few tokens). They check that the numbers exist and are positive, never how
fast anything is: timings on a shared CPU are noise."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pagedserve.bench import datasets
from pagedserve.entrypoints.cli import main

ENGINE_SMALL = ["--dtype", "float32", "--kv-cache-memory", "16000000", "--max-model-len", "512"]


def _bench(*argv: str) -> int:
    return main(["--log-level", "warning", "bench", *argv])


# -- workloads -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory):
    from pagedserve.model.loader import load_tokenizer

    return load_tokenizer(tiny_model_factory("llama"))


def test_datasets_shapes(tokenizer):
    reqs = datasets.sample_random(tokenizer, 20, (16, 32), (3, 5), seed=1)
    assert len(reqs) == 20
    assert all(16 <= r.prompt_len <= 32 and 3 <= r.expected_output_len <= 5 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == 20, "prompts must not share a first block"
    assert all(r.prompt and isinstance(r.prompt, str) for r in reqs)
    assert [r.prompt_token_ids for r in datasets.sample_random(tokenizer, 20, (16, 32), (3, 5), seed=1)] == [r.prompt_token_ids for r in reqs]

    pre = datasets.sample_prefix_repetition(tokenizer, 12, prefix_len=32, suffix_len=8, num_prefixes=3, output_range=(4, 4), seed=0)
    assert len(pre) == 12 and all(r.prompt_len == 40 for r in pre)
    prefixes = {}
    for r in pre:
        prefixes.setdefault(tuple(r.prompt_token_ids[:32]), []).append(tuple(r.prompt_token_ids[32:]))
    assert len(prefixes) == 3 and all(len(s) == 4 and len(set(s)) == 4 for s in prefixes.values())

    mix = datasets.sample_long_mix(tokenizer, 16, (8, 16), long_input_len=200, num_long=2, output_range=(2, 2), seed=0)
    assert sorted(r.prompt_len for r in mix)[-2:] == [200, 200]
    assert sum(r.prompt_len == 200 for r in mix) == 2

    assert datasets.length_range(100, 0.5, None, None, (1, 2)) == (50, 150)
    assert datasets.length_range(None, 0.0, 64, 512, (1, 2)) == (64, 512)
    with pytest.raises(ValueError):
        datasets.length_range(100, 1.5, None, None, (1, 2))


# -- throughput ----------------------------------------------------------------------------
def test_throughput_both_backends(tiny_model_factory, tmp_path, capsys):
    model = tiny_model_factory("llama")
    out = tmp_path / "tp.json"
    rc = _bench(
        "throughput", "--model", model, "--backend", "both", "--num-prompts", "4", "--min-input-len", "16", "--max-input-len", "32",
        "--output-len", "4", "--peak-measure-seconds", "0.2", "--output-json", str(out), *ENGINE_SMALL,
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "[pagedserve] Throughput:" in text and "[hf]" in text and "pagedserve / hf output tok/s:" in text
    res = json.loads(out.read_text())
    assert res["peak_flops_per_s"] > 0 and res["ratio_output_tokens_per_s"] > 0
    assert 16 * 4 <= res["total_prompt_tokens"] <= 32 * 4 and res["total_output_tokens"] == 16
    for name in ("pagedserve", "hf"):
        r = res["results"][name]
        assert r["output_tokens"] == 16 and r["num_requests"] == 4
        for key in ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "model_flops", "achieved_flops_per_s", "mfu"):
            assert r[key] > 0, (name, key, r[key])
    assert res["results"]["hf"]["extra"]["generated_tokens_incl_batch_padding"] == 16
    assert res["results"]["pagedserve"]["extra"]["ttft"]["median_ms"] > 0


@pytest.mark.parametrize(
    "workload",
    [
        ["--dataset-name", "prefix-repetition", "--prefix-len", "32", "--suffix-len", "8", "--num-prefixes", "2"],
        ["--dataset-name", "long-mix", "--long-input-len", "128", "--num-long", "1", "--min-input-len", "8", "--max-input-len", "16"],
    ],
    ids=["prefix-repetition", "long-mix"],
)
def test_throughput_datasets(tiny_model_factory, tmp_path, workload):
    out = tmp_path / "tp.json"
    rc = _bench(
        "throughput", "--model", tiny_model_factory("llama"), "--num-prompts", "6", "--output-len", "3", "--peak-tflops", "1",
        "--max-num-seqs", "4", "--output-json", str(out), *workload, *ENGINE_SMALL,
    )
    assert rc == 0
    r = json.loads(out.read_text())["results"]["pagedserve"]
    assert r["output_tokens"] == 18 and r["output_tokens_per_s"] > 0 and r["extra"]["max_num_seqs"] == 4


# -- latency -------------------------------------------------------------------------------
def test_latency(tiny_model_factory, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = _bench(
        "latency", "--model", tiny_model_factory("llama"), "--backend", "both", "--input-len", "32", "--output-len", "6",
        "--num-iters", "2", "--num-iters-warmup", "1", "--output-json", str(out), *ENGINE_SMALL,
    )
    assert rc == 0
    assert "prefill 32 tokens" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in results] == ["pagedserve", "hf"]
    for r in results:
        assert r["ttft_s"]["median"] > 0 and r["prefill_tokens_per_s"]["median"] > 0 and r["decode_tokens_per_s"]["median"] > 0
    ps = results[0]
    if "memory_read_gb_per_s" in ps:  # CPU with the compiled kernels: the decode bandwidth ceiling
        from pagedserve.bench.flops import model_flops
        from pagedserve.model import loader

        mf = model_flops(loader.load_config(tiny_model_factory("llama")))
        assert ps["decode_weight_bytes_per_token"] == 4 * (mf.layer_params + mf.lm_head_params)  # float32
        assert ps["memory_read_gb_per_s"] > 0
        assert ps["decode_bandwidth_ceiling_tokens_per_s"] == pytest.approx(ps["memory_read_gb_per_s"] * 1e9 / ps["decode_weight_bytes_per_token"])


# -- serve ---------------------------------------------------------------------------------
class ThreadedServer:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def fake_openai_app(seen: list):
    """A minimal OpenAI-compatible streaming server: ``max_tokens`` chunks of text, 2 ms apart,
    then a usage chunk and [DONE]."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        n = int(body.get("max_completion_tokens") or body["max_tokens"])
        if chat:
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
        for i in range(n):
            await asyncio.sleep(0.002)
            piece = f" tok{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        return StreamingResponse(stream(body, chat=False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        return StreamingResponse(stream(body, chat=True), media_type="text/event-stream")

    return app


def test_serve_fake_server_sweep_plot_goodput(tiny_model_factory, tmp_path, capsys):
    seen: list = []
    with ThreadedServer(fake_openai_app(seen)) as srv:
        rc = _bench(
            "serve", "--base-url", srv.url, "--tokenizer", tiny_model_factory("llama"), "--num-prompts", "6",
            "--min-input-len", "8", "--max-input-len", "16", "--output-len", "5", "--request-rates", "50,inf", "--max-concurrency", "4",
            "--goodput", "ttft:10000", "tpot:10000", "e2el:0.001", "--metric-percentiles", "50,99", "--plot", str(tmp_path / "sweep.png"),
            "--result-dir", str(tmp_path), "--result-filename", "serve.json",
        )
    assert rc == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "P99 TTFT (ms):" in text and "Request goodput (req/s):" in text
    body = seen[-1]
    assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 5 and isinstance(body["prompt"], str)
    res = json.loads((tmp_path / "serve.json").read_text())
    assert [r["request_rate"] for r in res["runs"]] == [50.0, "inf"]
    for r in res["runs"]:
        assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 30
        for key in ("request_throughput", "output_throughput", "total_token_throughput"):
            assert r[key] > 0
        for m in ("ttft", "tpot", "itl", "e2el"):
            assert r[f"mean_{m}_ms"] > 0 and r[f"median_{m}_ms"] > 0 and r[f"p99_{m}_ms"] > 0
        assert all(len(itl) == 4 for itl in r["itls"])
        assert r["request_goodput"] == 0.0  # nobody meets a 1 us end-to-end SLO
    png = (tmp_path / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_serve_fake_server_chat_endpoint(tiny_model_factory, tmp_path):
    seen: list = []
    with ThreadedServer(fake_openai_app(seen)) as srv:
        rc = _bench(
            "serve", "--base-url", srv.url, "--endpoint", "/v1/chat/completions", "--model", "fake-model", "--tokenizer",
            tiny_model_factory("llama"), "--num-prompts", "3", "--input-len", "12", "--output-len", "4", "--request-rate", "inf",
            "--goodput", "ttft:60000", "--save-result", "--result-dir", str(tmp_path),
        )
    assert rc == 0
    assert "messages" in seen[-1]
    (path,) = tmp_path.glob("pagedserve-bench-serve-*.json")
    r = json.loads(path.read_text())
    assert r["completed"] == 3 and r["total_output_tokens"] == 12 and r["request_goodput"] > 0
    assert r["mean_ttft_ms"] > 0 and all(len(itl) == 3 for itl in r["itls"])


def test_serve_against_pagedserve_server(tiny_model_factory, tmp_path):
    """The real server (when it is there) over the tiny model, driven by the bench client."""
    try:
        from pagedserve.entrypoints.openai.api_server import build_app
    except ImportError:
        pytest.skip("pagedserve's OpenAI server is not available")
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM

    model = tiny_model_factory("llama")
    llm = AsyncLLM(EngineConfig(model=model, dtype="float32", kv_cache_memory_bytes=16_000_000, max_model_len=512), engine_process=False)
    out = tmp_path / "real.json"
    with ThreadedServer(build_app(llm)) as srv:
        rc = _bench(
            "serve", "--base-url", srv.url + "/v1", "--tokenizer", model, "--num-prompts", "4", "--min-input-len", "16", "--max-input-len", "32",
            "--output-len", "5", "--request-rate", "inf", "--result-filename", str(out),
        )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 20, r["errors"]
    assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0 and r["output_throughput"] > 0


def test_serve_says_in_one_line_when_the_server_is_down():
    with pytest.raises(SystemExit, match="no server answers at http://127.0.0.1:9 "):
        _bench("serve", "--base-url", "http://127.0.0.1:9/v1", "--num-prompts", "2")


# -- memory --------------------------------------------------------------------------------
def test_memory_paged_vs_static(tiny_model_factory, tmp_path, capsys):
    out, png = tmp_path / "mem.json", tmp_path / "mem.png"
    rc = _bench(
        "memory", "--model", tiny_model_factory("llama"), "--num-prompts", "6", "--min-input-len", "16", "--max-input-len", "32",
        "--output-len", "64", "--dtype", "float32", "--num-threads", "1", "--output-json", str(out), "--plot", str(png),
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "PagedAttention paper" in text and "Throughput: paged" in text
    res = json.loads(out.read_text())
    for key in ("paged_utilization", "static_utilization", "static_max_len_utilization", "max_concurrent_paged", "max_concurrent_static", "throughput"):
        assert key in res, key
    assert 0 < res["static_max_len_utilization"] <= res["static_utilization"] <= res["paged_utilization"] <= 1
    assert res["max_concurrent_paged"] >= res["max_concurrent_static"] >= 1 and res["steps"] > 0
    tp = res["throughput"]
    assert tp["paged"]["output_tokens_per_s"] > 0 and tp["static"]["output_tokens_per_s"] > 0 and tp["ratio_output_tokens_per_s"] > 0
    assert tp["static"]["max_num_seqs"] == res["max_concurrent_static"]
    assert tp["paged"]["output_tokens"] == tp["static"]["output_tokens"] == res["total_output_tokens"] < res["total_max_tokens"]
    assert png.stat().st_size > 1000
    assert res["sliding_window"] is None  # full attention: no window report


def test_memory_reports_the_sliding_windows_saving(tiny_model_factory, tmp_path, capsys):
    """A tiny Mistral (2 layers, 2 KV heads of 32, float32: 512 bytes per token per layer) with
    a 16-token window at 256 tokens of context: 16 blocks of 16 without freeing, 2 while decoding
    with it (the window's block and the one being written), measured on the allocator."""
    out = tmp_path / "mem.json"
    rc = _bench(
        "memory", "--model", tiny_model_factory("mistral", sliding_window=16), "--num-prompts", "2", "--min-input-len", "16",
        "--max-input-len", "32", "--output-len", "8", "--dtype", "float32", "--num-threads", "1", "--no-static-run", "--no-warmup",
        "--window-context", "256", "--output-json", str(out),
    )
    assert rc == 0
    assert "freeing the window's blocks" in capsys.readouterr().out
    w = json.loads(out.read_text())["sliding_window"]
    assert w["kind"] == "pure" and w["bytes_per_token_layer"] == 512 and w["layers"] == w["local_layers"] == 2
    assert w["bytes_no_freeing"] == 256 * 512 * 2
    assert w["bytes_freeing_decode"] == 2 * 16 * 512 * 2
    # Tokens that left the window are not counted as held: no sharing here, so at most 100 %.
    assert 0 < json.loads(out.read_text())["paged_utilization"] <= 1
