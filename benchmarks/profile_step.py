"""Where one engine step spends its time at N running requests (default 64, all decoding).

Splits wall time of a step into: schedule (core), prepare inputs (flat batch, slot mapping,
attention metadata), model forward (incl. logits), sampling, and update + detokenize
(frontend). The issue-5 target is "CPU time outside the model forward under 10 % of the step".

    .venv/bin/python benchmarks/profile_step.py [--num-requests 64] [--prompt-len 256] [--steps 20] [--model DIR]
    .venv/bin/python benchmarks/profile_step.py --tiny      # smoke run: a tiny random model, seconds

Appends its figures to benchmarks/results/profile_step.jsonl.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.bench.results import record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 8 requests, 3 steps")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.num_requests, args.prompt_len, args.steps = 8, 32, 3

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=(32 << 20) if args.tiny else (1 << 30), max_num_seqs=args.num_requests, enable_prefix_caching=False)
    eng = llm.llm_engine
    runner = eng.core.worker.model_runner
    rng = random.Random(0)
    for _ in range(args.num_requests):
        ids = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        eng.add_request(None, {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in eng.core.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()

    # Wrap the pieces with timers (same objects the engine calls).
    timings = {k: 0.0 for k in ("schedule", "prepare+forward+sample", "forward", "sample")}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            timings[name] += time.perf_counter() - t
            return out

        return wrapper

    sched = eng.core.scheduler
    runner.model.forward = timed("forward", runner.model.forward)
    runner.model.compute_logits = timed("forward", runner.model.compute_logits)  # logits count as forward
    runner.sampler.forward = timed("sample", runner.sampler.forward)
    sched.schedule = timed("schedule", sched.schedule)
    runner.execute_model = timed("prepare+forward+sample", runner.execute_model)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    total = time.perf_counter() - t0
    # update+detok = step total minus the rest
    other = total - timings["schedule"] - timings["prepare+forward+sample"]
    prep = timings["prepare+forward+sample"] - timings["forward"] - timings["sample"]
    n = args.steps
    print(f"{args.num_requests} running requests, {args.dtype}, {torch.get_num_threads()} threads, {n} decode steps")
    print(f"step time            {1e3 * total / n:8.2f} ms  ({args.num_requests * n / total:.0f} tok/s)")
    rows = [
        ("schedule", timings["schedule"]),
        ("prepare inputs", prep),
        ("model forward+logits", timings["forward"]),
        ("sampling", timings["sample"]),
        ("update + detokenize", other),
    ]
    for name, v in rows:
        print(f"  {name:20s} {1e3 * v / n:8.2f} ms  {100 * v / total:5.1f} %")
    outside = total - timings["forward"]
    print(f"outside the forward  {1e3 * outside / n:8.2f} ms  {100 * outside / total:5.1f} % of the step")
    record("profile_step", {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "steps": n, "dtype": args.dtype,
                            "threads": torch.get_num_threads(), "step_ms": 1e3 * total / n,
                            "parts_ms": {name: 1e3 * v / n for name, v in rows}, "outside_forward_share": outside / total},
           tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})
    eng.abort_request(list(eng.output_processor.request_states))


if __name__ == "__main__":
    main()
