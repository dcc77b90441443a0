"""Data-parallel routing benchmark: a multi-turn chat workload with shared system prompts,
served by ``pagedserve serve`` three ways in one run:

* ``dp2-round-robin``: ``--data-parallel-size 2 --router round-robin``, T threads per replica;
* ``dp2-kv-aware``: ``--data-parallel-size 2 --router kv-aware`` (the default), T threads each;
* ``dp1``: one engine with 2T threads (the same cores, no data parallelism).

Workload: ``--systems`` system prompts of about ``--system-words`` words; under each,
``--users`` users hold a conversation of ``--turns`` turns (each turn sends the whole history:
system prompt, earlier questions and the server's own answers, then a new question), so a turn
shares its prefix with the user's earlier turns and with every user of the same system prompt.
Users run concurrently, a user's turns one after another; ``--max-tokens`` output tokens per
turn (ignore_eos, greedy), streamed.

Reports per configuration: the prefix-cache hit rate (``prefix_cache_hits_total`` /
``prefix_cache_queries_total`` summed over the ``engine`` label, over the run), mean and p90
time to first token, output throughput (tokens/s over the run's wall time), and how the
requests split over the replicas (``request_success_total`` by engine).

    .venv/bin/python benchmarks/dp_routing.py                      # SmolLM2-135M, 1 thread/replica
    .venv/bin/python benchmarks/dp_routing.py --tiny               # smoke run: a tiny random model, 2 x 2 users, 2 turns

Numbers need a quiet machine with at least 2T free cores; this script only measures. Appends its
figures to benchmarks/results/dp_routing.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

WORDS = ("account order refund shipping warranty invoice delivery customer policy product return store manager payment card "
         "discount member address parcel tracking service support battery charger cable screen laptop phone printer router "
         "camera speaker monday friday weekend morning evening holiday quickly politely clearly always never please check "
         "confirm explain escalate verify record").split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, extra: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", *([args.model] if args.model else []), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--served-model-name", "m", "--max-model-len", str(args.max_model_len),
           "--uvicorn-log-level", "warning", *extra]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("PAGEDSERVE_API_KEY", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not come up; see {log_path}")
        time.sleep(0.3)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def metric_sums(base: str) -> dict[str, dict[str, float]]:
    """``{metric: {engine: value}}`` of the counters this benchmark reads."""
    text = httpx.get(base + "/metrics", timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for m in re.finditer(r'^pagedserve:(prefix_cache_hits_total|prefix_cache_queries_total|request_success_total)\{([^}]*)\} (\S+)$',
                         text, re.M):
        engine = re.search(r'engine="(\d+)"', m.group(2))
        key = engine.group(1) if engine else "0"
        out.setdefault(m.group(1), {})[key] = out.get(m.group(1), {}).get(key, 0.0) + float(m.group(3))
    return out


def make_conversations(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(system prompt, the user's questions) per user."""
    rnd = random.Random(args.seed)
    convs = []
    for s in range(args.systems):
        system = f"You are assistant {s} of the ACME company. Rules: " + " ".join(rnd.choice(WORDS) for _ in range(args.system_words))
        for u in range(args.users):
            convs.append((system, [f"User {u} turn {t}: " + " ".join(rnd.choice(WORDS) for _ in range(args.question_words)) + "?"
                                   for t in range(args.turns)]))
    rnd.shuffle(convs)  # users of one system prompt do not arrive together
    return convs


async def chat_turn(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, tokens = None, [], 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"])
            for c in data.get("choices", []):
                delta = c.get("delta", {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(delta)
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text), tokens


async def run_workload(base: str, convs, max_tokens: int) -> tuple[list[float], int, float]:
    ttfts: list[float] = []
    total_tokens = 0

    async def user(system: str, questions: list[str]) -> None:
        nonlocal total_tokens
        messages = [{"role": "system", "content": system}]
        for q in questions:
            messages.append({"role": "user", "content": q})
            ttft, answer, n = await chat_turn(client, base, messages, max_tokens)
            ttfts.append(ttft)
            total_tokens += n
            messages.append({"role": "assistant", "content": answer})

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(user(s, qs) for s, qs in convs))
        return ttfts, total_tokens, time.perf_counter() - t0


def measure(name: str, args: argparse.Namespace, extra: list[str], convs) -> dict:
    proc, base = start_server(args, extra, f"{args.log_dir}/dp_routing_{name}.log")
    try:
        before = metric_sums(base)
        ttfts, tokens, wall = asyncio.run(run_workload(base, convs, args.max_tokens))
        after = metric_sums(base)
    finally:
        stop_server(proc)

    def delta(metric: str) -> dict[str, float]:
        return {e: v - before.get(metric, {}).get(e, 0.0) for e, v in after.get(metric, {}).items()}

    hits, queries = sum(delta("prefix_cache_hits_total").values()), sum(delta("prefix_cache_queries_total").values())
    ttfts.sort()
    return {"config": name, "requests": len(ttfts), "hit_rate": hits / queries if queries else 0.0,
            "ttft_mean_ms": 1000 * statistics.fmean(ttfts), "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "output_tok_s": tokens / wall, "wall_s": wall, "requests_by_engine": delta("request_success_total")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="threads per replica (dp1 gets twice as many)")
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--users", type=int, default=8, help="users per system prompt")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--question-words", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="per replica, bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 2 system prompts x 2 users x 2 turns")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.systems, args.users, args.turns, args.system_words, args.max_tokens = 2, 2, 2, 40, 4
        args.kv_cache_memory = args.kv_cache_memory or 32 << 20
    convs = make_conversations(args)
    dp = ["--data-parallel-size", "2", "--threads-per-replica", str(args.threads)]
    configs = [("dp2-round-robin", dp + ["--router", "round-robin"]), ("dp2-kv-aware", dp + ["--router", "kv-aware"]),
               ("dp1", ["--num-threads", str(2 * args.threads)])]
    results = [measure(name, args, extra, convs) for name, extra in configs]
    print(f"{len(convs)} users x {args.turns} turns, {args.systems} system prompts of ~{args.system_words} words, "
          f"{args.max_tokens} output tokens per turn, {args.threads} thread(s) per replica")
    print(f"{'config':<16} {'hit rate':>8} {'TTFT mean':>10} {'TTFT p90':>9} {'out tok/s':>10}  requests by engine")
    for r in results:
        split = ", ".join(f"{e}: {v:.0f}" for e, v in sorted(r["requests_by_engine"].items()))
        print(f"{r['config']:<16} {r['hit_rate']:>8.1%} {r['ttft_mean_ms']:>8.0f}ms {r['ttft_p90_ms']:>7.0f}ms {r['output_tok_s']:>10.1f}  {split}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    from pagedserve.bench.results import record

    record("dp_routing", {"users": len(convs), "turns": args.turns, "systems": args.systems, "system_words": args.system_words,
                          "max_tokens": args.max_tokens, "threads_per_replica": args.threads, "dtype": args.dtype, "configs": results},
           tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
