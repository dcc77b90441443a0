"""Tensor parallelism's step time: TP = 1, 2, 3 on one model (default SmolLM2-135M), each rank
with --threads-per-rank torch threads (default 1), measured on the engine core directly (no
server, no tokenizer in the loop).

Two steps are timed for each size:
- **decode**: --batch (8) requests of 32 random prompt tokens decode together; the median of
  --decode-steps (32) steps after every request has finished its prefill;
- **prefill**: one --prefill-len (512) token prompt of fresh random ids, alone, in one step
  (the token budget is raised to fit it); the median of --rounds (5).

Printed: a table with each size's milliseconds and its ratio to TP=1 (below 1 = faster). On a
box whose cores one replica already uses, TP only adds all-reduce time (two per layer, on
loopback gloo); see the README's "Tensor parallelism" section.

    .venv/bin/python benchmarks/tp_step_time.py
    .venv/bin/python benchmarks/tp_step_time.py --sizes 1,3 --dtype float32
    .venv/bin/python benchmarks/tp_step_time.py --tiny     # smoke run: a tiny random model, TP 1 and 2, a few steps

Appends its figures to benchmarks/results/tp_step_time.jsonl.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's package


def measure(args: argparse.Namespace, tp: int) -> tuple[float, float]:
    from pagedserve.config import EngineConfig
    from pagedserve.core.outputs import EngineCoreRequest
    from pagedserve.engine.core import EngineCore
    from pagedserve.sampling_params import SamplingParams

    config = EngineConfig(model=args.model, dtype=args.dtype, tensor_parallel_size=tp, num_threads=tp * args.threads_per_rank,
                          enable_prefix_caching=False, max_num_batched_tokens=max(2048, args.prefill_len),
                          max_model_len=args.prefill_len + 64 + args.decode_steps, kv_cache_memory_bytes=256 << 20)
    core = EngineCore(config)
    rng = random.Random(0)
    vocab = core.worker.hf_config.vocab_size
    def ids(k: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(k)]

    n = 0

    def add(prompt_len: int, max_tokens: int) -> None:
        nonlocal n
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"r{n}", ids(prompt_len), params, [], time.monotonic()))
        n += 1

    def timed_step() -> float:
        t0 = time.perf_counter()
        core.step()
        return 1e3 * (time.perf_counter() - t0)

    try:
        for _ in range(args.batch):
            add(32, args.decode_steps + 4)
        core.step()  # every prompt in one step (32 x batch tokens under the budget)
        core.step()
        decode = statistics.median(timed_step() for _ in range(args.decode_steps))
        while core.has_unfinished_requests():
            core.step()
        prefills = []
        for _ in range(args.rounds):
            add(args.prefill_len, 1)
            prefills.append(timed_step())
            while core.has_unfinished_requests():
                core.step()
        return decode, statistics.median(prefills)
    finally:
        core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sizes", default="1,2,3", help="tensor-parallel sizes (each must divide the head counts)")
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, TP 1,2, batch 2, 3 decode steps, a 32-token prefill")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.sizes, args.batch, args.decode_steps, args.prefill_len, args.rounds = "1,2", 2, 3, 32, 1
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = {}
    for tp in sizes:
        try:
            rows[tp] = measure(args, tp)
        except ValueError as e:  # a size the model's heads do not divide
            print(f"TP={tp}: skipped: {e}")
    if not rows:
        return
    base = rows.get(1)
    print(f"\nload average before the table: {os.getloadavg()[0]:.2f}")
    print(f"{'TP':>3} | {'decode x' + str(args.batch) + ' (ms)':>18} | {'ratio':>6} | {'prefill ' + str(args.prefill_len) + ' (ms)':>18} | {'ratio':>6}")
    print("-" * 64)
    for tp, (dec, pre) in rows.items():
        rd = f"{dec / base[0]:.2f}" if base else "-"
        rp = f"{pre / base[1]:.2f}" if base else "-"
        print(f"{tp:>3} | {dec:>18.2f} | {rd:>6} | {pre:>18.2f} | {rp:>6}")
    from pagedserve.bench.results import record

    record("tp_step_time", {"dtype": args.dtype, "threads_per_rank": args.threads_per_rank, "batch": args.batch,
                            "prefill_len": args.prefill_len, "by_tp": {tp: {"decode_ms": d, "prefill_ms": p} for tp, (d, p) in rows.items()}},
           tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    main()
