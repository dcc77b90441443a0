"""Overload: what `--max-queued-requests` does to the latency of the requests it admits.

1. Capacity: a closed loop of ``--concurrency`` clients for ``--probe-s`` seconds measures the
   requests per second the engine serves.
2. Open-loop Poisson arrivals at ``--overload`` x that rate for ``--duration-s`` seconds, twice,
   in this order: with ``max_queued_requests`` (refused ones get 503 + Retry-After) and without
   it (the peer: every request queues). Printed for each: admitted, refused, end-to-end latency
   p50 / p99 / max of the admitted ones, and how long the 503s took.

    python benchmarks/overload.py                      # SmolLM2, float32, 4x for 60 s
    python benchmarks/overload.py --duration-s 20 --max-queued 8
    python benchmarks/overload.py --tiny                # smoke run: a tiny random model, seconds

Appends its figures to benchmarks/results/overload.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

BODY = {"prompt": "Write a short story about a lighthouse keeper who finds a message in a bottle.", "max_tokens": 32,
        "ignore_eos": True, "temperature": 0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def closed_loop(base: str, model: str, concurrency: int, seconds: float) -> float:
    import httpx

    done = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        async def client() -> None:
            nonlocal done
            while time.monotonic() < end:
                r = await c.post("/v1/completions", json=dict(BODY, model=model))
                r.raise_for_status()
                done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.monotonic() - t0)


async def open_loop(base: str, model: str, rate: float, seconds: float, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    lat, refused, other = [], [], []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as c:
        async def one() -> None:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=dict(BODY, model=model))
            dt = time.monotonic() - t0
            if r.status_code == 200:
                lat.append(dt)
            elif r.status_code == 503 and r.headers.get("retry-after"):
                refused.append(dt)
            else:
                other.append(r.status_code)

        tasks = []
        t_start = time.monotonic()
        t_next = t_start
        while t_next < t_start + seconds:
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            tasks.append(asyncio.ensure_future(one()))
            t_next += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t_start
    return {"sent": len(tasks), "admitted": len(lat), "refused": len(refused), "other": other, "wall_s": wall,
            "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "max": max(lat, default=float("nan")), "refused_p99": pct(refused, 0.99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--probe-s", type=float, default=20)
    ap.add_argument("--overload", type=float, default=4.0)
    ap.add_argument("--duration-s", type=float, default=60)
    ap.add_argument("--max-queued", type=int, default=16)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 2 s probe, 3 s of at most 30 req/s")
    args = ap.parse_args()
    warm_s, max_rate = 3.0, float("inf")
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.concurrency, args.probe_s, args.duration_s, args.max_queued, warm_s, max_rate = 4, 2.0, 3.0, 4, 0.5, 30.0
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from app_utils import kv_idle, serve, tiny_async_llm

    from pagedserve.entrypoints.openai.server_args import ServerArgs

    llm = tiny_async_llm(args.model, kv_cache_memory_bytes=256 << 20, max_model_len=2048, num_threads=args.num_threads,
                         max_num_seqs=args.concurrency)
    name = llm.served_model_names[0]
    results = {}
    try:
        with serve(llm, ServerArgs(max_queued_requests=args.max_queued)) as base:
            asyncio.run(closed_loop(base, name, args.concurrency, warm_s))  # warm-up
            capacity = asyncio.run(closed_loop(base, name, args.concurrency, args.probe_s))
            rate = min(args.overload * capacity, max_rate)
            print(f"capacity {capacity:.2f} req/s at concurrency {args.concurrency}; offering {rate:.2f} req/s for {args.duration_s:.0f} s")
            results["capped"] = asyncio.run(open_loop(base, name, rate, args.duration_s, 1))
            kv_idle(llm, 120)
        with serve(llm, ServerArgs()) as base:
            results["uncapped"] = asyncio.run(open_loop(base, name, rate, args.duration_s, 1))
            kv_idle(llm, 600)
    finally:
        llm.shutdown()
    for k, r in results.items():
        print(f"{k:9s} sent {r['sent']:5d} admitted {r['admitted']:5d} refused {r['refused']:5d} other {len(r['other'])} | "
              f"admitted latency p50 {r['p50']:6.2f} s p99 {r['p99']:6.2f} s max {r['max']:6.2f} s | "
              f"503 p99 {r['refused_p99'] * 1000:5.1f} ms | run {r['wall_s']:.0f} s")
    c, u = results["capped"], results["uncapped"]
    print(f"uncapped / capped: p99 latency x{u['p99'] / c['p99']:.1f}, max x{u['max'] / c['max']:.1f}")
    from pagedserve.bench.results import record

    record("overload", {"concurrency": args.concurrency, "capacity_req_s": capacity, "offered_req_s": rate, "duration_s": args.duration_s,
                        "max_queued": args.max_queued, "capped": results["capped"], "uncapped": results["uncapped"]},
           tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
