"""Bounded step time (issue 15, target 3): the fixed token budget against ``--max-step-ms``.

For each setting, one server (the real app over HTTP on a loopback port, the engine core in its
own process, as ``pagedserve serve`` runs it) and, in this order:

1. **ITL while long prompts arrive**: 16 streaming requests (32-128 prompt tokens, --output-len
   tokens each, greedy, ignore_eos) decode; once all of them stream, --num-long prompts of
   --long-len tokens are sent one after the other (the next when the previous has finished).
   Printed: p50 / p99 / max inter-token latency of the 16 streams (client side, SSE chunk
   arrivals), output tok/s of the whole scenario (streams + long prompts' tokens over its wall
   time), and prefill tok/s of the long prompts beside the decodes (their prompt tokens over
   the sum of their TTFTs).
2. **Prefill alone**: one --long-len prompt with nothing else running (TTFT, tok/s).
3. **Disconnect**: a client sends a --disconnect-len-token prompt (streaming) and goes away
   after 0.3 s, mid-prefill; at once a short request (16 prompt tokens, 16 greedy output tokens,
   not streaming) is sent. Printed: the short request's completion time, --rounds times.

    .venv/bin/python benchmarks/step_time.py                      # fixed budget vs 200 ms
    .venv/bin/python benchmarks/step_time.py --targets 0,100,200,400
    .venv/bin/python benchmarks/step_time.py --targets 0,200:0,200:4 --model DIR   # ms:decode multiple
    .venv/bin/python benchmarks/step_time.py --tiny                    # smoke run: a tiny random model, short scenarios

Every prompt is fresh random token ids (no prefix-cache hits). The engine runs with default
flags but ``max_step_ms`` (0 = off: the fixed 2,048-token budget), ``max_step_decode_multiple``
(after a colon; default 4) and a 1 GiB KV cache. Appends its figures to
benchmarks/results/step_time.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any, Optional

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]  # this checkout's package, and tests/app_utils


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


async def stream(client: Any, model: str, ids: list[int], max_tokens: int, times: Optional[list[float]] = None) -> list[float]:
    """Stream one completion; returns the arrival time of each chunk that carries a token."""
    times = [] if times is None else times
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
    return times


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def itl_scenario(base: str, model: str, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        t0 = time.perf_counter()
        stream_times: list[list[float]] = [[] for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, model, rand_ids(rng, rng.randint(32, 128)), args.output_len, stream_times[i]))
                 for i in range(args.streams)]
        while min(len(t) for t in stream_times) < 3:
            await asyncio.sleep(0.01)
        ttfts = []
        for _ in range(args.num_long):
            sent = time.perf_counter()
            ts = await stream(client, model, rand_ids(rng, args.long_len), 4)
            ttfts.append(ts[0] - sent)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    itls = [1e3 * (b - a) for ts in stream_times for a, b in zip(ts[1:], ts[2:])]
    out_tokens = sum(len(t) for t in stream_times) + 4 * args.num_long
    return {"itl_p50": statistics.median(itls), "itl_p99": pct(itls, 0.99), "itl_max": max(itls),
            "out_tok_s": out_tokens / wall, "prefill_tok_s": args.num_long * args.long_len / sum(ttfts),
            "long_ttft_s": statistics.mean(ttfts), "wall_s": wall}


async def alone_scenario(base: str, model: str, rng: random.Random, args: argparse.Namespace) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        sent = time.perf_counter()
        ts = await stream(client, model, rand_ids(rng, args.long_len), 1)
        return ts[0] - sent


async def disconnect_scenario(base: str, model: str, rng: random.Random, llm: Any, args: argparse.Namespace) -> list[float]:
    import httpx

    done = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for _ in range(args.rounds):
            try:
                await asyncio.wait_for(stream(client, model, rand_ids(rng, args.disconnect_len), 16), 0.3)
                if not args.tiny:
                    raise RuntimeError("the long prompt finished within 0.3 s: make --disconnect-len longer")
            except asyncio.TimeoutError:
                pass  # the client went away mid-prefill
            sent = time.perf_counter()
            body = {"model": model, "prompt": rand_ids(rng, 16), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            done.append(time.perf_counter() - sent)
            while llm.num_unfinished_requests():  # the aborted prompt is gone before the next round
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
    return done


def run_setting(target: float, multiple: float, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from app_utils import serve

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM(EngineConfig(model=args.model, max_step_ms=target, max_step_decode_multiple=multiple,
                                kv_cache_memory_bytes=(64 << 20) if args.tiny else (1 << 30)), engine_process=True)
    rng = random.Random(args.seed)
    try:
        with serve(llm) as base:
            model = llm.served_model_names[0]
            # Warm-up: a long prompt beside a few decodes, so oneDNN's kernels and the step-cost
            # model (when on) have seen both kinds of step.
            async def warm() -> None:
                async with httpx.AsyncClient(base_url=base, timeout=600) as client:
                    await asyncio.gather(*(stream(client, model, rand_ids(rng, 64), 32) for _ in range(2 if args.tiny else 8)),
                                         stream(client, model, rand_ids(rng, args.long_len), 2))
            asyncio.run(warm())
            res: dict[str, Any] = asyncio.run(itl_scenario(base, model, rng, args))
            res["alone_ttft_s"] = min(asyncio.run(alone_scenario(base, model, rng, args)) for _ in range(2))
            res["disconnect_s"] = asyncio.run(disconnect_scenario(base, model, rng, llm, args))
    finally:
        llm.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="0,200", help="max_step_ms values, comma-separated (0 = fixed token budget); "
                    "MS:M also sets max_step_decode_multiple to M (default 4)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--num-long", type=int, default=4)
    ap.add_argument("--disconnect-len", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 4 streams, one 200-token prompt, one round")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.streams, args.output_len, args.long_len, args.num_long, args.disconnect_len, args.rounds = 4, 12, 200, 1, 3000, 1
    results = {}
    for item in args.targets.split(","):
        ms, _, mult = item.partition(":")
        t, m = float(ms), float(mult or 4.0)
        results[t if not mult else item] = r = run_setting(t, m, args)
        label = "fixed budget 2048" if t == 0 else f"max_step_ms {t:g}" + (f", multiple {m:g}" if mult else "")
        print(f"{label:18s} ITL p50 {r['itl_p50']:6.0f} p99 {r['itl_p99']:6.0f} max {r['itl_max']:6.0f} ms | "
              f"output {r['out_tok_s']:5.0f} tok/s | prefill beside decodes {r['prefill_tok_s']:5.0f} tok/s "
              f"(TTFT {r['long_ttft_s']:.2f} s), alone {args.long_len / r['alone_ttft_s']:5.0f} tok/s | "
              f"short request after a disconnect: {', '.join(f'{x:.2f}' for x in r['disconnect_s'])} s", flush=True)
    if 0.0 in results and len(results) > 1:
        f = results[0.0]
        for t, r in results.items():
            if t:
                print(f"max_step_ms {t if isinstance(t, str) else format(t, 'g')} vs fixed: p99 ITL x{r['itl_p99'] / f['itl_p99']:.2f}, output tok/s "
                      f"x{r['out_tok_s'] / f['out_tok_s']:.3f}, prefill tok/s beside decodes x{r['prefill_tok_s'] / f['prefill_tok_s']:.3f}, "
                      f"alone x{f['alone_ttft_s'] / r['alone_ttft_s']:.3f}, worst short request after a disconnect "
                      f"{max(r['disconnect_s']):.2f} s vs {max(f['disconnect_s']):.2f} s")
    from pagedserve.bench.results import record

    record("step_time", {"streams": args.streams, "output_len": args.output_len, "long_len": args.long_len, "num_long": args.num_long,
                         "disconnect_len": args.disconnect_len, "by_target": {str(k): v for k, v in results.items()}},
           tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    main()
