"""``pagedserve bench latency``: batch-1 prefill and decode speed.

Prefill: time to the first token of one request of ``--input-len`` prompt tokens with
max_tokens=1; prefill tok/s = input_len / that time. Decode: one request making
``--output-len`` tokens; decode tok/s = (n - 1) / (time from its first token to its last).
Every iteration uses a fresh prompt and the prefix cache is reset between them, so no
iteration is served from the cache. Warm-up iterations run first and are not counted.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from typing import Any, Optional

import torch

from pagedserve.bench.datasets import TextWindows


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    win = TextWindows(tok, random.Random(seed), 2 * length + n, n)
    return [win.take(length) for _ in range(n)]


# -- pagedserve ----------------------------------------------------------------------------
def _engine_one(engine, ids: list[int], max_tokens: int) -> tuple[float, float, float, int]:
    """Run one request alone; returns (t_start, t_first_token, t_last_token, n_tokens) in perf_counter seconds."""
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    engine.add_request(None, {"prompt_token_ids": ids}, sp)
    t_first: Optional[float] = None
    t_last = t0
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            k = len(out.outputs[0].token_ids) if out.outputs else 0
            if k:
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                t_last = now
                n += k
    engine.reset_prefix_cache()
    assert t_first is not None
    return t0, t_first, t_last, n


def latency_pagedserve(args: argparse.Namespace, prompts: list[list[int]], decode_prompts: list[list[int]]) -> dict[str, Any]:
    from pagedserve.bench.throughput import build_engine

    engine = build_engine(args)
    w = args.num_iters_warmup
    ttfts, decode_rates = [], []
    for i, ids in enumerate(prompts):
        t0, t1, _, _ = _engine_one(engine, ids, 1)
        if i >= w:
            ttfts.append(t1 - t0)
    for i, ids in enumerate(decode_prompts):
        _, t1, t2, n = _engine_one(engine, ids, args.output_len)
        if i >= w and n > 1:
            decode_rates.append((n - 1) / (t2 - t1))
    res = _result("pagedserve", args, ttfts, decode_rates)
    res["dtype"] = engine.core.info.dtype
    res["weights_type"] = engine.core.info.weights_type
    res["weight_bytes"] = engine.core.info.weight_bytes
    res["kv_cache_dtype"] = args.kv_cache_dtype
    del engine
    gc.collect()
    return res


# -- HF transformers -----------------------------------------------------------------------
def _hf_one(model, ids: list[int], max_new: int, device) -> list[float]:
    """Timestamps: [start, first new token, ..., last new token]."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    clock = Clock()
    x = torch.tensor([ids], device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
        )
    return [t0] + clock.times[1:]


def latency_hf(args: argparse.Namespace, model_dir: str, prompts: list[list[int]], decode_prompts: list[list[int]]) -> dict[str, Any]:
    from pagedserve.bench.hf_backend import load_hf
    from pagedserve.bench.throughput import _resolve_device_dtype

    device, dtype = _resolve_device_dtype(args)
    model, _ = load_hf(model_dir, dtype, device)
    w = args.num_iters_warmup
    ttfts, decode_rates = [], []
    for i, ids in enumerate(prompts):
        ts = _hf_one(model, ids, 1, device)
        if i >= w:
            ttfts.append(ts[1] - ts[0])
    for i, ids in enumerate(decode_prompts):
        ts = _hf_one(model, ids, args.output_len, device)
        n = len(ts) - 1
        if i >= w and n > 1:
            decode_rates.append((n - 1) / (ts[-1] - ts[1]))
    res = _result("hf", args, ttfts, decode_rates)
    res["dtype"] = str(dtype).replace("torch.", "")
    del model
    gc.collect()
    return res


def _result(backend: str, args: argparse.Namespace, ttfts: list[float], decode_rates: list[float]) -> dict[str, Any]:
    t = _summary(ttfts)
    # Rates from the TTFT statistics, so the median rate is the median TTFT's.
    prefill = {
        "median": args.input_len / t["median"],
        "mean": args.input_len / t["mean"],
        "min": args.input_len / t["max"],
        "max": args.input_len / t["min"],
    }
    return {
        "backend": backend,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "decode_input_len": args.decode_input_len or args.input_len,
        "num_iters": args.num_iters,
        "ttft_s": t,
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": _summary(decode_rates) if decode_rates else None,
    }


