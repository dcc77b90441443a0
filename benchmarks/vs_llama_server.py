"""pagedserve vs llama.cpp's llama-server on the same requests, in interleaved rounds (issue 15).

This box's speed drifts from minute to minute (see "Batch-1 decode and the bandwidth ceiling"
in docs/perf-history.md), so every figure here is measured next to its peer: each round runs
the offline pagedserve run, `pagedserve serve`, then llama-server (the reverse every other round:
a steady drift then favours neither side over two rounds), then for 1b the batch-1 figures, one
process at a time (each server is started, warmed up with N short requests at once, measured,
and stopped before the next starts). Before each side a 1 s matmul probe (cpu_probe_gflops)
records the host's speed: two figures compare only where their probes agree. The same token-id
prompts (W1's: windows of real English text, 64-512 tokens, tokenized with SmolLM2's tokenizer,
seed 0) go to both servers through one closed-loop client
(benchmarks/bench_procs.py): ``/v1/completions``, non-streaming (``--stream`` streams), greedy,
EOS ignored, ``max_tokens`` = the output length, N requests in flight; output tok/s = completion tokens /
(last response - first send). Every response must report exactly the output length.

Scenarios:
    w1-http  target 2: SmolLM2-135M (pagedserve's default model), W1's 32 requests at 32
             clients: `pagedserve serve` vs llama-server BF16 (32 slots, continuous batching),
             and the offline `pagedserve bench throughput --backend pagedserve` on the same
             requests; per round: HTTP / offline and pagedserve / llama-server.
    1b       target 5: the random 1.1B model of build_1b_model.py, the first 16 of W1's
             requests at 16 clients (16 slots); then batch 1: `pagedserve bench latency`
             (prefill 512, decode 128) vs `llama-bench -p 512 -n 128` (pp512, tg128), with
             the memory read bandwidth `bench latency` measures and the decode ceiling it implies.

MFU of an HTTP run = 2 x matmul params x tokens through the model (prompt tokens as the server
counted them + every output token but the last, the LM head once per output token) / wall
time / the matmul peak (the offline run's for w1-http; measured here, 1 s, between runs for 1b).

    benchmarks/llamacpp_setup.sh build && benchmarks/llamacpp_setup.sh smollm2
    .venv/bin/python benchmarks/vs_llama_server.py --scenario w1-http [--rounds 3] [--output-json F]
    .venv/bin/python benchmarks/build_1b_model.py --gguf
    .venv/bin/python benchmarks/vs_llama_server.py --scenario 1b [--rounds 3] [--output-json F]
    .venv/bin/python benchmarks/vs_llama_server.py --tiny       # smoke run: w1-http on a tiny random model, 4 requests

``--tiny`` runs the llama-server side only when llama-server is built and ``--gguf`` names the
tiny model's GGUF; otherwise it says so and measures pagedserve alone. Appends its figures to
benchmarks/results/vs_llama_server.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_procs import Server, cpu_probe_gflops, free_port, llama_bench, llama_server, model_name, run_load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "pagedserve.entrypoints.cli"]
LLAMACPP_CACHE = os.environ.get("LLAMACPP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-llamacpp"))
MODEL_1B = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-bench", "llama-1b-shapes")
WARMUP_TEXT = "the quick brown fox jumps over the lazy dog."


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _run_json(cmd: list[str], out_json: str, log: str) -> dict:
    """Run a pagedserve bench command (its stdout to ``log``) and return its --output-json."""
    with open(log, "wb") as fh:
        p = subprocess.run(cmd + ["--output-json", out_json], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=_env())
    if p.returncode:
        with open(log, errors="replace") as fh:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{fh.read()[-3000:]}")
    with open(out_json) as fh:
        return json.load(fh)


def _env() -> dict:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


# -- the two servers -------------------------------------------------------------------------
def _quant_args(args: argparse.Namespace, model: Optional[str]) -> list[str]:
    """pagedserve's --quantization: as --quantization says; by default "none" for the default
    model (its Q4_1 file dequantized, the weights of llama-server's BF16 conversion), else the
    checkpoint's own (a quantized GGUF given to both engines runs quantized on both)."""
    q = args.quantization if args.quantization is not None else ("none" if model is None else None)
    return ["--quantization", q] if q else []


def pagedserve_server(args: argparse.Namespace, model: Optional[str], log_dir: str) -> Server:
    port = free_port()
    cmd = CLI + ["serve"] + ([model] if model else []) + [
        "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--num-threads", str(args.threads),
        "--max-num-seqs", str(max(64, args.concurrency)), "--uvicorn-log-level", "warning",
    ] + (["--kv-cache-memory", "32000000"] if args.tiny else []) + _quant_args(args, model) + shlex.split(args.pagedserve_args)
    return Server("pagedserve", cmd, port, log_dir, env=_env(), cwd=ROOT)


def measure_http(server: Server, prompts: list, args: argparse.Namespace) -> dict:
    """Start ``server``, warm it up, run the load once, stop it; the LoadResult as a dict."""
    with server:
        server.wait_ready(args.start_timeout)
        name = model_name(server.url)
        # Warm-up at the run's batch size (short distinct prompts, no prefix W1 shares).
        warm = [f"Warm-up request {i}, not measured: {WARMUP_TEXT}" for i in range(args.concurrency)]
        run_load(server.url, name, warm, min(8, args.output_len), args.concurrency, stream=args.stream)
        res = run_load(server.url, name, prompts, args.output_len, args.concurrency, stream=args.stream).as_dict()
    res["loadavg_1min_after"] = _loadavg()
    return res


def http_mfu(res: dict, flops, peak: Optional[float]) -> Optional[float]:
    if not peak:
        return None
    n_out = res["total_completion_tokens"]
    forward = res["total_prompt_tokens"] + n_out - res["num_requests"]
    return flops.flops(forward, n_out) / res["elapsed_s"] / peak


# -- rounds ----------------------------------------------------------------------------------
def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def run_rounds(args: argparse.Namespace) -> dict:
    import torch

    from pagedserve.bench.datasets import sample_random
    from pagedserve.bench.flops import model_flops, peak_flops_for
    from pagedserve.model import loader
    from pagedserve.model.loader import resolve_dtype

    one_b = args.scenario == "1b"
    model = args.model or (MODEL_1B if one_b else None)
    gguf = args.gguf or (os.path.join(MODEL_1B, "model-bf16.gguf") if one_b else os.path.join(LLAMACPP_CACHE, "smollm2-bf16.gguf"))
    if args.tiny and not args.gguf:
        gguf = None
    missing = [(path, hint) for path, hint in ((gguf, "benchmarks/llamacpp_setup.sh smollm2 (or build_1b_model.py --gguf)"),
                                              (os.path.join(args.llama_bin, "llama-server"), "benchmarks/llamacpp_setup.sh build"))
               if path is None or not os.path.exists(path)]
    with_llama = not missing
    for path, hint in missing:
        if not args.tiny:
            raise SystemExit(f"{path} not found: run {hint}")
        print(f"--tiny: no llama.cpp side ({path or 'no --gguf'} not found: {hint}); pagedserve alone")
    model_dir = loader.resolve_model(model)
    tok, cfg = loader.load_tokenizer(model_dir), loader.load_config(model_dir)
    flops = model_flops(cfg)
    # W1 as `bench throughput` builds it (same sampler, same seed); the first N of them are sent.
    w1 = sample_random(tok, args.num_prompts, (args.min_input_len, args.max_input_len), (args.output_len, args.output_len), args.seed)
    requests = w1[: args.num_requests]
    prompts = [r.prompt_token_ids if args.prompt_format == "ids" else r.prompt for r in requests]
    sent_prompt_tokens = sum(r.prompt_len for r in requests)
    torch.set_num_threads(args.threads)
    print(f"scenario {args.scenario}: {model_dir} (pagedserve, --dtype {args.dtype}) vs {gguf} (llama-server), {args.threads} threads each")
    print(f"{len(requests)} of W1's {len(w1)} requests (seed {args.seed}), {sent_prompt_tokens} prompt tokens "
          f"({min(r.prompt_len for r in requests)}-{max(r.prompt_len for r in requests)}) as {args.prompt_format}, "
          f"{args.output_len} output tokens each, {args.concurrency} concurrent clients, {args.rounds} rounds")
    log_dir = tempfile.mkdtemp(prefix="vs_llama_server-")
    print(f"logs: {log_dir}")
    rounds: list[dict[str, Any]] = []
    out = {"scenario": args.scenario, "model": model_dir, "gguf": gguf, "dtype": args.dtype, "threads": args.threads, "num_requests": len(requests),
           "concurrency": args.concurrency, "output_len": args.output_len, "prompt_format": args.prompt_format, "stream": args.stream,
           "sent_prompt_tokens": sent_prompt_tokens, "model_flops_params": flops.as_dict(), "log_dir": log_dir, "rounds": rounds}
    for i in range(args.rounds):
        r: dict[str, Any] = {"round": i + 1, "loadavg_1min_before": _loadavg(), "probe_gflops": {}}
        peak = None

        def offline() -> None:
            nonlocal peak
            cmd = CLI + ["bench", "throughput", "--backend", "pagedserve", "--dtype", args.dtype, "--num-threads", str(args.threads),
                         "--num-prompts", str(args.num_prompts), "--min-input-len", str(args.min_input_len),
                         "--max-input-len", str(args.max_input_len), "--output-len", str(args.output_len), "--seed", str(args.seed)]
            cmd += (["--model", model] if model else []) + _quant_args(args, model)
            cmd += (["--kv-cache-memory", "32000000", "--peak-measure-seconds", "0.2"] if args.tiny else [])
            off = _run_json(cmd, os.path.join(log_dir, f"offline-{i + 1}.json"), os.path.join(log_dir, f"offline-{i + 1}.log"))
            if off["total_prompt_tokens"] != sum(q.prompt_len for q in w1):
                raise RuntimeError(f"offline run built other requests ({off['total_prompt_tokens']} prompt tokens, expected {sum(q.prompt_len for q in w1)})")
            r["pagedserve_offline"] = off["results"]["pagedserve"]
            peak = off["peak_flops_per_s"]

        # pagedserve's HTTP run sits next to both its peers, and the order turns round every other
        # round, so that a steady drift of the host favours each side equally over pairs of rounds.
        servers = {"pagedserve_http": lambda: pagedserve_server(args, model, log_dir), "llama_server_http": lambda: llama_server(args, gguf, log_dir)}
        order = ([] if one_b or args.no_offline else ["pagedserve_offline"]) + ["pagedserve_http"] + (["llama_server_http"] if with_llama else [])
        r["order"] = order = order if i % 2 == 0 else order[::-1]
        for k in order:
            r["probe_gflops"][k] = cpu_probe_gflops()
            if k == "pagedserve_offline":
                offline()
            else:
                r[k] = measure_http(servers[k](), prompts, args)
        if one_b:
            peak = peak_flops_for(cfg, resolve_dtype(args.dtype, torch.device("cpu")), "cpu", 1.0)
            if not args.no_batch1 and with_llama:
                cmd = CLI + ["bench", "latency", "--dtype", args.dtype, "--num-threads", str(args.threads), "--input-len", str(args.batch1_input_len),
                             "--output-len", str(args.output_len), "--num-iters", str(args.iters)] + (["--model", model] if model else []) + _quant_args(args, model)
                lat = _run_json(cmd, os.path.join(log_dir, f"latency-{i + 1}.json"), os.path.join(log_dir, f"latency-{i + 1}.log"))
                r["pagedserve_batch1"] = lat["results"][0]
                r["llama_bench"] = llama_bench(args, gguf)
        r["peak_flops_per_s"] = peak
        for k in ("pagedserve_http", "llama_server_http"):
            if k in r:
                r[k]["mfu"] = http_mfu(r[k], flops, peak)
        _print_round(r, sent_prompt_tokens)
        rounds.append(r)
        out["summary"] = _summary(rounds)
        if args.output_json:  # after every round: a failure later keeps the rounds done
            with open(args.output_json, "w") as fh:
                json.dump(out, fh, indent=2)
    return out


def _print_round(r: dict, sent: int) -> None:
    ps, ll = r["pagedserve_http"], r.get("llama_server_http")
    label = {"pagedserve_offline": "offline", "pagedserve_http": "serve", "llama_server_http": "llama-server"}
    probe = ", ".join(f"{label[k]} {v:.1f}" for k, v in r["probe_gflops"].items())
    print(f"round {r['round']} (load {r['loadavg_1min_before']:.2f} before; in this order, the host's speed just before each: {probe} GFLOP/s):")
    for name, x in (("pagedserve serve", ps), ("llama-server", ll)):
        if x is None:
            continue
        note = "" if x["total_prompt_tokens"] == sent else f" (server counted {x['total_prompt_tokens']} prompt tokens, {sent} sent)"
        print(f"    {name:17s} HTTP {x['output_tokens_per_s']:8.1f} output tok/s ({x['elapsed_s']:.2f} s, MFU {_pct(x['mfu'])}){note}")
    if ll is not None:
        print(f"    pagedserve / llama-server (HTTP): {ps['output_tokens_per_s'] / ll['output_tokens_per_s']:.2f}x")
    off = r.get("pagedserve_offline")
    if off:
        print(f"    pagedserve offline  {off['output_tokens_per_s']:8.1f} output tok/s ({off['elapsed_s']:.2f} s, MFU {_pct(off.get('mfu'))});"
              f" HTTP / offline {ps['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}")
    b1, lb = r.get("pagedserve_batch1"), r.get("llama_bench")
    if b1 and lb:
        pf, dec = b1["prefill_tokens_per_s"]["median"], b1["decode_tokens_per_s"]["median"]
        bw, ceil = b1.get("memory_read_gb_per_s"), b1.get("decode_bandwidth_ceiling_tokens_per_s")
        ceil_s = f"; memory read {bw:.1f} GB/s, {b1['decode_weight_bytes_per_token'] / 1e6:.0f} MB/token -> ceiling {ceil:.1f} tok/s" if ceil else ""
        print(f"    batch 1: pagedserve prefill {pf:.0f} tok/s, decode {dec:.2f} tok/s | llama-bench pp {lb['pp_tok_s']:.0f}, tg {lb['tg_tok_s']:.2f}"
              f" | pagedserve / llama-bench: prefill {pf / lb['pp_tok_s']:.2f}x, decode {dec / lb['tg_tok_s']:.2f}x{ceil_s}")
        if ceil:
            print(f"    decode at {100 * dec / ceil:.0f} % (pagedserve) / {100 * lb['tg_tok_s'] / ceil:.0f} % (llama-bench) of the ceiling")
    sys.stdout.flush()


def _summary(rounds: list[dict]) -> dict:
    ps = [r["pagedserve_http"]["output_tokens_per_s"] for r in rounds]
    out: dict[str, Any] = {"pagedserve_http_tok_s": ps}
    if all("llama_server_http" in r for r in rounds):
        ll = [r["llama_server_http"]["output_tokens_per_s"] for r in rounds]
        out.update(llama_server_http_tok_s=ll, ratio_http=[a / b for a, b in zip(ps, ll)])
    if all("pagedserve_offline" in r for r in rounds):
        off = [r["pagedserve_offline"]["output_tokens_per_s"] for r in rounds]
        out.update(pagedserve_offline_tok_s=off, ratio_http_over_offline=[a / b for a, b in zip(ps, off)])
    if all("llama_bench" in r for r in rounds):
        out["ratio_decode"] = [r["pagedserve_batch1"]["decode_tokens_per_s"]["median"] / r["llama_bench"]["tg_tok_s"] for r in rounds]
        out["ratio_prefill"] = [r["pagedserve_batch1"]["prefill_tokens_per_s"]["median"] / r["llama_bench"]["pp_tok_s"] for r in rounds]
    out["median"] = {k: _median(v) for k, v in list(out.items())}
    return out


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every Server's stop()


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, _terminate)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=["w1-http", "1b"], default=None, help="required; --tiny: w1-http")
    ap.add_argument("--model", default=None, help="pagedserve model (default: SmolLM2 for w1-http, ~/.cache/pagedserve-bench/llama-1b-shapes for 1b)")
    ap.add_argument("--gguf", default=None, help="the same weights as a GGUF (default: the setup script's / build_1b_model.py's)")
    ap.add_argument("--llama-bin", default=os.path.join(LLAMACPP_CACHE, "bin"), help="folder of llama-server and llama-bench (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine (default: 2)")
    ap.add_argument("--quantization", default=None, choices=["none", "int8"],
                    help="pagedserve's --quantization (default: none for the default model, whose BF16 conversion llama-server runs; else the checkpoint's own)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"],
                    help="pagedserve's --dtype (default: bfloat16; float32 on a CPU without bf16 compute, where the GGUF stays BF16)")
    ap.add_argument("--num-prompts", type=int, default=32, help="W1's size (the requests are built as for this many)")
    ap.add_argument("--num-requests", type=int, default=None, help="how many of them are sent, the first ones (default: all for w1-http, 16 for 1b)")
    ap.add_argument("--concurrency", type=int, default=None, help="clients in flight = llama-server slots (default: --num-requests)")
    ap.add_argument("--min-input-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-format", choices=["ids", "text"], default="ids", help="send token ids (default; the same prompt tokens to both) or their text")
    ap.add_argument("--stream", action="store_true", help="stream the responses (stream_options.include_usage), as bench serve does")
    ap.add_argument("--batch1-input-len", type=int, default=512, help="1b: prompt of the batch-1 prefill (llama-bench -p)")
    ap.add_argument("--iters", type=int, default=3, help="1b: batch-1 iterations (bench latency --num-iters, llama-bench -r)")
    ap.add_argument("--no-offline", action="store_true", help="w1-http: skip the offline bench throughput run")
    ap.add_argument("--no-batch1", action="store_true", help="1b: skip bench latency and llama-bench")
    ap.add_argument("--pagedserve-args", default="", help="extra flags of pagedserve serve")
    ap.add_argument("--llama-server-args", default="", help="extra flags of llama-server")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: w1-http on a tiny random model, 4 requests of 4 tokens, one round")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.scenario = args.scenario or "w1-http"
        args.model = args.model or tiny_model_dir()
        args.rounds, args.num_prompts, args.min_input_len, args.max_input_len, args.output_len = 1, 4, 16, 64, 4
        args.start_timeout = min(args.start_timeout, 300.0)
    if args.scenario is None:
        ap.error("--scenario is required (w1-http or 1b)")
    if args.num_requests is None:
        args.num_requests = min(16, args.num_prompts) if args.scenario == "1b" else args.num_prompts
    if not 1 <= args.num_requests <= args.num_prompts:
        raise SystemExit("--num-requests must be in 1..--num-prompts")
    if args.scenario == "w1-http" and args.num_requests != args.num_prompts and not args.no_offline:
        raise SystemExit("w1-http compares with the offline run of all --num-prompts requests: leave --num-requests out")
    args.concurrency = args.concurrency or args.num_requests
    args.llama_bin = os.path.expanduser(args.llama_bin)
    t0 = time.time()
    out = run_rounds(args)
    med = out["summary"]["median"]
    print("median over rounds: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items() if v is not None) + f" ({time.time() - t0:.0f} s in all)")
    if args.output_json:
        print(f"results: {args.output_json}")
    from pagedserve.bench.results import record

    record("vs_llama_server", {k: v for k, v in out.items() if k not in ("log_dir",)}, tiny=args.tiny)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
