"""``pagedserve bench throughput``: offline throughput, every request submitted at once.

Backends:
    pagedserve  one LLMEngine; all requests are added, then ``step()`` runs until they finish.
    hf          HF transformers ``generate`` on the same requests in static batches of
                ``--hf-batch-size`` (left padding; each batch makes as many tokens as its longest
                request asks for, EOS suppressed with ``min_new_tokens``), same weights, same dtype.
    both        both in one process, then the ratio pagedserve / hf.

EOS is ignored everywhere (greedy decoding), so each backend produces exactly the requested
number of tokens per request. Token counts are the requested (useful) ones: the extra tokens
HF makes for the shorter requests of a batch are its static-batching cost, not throughput.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch

from pagedserve.bench.datasets import SampleRequest, build_requests, describe
from pagedserve.bench.flops import ModelFlops, model_flops, peak_flops_for
from pagedserve.bench.hf_backend import hf_generate_batch, hf_pad_id, load_hf

logger = logging.getLogger("pagedserve.bench")


@dataclass
class BackendResult:
    backend: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    total_tokens_per_s: float = 0.0
    model_flops: float = 0.0
    achieved_flops_per_s: float = 0.0
    mfu: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def finish(self, flops: ModelFlops, forward_tokens: int, peak: Optional[float]) -> "BackendResult":
        e = self.elapsed_s
        self.requests_per_s = self.num_requests / e
        self.output_tokens_per_s = self.output_tokens / e
        self.total_tokens_per_s = (self.prompt_tokens + self.output_tokens) / e
        self.model_flops = flops.flops(forward_tokens, self.output_tokens)
        self.achieved_flops_per_s = self.model_flops / e
        self.mfu = self.achieved_flops_per_s / peak if peak else None
        return self

    def summary(self) -> str:
        mfu = f", MFU {100 * self.mfu:.1f}%" if self.mfu is not None else ""
        return (
            f"Throughput: {self.requests_per_s:.2f} requests/s, {self.output_tokens_per_s:.1f} output tok/s, "
            f"{self.total_tokens_per_s:.1f} total tok/s ({self.elapsed_s:.1f} s; {self.achieved_flops_per_s / 1e9:.1f} GFLOP/s{mfu})"
        )


def _forward_tokens(requests: Sequence[SampleRequest], cached_tokens: int = 0) -> int:
    return sum(r.prompt_len for r in requests) - cached_tokens + sum(max(0, r.expected_output_len - 1) for r in requests)


def _percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    vs = sorted(values)
    p99 = vs[min(len(vs) - 1, int(round(0.99 * (len(vs) - 1))))]
    return {"mean_ms": 1000 * statistics.fmean(vs), "median_ms": 1000 * statistics.median(vs), "p99_ms": 1000 * p99}


# -- pagedserve --------------------------------------------------------------------------
def build_engine(args: argparse.Namespace):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_cli_args(args))


def run_engine_requests(engine, requests: Sequence[SampleRequest], detokenize: bool = True) -> tuple[float, list]:
    """Submit every request, step until all finish; returns (elapsed seconds, outputs in order)."""
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams

    ids: list[str] = []
    done: dict[str, Any] = {}
    t0 = time.perf_counter()
    for r in requests:
        sp = SamplingParams(
            max_tokens=r.expected_output_len, temperature=0.0, ignore_eos=True, detokenize=detokenize, output_kind=RequestOutputKind.FINAL_ONLY
        )
        ids.append(engine.add_request(None, {"prompt_token_ids": r.prompt_token_ids}, sp))
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    except BaseException:
        engine.abort_request(ids)
        raise
    elapsed = time.perf_counter() - t0
    return elapsed, [done[i] for i in ids]


def warm_up_engine(engine, requests: Sequence[SampleRequest]) -> None:
    """One short request through the whole path (kernel selection, allocator, first-call costs);
    its prompt is not a prefix of any benchmark prompt, and the prefix cache is reset after."""
    from pagedserve.bench.datasets import SampleRequest as SR

    ids = list(reversed(requests[0].prompt_token_ids[-16:])) or [1]
    run_engine_requests(engine, [SR(ids, "", 2)], detokenize=False)
    engine.reset_prefix_cache()


def run_pagedserve(
    args: argparse.Namespace, requests: Sequence[SampleRequest], flops: ModelFlops, peak: Optional[float], engine=None
) -> BackendResult:
    engine = engine or build_engine(args)
    if not args.no_warmup:
        warm_up_engine(engine, requests)
    before = engine.get_stats()
    elapsed, outs = run_engine_requests(engine, requests, detokenize=not args.disable_detokenize)
    stats = engine.get_stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(r.expected_output_len for r in requests)
    if out_tokens != expected:
        logger.warning("pagedserve produced %d output tokens, %d requested", out_tokens, expected)
    cached = sum(o.num_cached_tokens for o in outs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics and o.metrics.first_token_time]
    e2els = [o.metrics.finished_time - o.metrics.arrival_time for o in outs if o.metrics and o.metrics.finished_time]
    res = BackendResult("pagedserve", elapsed, len(requests), sum(r.prompt_len for r in requests), out_tokens)
    res.extra = {
        "dtype": engine.core.info.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "device": engine.core.info.device,
        "num_kv_blocks": engine.core.info.num_blocks,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_step_ms": engine.config.max_step_ms,
        "prefix_cached_prompt_tokens": cached,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "num_preemptions": stats.num_preemptions - before.num_preemptions,
        "ttft": _percentiles_ms(ttfts),
        "e2el": _percentiles_ms(e2els),
    }
    return res.finish(flops, _forward_tokens(requests, cached), peak)


def run_hf(
    args: argparse.Namespace, requests: Sequence[SampleRequest], flops: ModelFlops, peak: Optional[float], model_dir: str, dtype, device
) -> BackendResult:
    model, tok = load_hf(model_dir, dtype, device)
    pad = hf_pad_id(model, tok)
    bs = max(1, args.hf_batch_size)
    if not args.no_warmup:
        warm = requests[0]
        hf_generate_batch(model, pad, [SampleRequest(warm.prompt_token_ids[:16], "", 2)], device)
    made = 0
    t0 = time.perf_counter()
    for i in range(0, len(requests), bs):
        batch = requests[i : i + bs]
        made += hf_generate_batch(model, pad, batch, device) * len(batch)
    elapsed = time.perf_counter() - t0
    useful = sum(r.expected_output_len for r in requests)
    res = BackendResult("hf", elapsed, len(requests), sum(r.prompt_len for r in requests), useful)
    res.extra = {"dtype": str(dtype).replace("torch.", ""), "device": str(device), "hf_batch_size": bs, "generated_tokens_incl_batch_padding": made}
    del model
    return res.finish(flops, _forward_tokens(requests), peak)


# -- the command ---------------------------------------------------------------------------


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="pagedserve", choices=["pagedserve", "hf", "both"], help="both: one after the other, then the ratio")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf backend")
    p.add_argument(
        "--hf-dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of the hf backend (default: --dtype); e.g. float32 on a CPU without bf16 arithmetic, HF's faster dtype there",
    )
    p.add_argument("--disable-detokenize", action="store_true", help="pagedserve: do not detokenize outputs")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up request of each backend")
    p.add_argument("--peak-tflops", type=float, default=None, help="matmul peak for MFU (TFLOP/s); default: measured")
    p.add_argument("--peak-measure-seconds", type=float, default=1.0, help="time spent measuring the matmul peak")
    p.add_argument("--output-json", default=None, help="write the results here")
    # --num-threads (torch CPU threads of the whole benchmark) is the engine flag of EngineConfig.


def _resolve_device_dtype(args: argparse.Namespace):
    from pagedserve.model import loader

    dev = args.device
    device = torch.device("cuda" if (dev == "auto" and torch.cuda.is_available()) else ("cpu" if dev == "auto" else dev))
    return device, loader.resolve_dtype(args.dtype, device)


def load_tokenizer_and_config(model: Optional[str]):
    from pagedserve.model import loader

    model_dir = loader.resolve_model(model)
    return model_dir, loader.load_tokenizer(model_dir), loader.load_config(model_dir)


def apply_num_threads(args: argparse.Namespace) -> None:
    if getattr(args, "num_threads", None):
        if args.num_threads < 1:
            raise SystemExit("--num-threads must be at least 1")
        torch.set_num_threads(args.num_threads)


def cmd_throughput(args: argparse.Namespace) -> int:
    from pagedserve.model import loader

    apply_num_threads(args)
    model_dir, tok, hf_config = load_tokenizer_and_config(args.model)
    device, dtype = _resolve_device_dtype(args)
    requests = build_requests(args, tok, args.seed)
    flops = model_flops(hf_config)
    print(f"Model: {model_dir} ({dtype_name(dtype)} on {device}, torch threads {torch.get_num_threads()})")
    print(f"Workload: {args.dataset_name}: {describe(requests)}")
    if getattr(args, "speculative_config", None):
        print(f"Speculative decoding: {args.speculative_config} (MFU counts the output tokens' FLOPs, not rejected drafts')")
    load_before = _loadavg()
    peak = peak_flops_for(hf_config, dtype, device, args.peak_measure_seconds, args.peak_tflops)
    results: dict[str, BackendResult] = {}
    if args.backend in ("pagedserve", "both"):
        results["pagedserve"] = run_pagedserve(args, requests, flops, peak)
        print(f"[pagedserve] done in {results['pagedserve'].elapsed_s:.1f} s")
        gc.collect()
    if args.backend in ("hf", "both"):
        hf_dtype = dtype if args.hf_dtype is None else loader.resolve_dtype(args.hf_dtype, device)
        if hf_dtype != dtype:
            print(f"[hf] runs in {dtype_name(hf_dtype)} (--hf-dtype)")
        results["hf"] = run_hf(args, requests, flops, peak, model_dir, hf_dtype, device)
        print(f"[hf] done in {results['hf'].elapsed_s:.1f} s")
        gc.collect()
    if not args.peak_tflops:
        # Measured again after the runs and the best kept: on a shared machine a single
        # measurement easily catches a busy moment and inflates MFU.
        peak = max(peak, peak_flops_for(hf_config, dtype, device, args.peak_measure_seconds))
        for r in results.values():
            r.mfu = r.achieved_flops_per_s / peak
    how = (
        "given"
        if args.peak_tflops
        else f"best measured, [256 x {hf_config.hidden_size}] @ [{hf_config.hidden_size} x {hf_config.intermediate_size}] and neighbours"
    )
    print(f"Peak matmul rate ({dtype_name(dtype)}, {how}): {peak / 1e9:.1f} GFLOP/s")
    for name, r in results.items():
        print(f"{('[' + name + ']').ljust(13)}{r.summary()}")
    load_after = _loadavg()
    if load_after is not None:
        print(f"Load average (1 min) before / after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} CPUs")
    ratio = None
    if "pagedserve" in results and "hf" in results:
        ratio = results["pagedserve"].output_tokens_per_s / results["hf"].output_tokens_per_s
        print(f"pagedserve / hf output tok/s: {ratio:.2f}x")
    if args.output_json:
        payload = {
            "command": "throughput",
            "model": model_dir,
            "dtype": dtype_name(dtype),
            "hf_dtype": args.hf_dtype,
            "device": str(device),
            "dataset": args.dataset_name,
            "num_prompts": len(requests),
            "total_prompt_tokens": sum(r.prompt_len for r in requests),
            "total_output_tokens": sum(r.expected_output_len for r in requests),
            "seed": args.seed,
            "peak_flops_per_s": peak,
            "peak_measured": not args.peak_tflops,
            "model_flops_params": flops.as_dict(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_1min_before_after": [load_before, load_after],
            "results": {k: asdict(v) for k, v in results.items()},
            "ratio_output_tokens_per_s": ratio,
        }
        write_json(args.output_json, payload)
    return 0


def _loadavg() -> Optional[float]:
    """1-minute load average: on a shared machine, how much the numbers can be trusted."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def write_json(path: str, payload: Any) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2)
    print(f"Results written to {path}")