def _print(res: dict[str, Any]) -> None:
    tag = f"[{res['backend']}]".ljust(13)
    pf, dec, ttft = res["prefill_tokens_per_s"], res["decode_tokens_per_s"], res["ttft_s"]
    print(
        f"{tag}prefill {res['input_len']} tokens: TTFT {1000 * ttft['median']:.1f} ms median "
        f"({pf['median']:.1f} tok/s; min..max {pf['min']:.1f}..{pf['max']:.1f})"
    )
    if dec:
        print(
            f"{tag}decode {res['output_len']} tokens after a {res['decode_input_len']}-token prompt: {dec['median']:.1f} tok/s median "
            f"({1000 / dec['median']:.1f} ms/token; min..max {dec['min']:.1f}..{dec['max']:.1f})"
        )


def _print_bandwidth_ceiling(res: dict[str, Any], args: argparse.Namespace) -> None:
    """Batch-1 decode streams every weight once per token, so memory read bandwidth sets its
    ceiling: print it (measured now, CPU only) and the decode rate as a share of it."""
    from pagedserve.bench.flops import model_flops
    from pagedserve.bench.throughput import _resolve_device_dtype, load_tokenizer_and_config
    from pagedserve.ops import cpu as cpu_kernels

    dec = res["decode_tokens_per_s"]
    if dec is None or torch.device(_resolve_device_dtype(args)[0]).type != "cpu":
        return
    bw = cpu_kernels.memory_read_bandwidth()
    if bw is None:
        return
    _, _, cfg = load_tokenizer_and_config(args.model)
    mf = model_flops(cfg)
    esize = 2 if res.get("dtype") in ("bfloat16", "float16") else 4
    weight_bytes = (mf.layer_params + mf.lm_head_params) * esize
    if res.get("weight_bytes") and res.get("weights_type") not in ("", "float32", "bfloat16", "float16"):
        weight_bytes = res["weight_bytes"]  # quantized: the bytes the engine holds
    ceiling = bw / weight_bytes
    if getattr(args, "speculative_config", None):
        print(f"{'':13}with draft tokens several tokens share one weight read: the bandwidth ceiling does not apply")
        return
    res["memory_read_gb_per_s"] = bw / 1e9
    res["decode_weight_bytes_per_token"] = weight_bytes
    res["decode_bandwidth_ceiling_tokens_per_s"] = ceiling
    print(
        f"{'':13}memory read bandwidth now {bw / 1e9:.1f} GB/s; {weight_bytes / 1e6:.0f} MB of weights per decode token "
        f"-> ceiling {ceiling:.0f} tok/s; decode at {100 * dec['median'] / ceiling:.0f} % of it"
    )


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="pagedserve", choices=["pagedserve", "hf", "both"], help="engine, HF generate, or both")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated in the decode measurement")
    p.add_argument("--decode-input-len", type=int, default=None, help="prompt tokens of the decode measurement (default: --input-len)")
    p.add_argument("--num-iters", type=int, default=3, help="measured iterations (the median is reported)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured iterations first")
    p.add_argument("--output-json", default=None, help="write the results here")
    # --num-threads (torch CPU threads of the whole benchmark) is the engine flag of EngineConfig.


def cmd_latency(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import _loadavg, apply_num_threads, load_tokenizer_and_config, write_json

    apply_num_threads(args)
    if args.num_iters < 1 or args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--num-iters, --input-len and --output-len must be at least 1")
    model_dir, tok, _ = load_tokenizer_and_config(args.model)
    n = args.num_iters + args.num_iters_warmup
    prompts = _prompts(tok, n, args.input_len, args.seed)
    decode_prompts = _prompts(tok, n, args.decode_input_len or args.input_len, args.seed + 1)
    print(f"Model: {model_dir}; batch 1, {args.num_iters} iterations after {args.num_iters_warmup} warm-up, torch threads {torch.get_num_threads()}")
    results = []
    load_before = _loadavg()
    if args.backend in ("pagedserve", "both"):
        results.append(latency_pagedserve(args, prompts, decode_prompts))
        _print(results[-1])
        _print_bandwidth_ceiling(results[-1], args)
    if args.backend in ("hf", "both"):
        results.append(latency_hf(args, model_dir, prompts, decode_prompts))
        _print(results[-1])
    load_after = _loadavg()
    if load_after is not None:
        print(f"Load average (1 min) before / after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} CPUs")
    if args.output_json:
        payload = {
            "command": "latency",
            "model": model_dir,
            "torch_threads": torch.get_num_threads(),
            "loadavg_1min_before_after": [load_before, load_after],
        }
        write_json(args.output_json, {**payload, "results": results})
    return 0
