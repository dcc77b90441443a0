"""Batch-1 prefill and decode of llama.cpp and pagedserve in the same minutes, alternating.

This box's memory bandwidth swings by 2x from minute to minute (see "Batch-1 decode and the
bandwidth ceiling" in docs/perf-history.md), so a peer's number from another day says little;
this script measures llama.cpp (through llama-cpp-python) next to `pagedserve bench latency`
on the same weights in bf16, and prints the memory read bandwidth of each round.

llama-cpp-python is not a project dependency. One way to get it and a BF16 GGUF of SmolLM2:

    python3 -m venv /tmp/llvenv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llvenv/bin/pip install llama-cpp-python   # builds llama.cpp (~15 min on 2 cores)
    # convert pagedserve's dequantized HF copy (add "architectures": ["LlamaForCausalLM"] to a
    # copy of its config.json) with llama.cpp's converter from the llama-cpp-python sdist:
    .venv/bin/python vendor/llama.cpp/convert_hf_to_gguf.py DIR --outtype bf16 --outfile smol-bf16.gguf

    /tmp/llvenv/bin/python benchmarks/compare_llamacpp.py --gguf smol-bf16.gguf [--rounds 3]

With `--llama-bench PATH` it also runs llama.cpp's own `llama-bench -p 512 -n 128` (pure C,
no sampling, and its tg128 decodes from an empty context: llama.cpp's best case), built from
the same sources: `cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build
--target llama-bench` in the sdist's vendor/llama.cpp (`benchmarks/llamacpp_setup.sh build` does both,
and its outputs, `$LLAMACPP_CACHE/bin/llama-bench` and `$LLAMACPP_CACHE/smollm2-bf16.gguf`, are the
defaults of `--llama-bench` and `--gguf` when they exist). Without `--gguf` only llama-bench runs;
with neither, pagedserve alone.

    .venv/bin/python benchmarks/compare_llamacpp.py --tiny    # smoke run: a tiny random model, llama.cpp only where given

`--tiny` runs llama.cpp only when `--gguf` names a GGUF of the tiny model. Appends its figures to
benchmarks/results/compare_llamacpp.jsonl.

The llama-cpp-python side runs in the interpreter given (it needs only llama_cpp); the
pagedserve side runs `.venv/bin/pagedserve bench latency --dtype bfloat16` as a subprocess. Prompts for
llama.cpp are windows of the same English text, tokenized by llama.cpp; decode tok/s =
(n - 1) / time from the first generated token to the last, greedy, EOS ignored, like
`bench latency`.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMACPP_CACHE = os.environ.get("LLAMACPP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-llamacpp"))


def _text() -> str:
    import pydoc_data.topics

    return "\n".join(pydoc_data.topics.topics.values())[:100_000]


def llamacpp_latency(gguf: str, input_len: int, output_len: int, threads: int, iters: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=input_len + output_len + 16, n_threads=threads, n_threads_batch=threads, n_batch=input_len, verbose=False)
    ids = llm.tokenize(_text().encode(), add_bos=False)
    ttfts, rates = [], []
    for i in range(iters + 1):  # the first is a warm-up
        prompt = ids[i * input_len : (i + 1) * input_len]
        llm.reset()
        t0 = time.perf_counter()
        times = []
        for n, _tok in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            times.append(time.perf_counter())
            if n + 1 >= output_len:
                break
        if i == 0:
            continue
        ttfts.append(times[0] - t0)
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    return {"ttft_ms": 1000 * statistics.median(ttfts), "prefill_tok_s": input_len / statistics.median(ttfts), "decode_tok_s": statistics.median(rates)}


def llama_bench(path: str, gguf: str, input_len: int, output_len: int, threads: int) -> dict:
    out = subprocess.run(
        [path, "-m", gguf, "-p", str(input_len), "-n", str(output_len), "-t", str(threads), "-r", "3", "-o", "csv"],
        capture_output=True, text=True, check=True,
    ).stdout
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(out)))
    by = {("pp" if int(r["n_prompt"]) else "tg"): float(r["avg_ts"]) for r in rows}
    return {"prefill_tok_s": by["pp"], "decode_tok_s": by["tg"]}


def pagedserve_latency(input_len: int, output_len: int, iters: int, model=None, tiny: bool = False) -> dict:
    exe = os.path.join(ROOT, ".venv", "bin", "pagedserve")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "pagedserve.entrypoints.cli"]
    cmd += ["bench", "latency", "--dtype", "bfloat16", "--input-len", str(input_len), "--output-len", str(output_len), "--num-iters", str(iters)]
    cmd += (["--model", model] if model else []) + (["--num-iters-warmup", "1", "--kv-cache-memory", "32000000"] if tiny else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    pre = re.search(r"prefill \d+ tokens: TTFT ([\d.]+) ms median \(([\d.]+) tok/s", out)
    dec = re.search(r"decode \d+ tokens .*?: ([\d.]+) tok/s median", out)
    bw = re.search(r"memory read bandwidth now ([\d.]+) GB/s", out)
    return {"ttft_ms": float(pre.group(1)), "prefill_tok_s": float(pre.group(2)), "decode_tok_s": float(dec.group(1)), "bandwidth_gb_s": float(bw.group(1)) if bw else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="BF16 GGUF of the same model, for llama.cpp (default: $LLAMACPP_CACHE/smollm2-bf16.gguf if there)")
    ap.add_argument("--llama-bench", default=None, help="path of a llama-bench binary: run it too (default: $LLAMACPP_CACHE/bin/llama-bench if there)")
    ap.add_argument("--no-python-bindings", action="store_true", help="skip llama-cpp-python (llama-bench only)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--iters", type=int, default=3, help="measured iterations per round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two engines")
    ap.add_argument("--model", default=None, help="pagedserve's model (default: SmolLM2-135M-Instruct; the GGUF must hold the same weights)")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 32-token prompt, 8 tokens, one round")
    args = ap.parse_args()
    if args.tiny:
        sys.path.insert(0, ROOT)
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.input_len, args.output_len, args.iters, args.rounds = 32, 8, 1, 1
    elif args.gguf is None and os.path.exists(os.path.join(LLAMACPP_CACHE, "smollm2-bf16.gguf")) and args.model is None:
        args.gguf = os.path.join(LLAMACPP_CACHE, "smollm2-bf16.gguf")
    if args.llama_bench is None and os.path.exists(os.path.join(LLAMACPP_CACHE, "bin", "llama-bench")):
        args.llama_bench = os.path.join(LLAMACPP_CACHE, "bin", "llama-bench")
    use_bench = bool(args.llama_bench and args.gguf)
    use_python = bool(args.gguf and not args.no_python_bindings)
    if use_python:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            if not args.tiny:
                raise SystemExit("llama-cpp-python is not installed in this interpreter: see the top of this file, or --no-python-bindings")
            use_python = False
    if not (use_bench or use_python):
        print("no llama.cpp side here (no --gguf, or neither llama-bench nor llama-cpp-python): pagedserve alone")
    print(f"batch 1, {args.input_len}-token prompts, {args.output_len} output tokens, {args.threads} threads, median of {args.iters}")
    rounds = []
    for r in range(args.rounds):
        peers = {}
        if use_bench:
            peers["llama-bench"] = llama_bench(args.llama_bench, args.gguf, args.input_len, args.output_len, args.threads)
        if use_python:
            peers["llama-cpp-python"] = llamacpp_latency(args.gguf, args.input_len, args.output_len, args.threads, args.iters)
        ps = pagedserve_latency(args.input_len, args.output_len, args.iters, args.model, args.tiny)
        rounds.append({"pagedserve": ps, **peers})
        bw = f"{ps['bandwidth_gb_s']:.1f} GB/s" if ps["bandwidth_gb_s"] else "n/a"
        print(f"round {r + 1} (memory read {bw}): pagedserve prefill {ps['prefill_tok_s']:.0f} tok/s, decode {ps['decode_tok_s']:.1f} tok/s")
        for name, lc in peers.items():
            print(
                f"    {name:17s} prefill {lc['prefill_tok_s']:.0f} tok/s, decode {lc['decode_tok_s']:.1f} tok/s"
                f" -> pagedserve / it: prefill {ps['prefill_tok_s'] / lc['prefill_tok_s']:.2f}x, decode {ps['decode_tok_s'] / lc['decode_tok_s']:.2f}x"
            )
        sys.stdout.flush()
    sys.path.insert(0, ROOT)
    from pagedserve.bench.results import record

    record("compare_llamacpp", {"input_len": args.input_len, "output_len": args.output_len, "threads": args.threads, "iters": args.iters,
                                "rounds": rounds}, tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct", "gguf": args.gguf})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
