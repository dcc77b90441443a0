"""Soak: thousands of random requests against the real server app, then the checks.

Requests mix completions and chat, streaming or not, random prompt lengths, max_tokens, n,
stop strings, greedy or sampled (temperature / top_p / top_k / seed), some with a deadline;
some are aborted (the client gives up after a random delay) or disconnect mid-stream. Afterwards:
no request left and every KV block free, no growth of open file descriptors or threads after
warm-up, RSS before/after printed, and every completed greedy answer equal to the offline
engine's answer for the same prompt ids.

    python benchmarks/soak.py --requests 3000 --concurrency 32          # SmolLM2, float32
    python benchmarks/soak.py --requests 3000 --model /path/to/model

    python benchmarks/soak.py --tiny                                    # smoke run: a tiny random model, 24 requests

tests/e2e/test_soak.py runs the CI-sized version (a tiny random model, 300 requests). Appends its
figures to benchmarks/results/soak.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

WORDS = ("the cat sat on a mat while seven quick brown foxes jumped over lazy dogs and then "
         "everyone went home to eat bread with honey under the old oak tree near the river").split()
STOPS = ["the", "and", ".", "\n", "dog", "tree"]


@dataclass
class Spec:
    """One random request: its route and body, and what the client does."""
    route: str
    body: dict[str, Any]
    action: str  # "complete", "abort" (give up after abort_after_s) or "disconnect" (after k chunks)
    abort_after_s: float = 0.0
    disconnect_after: int = 0
    greedy: bool = False


@dataclass
class Figures:
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    disconnected: int = 0
    timeouts: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    greedy_checked: int = 0
    greedy_mismatched: list[str] = field(default_factory=list)
    greedy_near_ties: list[str] = field(default_factory=list)

    def merge(self, other: "Figures") -> None:
        for k in ("sent", "completed", "aborted", "disconnected", "timeouts", "greedy_checked"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.statuses.items():
            self.statuses[k] = self.statuses.get(k, 0) + v


def process_figures(settle_s: float = 3.0) -> dict[str, int]:
    """Open fds, OS threads and RSS (KiB) of this process, once the fd count has stopped
    falling (up to ``settle_s``: the server closes its side of finished connections a moment
    after the client, and garbage holds sockets until collected)."""
    import gc

    gc.collect()
    deadline, last, same = time.monotonic() + settle_s, -1, 0
    while time.monotonic() < deadline and same < 5:
        n = len(os.listdir("/proc/self/fd"))
        same = same + 1 if n == last else 0
        last = n
        time.sleep(0.1)
    status = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            status[k] = v.strip()
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": int(status["Threads"]), "rss_kib": int(status["VmRSS"].split()[0])}


def random_spec(rng: random.Random, model: str, max_prompt_words: int, max_tokens: int) -> Spec:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_prompt_words)))
    greedy = rng.random() < 0.5
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5}
    if greedy:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice([0.5, 1.0, 1.3]), top_p=rng.choice([1.0, 0.9, 0.5]), top_k=rng.choice([-1, 5, 50]))
        if rng.random() < 0.5:
            body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.05:
        body["timeout"] = rng.choice([0.01, 0.05, 0.2])
    if rng.random() < 0.5:
        route, body["prompt"] = "/v1/completions", words
    else:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    roll = rng.random()
    action = "abort" if roll < 0.1 else "disconnect" if roll < 0.2 and body["stream"] else "complete"
    return Spec(route, body, action, abort_after_s=rng.uniform(0.0, 0.3), disconnect_after=rng.randint(1, 4),
                greedy=greedy and "timeout" not in body)


async def send(client: Any, spec: Spec, figs: Figures) -> Optional[list[str]]:
    """Send one request; returns its choices' texts when it completed, else None."""
    figs.sent += 1
    chat = spec.route.endswith("chat/completions")

    async def full() -> Optional[list[str]]:
        if not spec.body["stream"]:
            r = await client.post(spec.route, json=spec.body)
            figs.statuses[r.status_code] = figs.statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                raise AssertionError(f"{spec.route} {spec.body} -> {r.status_code} {r.text[:300]}")
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            figs.timeouts += sum(c["finish_reason"] == "timeout" for c in choices)
            return [c["message"]["content"] if chat else c["text"] for c in choices]
        texts: dict[int, str] = {}
        chunks = 0
        async with client.stream("POST", spec.route, json=spec.body) as r:
            figs.statuses[r.status_code] = figs.statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                raise AssertionError(f"{spec.route} {spec.body} -> {r.status_code}")
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise AssertionError(f"{spec.route} {spec.body} -> error event {event}")
                chunks += 1
                if spec.action == "disconnect" and chunks >= spec.disconnect_after:
                    figs.disconnected += 1
                    return None
                for c in event["choices"]:
                    delta = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    texts[c["index"]] = texts.get(c["index"], "") + (delta or "")
                    figs.timeouts += c.get("finish_reason") == "timeout"
            if not done:
                raise AssertionError(f"{spec.route} {spec.body}: stream ended without [DONE]")
        return [texts.get(i, "") for i in range(spec.body.get("n", 1))]

    try:
        out = await (asyncio.wait_for(full(), spec.abort_after_s) if spec.action == "abort" else full())
    except asyncio.TimeoutError:
        figs.aborted += 1
        return None
    if out is not None:
        figs.completed += 1
    return out


async def run_soak(base: str, model: str, num_requests: int, concurrency: int, seed: int, max_prompt_words: int,
                   max_tokens: int, on_progress: Any = None) -> tuple[Figures, list[tuple[Spec, list[str]]]]:
    """Send ``num_requests`` random requests, at most ``concurrency`` at once. Returns the
    figures and the completed greedy requests with their texts."""
    import httpx

    rng = random.Random(seed)
    specs = [random_spec(rng, model, max_prompt_words, max_tokens) for _ in range(num_requests)]
    figs = Figures()
    greedy: list[tuple[Spec, list[str]]] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i, s in enumerate(specs):
        queue.put_nowait((i, s))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i, spec = queue.get_nowait()
                out = await send(client, spec, figs)
                if out is not None and spec.greedy:
                    greedy.append((spec, out))
                if on_progress is not None:
                    on_progress(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return figs, greedy


NEAR_TIE_NATS = 1e-4


def check_greedy(base: str, offline: Any, greedy: list[tuple[Spec, list[str]]], figs: Figures) -> None:
    """Compare each completed greedy answer with the offline engine's for the same prompt ids
    (the server's /tokenize renders them as the request did).

    A float32 matmul sums in an order that depends on the batch's shape, so two greedy runs of
    one prompt in different batches can part where the top two tokens are within about 1e-6
    nats. A difference is counted as a near-tie, not a mismatch, only when the offline run's
    first token off the server's text had a runner-up within ``NEAR_TIE_NATS`` and the server's
    text continues with that runner-up."""
    import httpx

    from pagedserve import SamplingParams

    prompts, params, wants = [], [], []
    for spec, texts in greedy:
        b = spec.body
        tok = {"model": b["model"], "messages": b["messages"]} if "messages" in b else {"model": b["model"], "prompt": b["prompt"]}
        ids = httpx.post(base + "/tokenize", json=tok, timeout=60).json()["tokens"]
        prompts.append({"prompt_token_ids": ids})
        params.append(SamplingParams(temperature=0, max_tokens=b["max_tokens"], stop=b.get("stop"), ignore_eos=b.get("ignore_eos", False),
                                     logprobs=2))
        wants.append(texts)
    outs = offline.generate(prompts, params, use_tqdm=False)
    tokenizer = offline.get_tokenizer()
    for (spec, texts), out in zip(greedy, outs):
        figs.greedy_checked += 1
        ref = out.outputs[0]
        bad = [t for t in texts if t != ref.text]
        if not bad:
            continue
        if all(near_tie(tokenizer, ref, t) for t in bad):
            figs.greedy_near_ties.append(f"{spec.route} {spec.body}: server {bad!r} offline {ref.text!r}")
        else:
            figs.greedy_mismatched.append(f"{spec.route} {spec.body}: server {texts!r} offline {ref.text!r}")


def near_tie(tokenizer: Any, ref: Any, server_text: str) -> bool:
    """True when ``server_text`` follows ``ref`` up to a token where the offline run's runner-up
    was within ``NEAR_TIE_NATS`` of its choice and the server took that runner-up."""
    for i, tid in enumerate(ref.token_ids):
        prefix = tokenizer.decode(ref.token_ids[:i + 1], skip_special_tokens=True)
        if server_text.startswith(prefix):
            continue
        lps = ref.logprobs[i]
        chosen = lps[tid].logprob
        for alt, lp in lps.items():
            if alt != tid and chosen - lp.logprob < NEAR_TIE_NATS:
                if server_text.startswith(tokenizer.decode(ref.token_ids[:i] + [alt], skip_special_tokens=True)):
                    return True
        return False
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-prompt-words", type=int, default=200)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6, help="split the requests into rounds; figures printed after each")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 24 requests at 8 clients, one round")
    args = ap.parse_args()
    warm = 100
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.requests, args.concurrency, args.rounds, args.max_tokens, args.max_prompt_words, warm = 24, 8, 1, 8, 40, 8
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from app_utils import kv_idle, serve, tiny_async_llm

    from pagedserve import LLM

    llm = tiny_async_llm(args.model, kv_cache_memory_bytes=256 << 20, max_model_len=2048, num_threads=args.num_threads)
    name = llm.served_model_names[0]
    try:
        with serve(llm) as base:
            warm_figs, _ = asyncio.run(run_soak(base, name, warm, args.concurrency, args.seed + 1, args.max_prompt_words, args.max_tokens))
            kv_idle(llm, 60)
            before = process_figures()
            t0 = time.monotonic()
            figs, greedy, rounds = Figures(), [], []
            per_round = -(-args.requests // args.rounds)
            for r in range(args.rounds):
                n = min(per_round, args.requests - r * per_round)
                f, g = asyncio.run(run_soak(base, name, n, args.concurrency, args.seed + 1000 * r, args.max_prompt_words, args.max_tokens))
                figs.merge(f)
                greedy += g
                kv_idle(llm, 60)
                rounds.append(process_figures())
                print(f"round {r + 1}/{args.rounds}: {figs.sent} requests so far, fds {rounds[-1]['fds']}, threads "
                      f"{rounds[-1]['threads']}, RSS {rounds[-1]['rss_kib'] / 1024:.0f} MiB", flush=True)
            wall = time.monotonic() - t0
            after = rounds[-1]
            stats = llm.get_stats()
            offline = LLM(args.model, dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048, num_threads=args.num_threads)
            check_greedy(base, offline, greedy, figs)
    finally:
        llm.shutdown()
    print(f"soak: {figs.sent} requests in {wall:.0f} s (concurrency {args.concurrency}): {figs.completed} completed, "
          f"{figs.aborted} aborted, {figs.disconnected} disconnected, {figs.timeouts} choices timed out; statuses {figs.statuses}")
    print(f"KV blocks free after: {stats.num_free_blocks}/{stats.num_total_blocks}")
    print(f"after warm-up: fds {before['fds']} -> {after['fds']}, threads {before['threads']} -> {after['threads']}, "
          f"RSS {before['rss_kib'] / 1024:.0f} -> {after['rss_kib'] / 1024:.0f} MiB")
    ties = len(figs.greedy_near_ties)
    print(f"greedy answers equal to offline: {figs.greedy_checked - len(figs.greedy_mismatched) - ties}/{figs.greedy_checked}, "
          f"{ties} parted at a near-tie (runner-up within {NEAR_TIE_NATS:g} nats), {len(figs.greedy_mismatched)} mismatched")
    for m in figs.greedy_near_ties[:3]:
        print("  NEAR-TIE", m[:400])
    for m in figs.greedy_mismatched[:5]:
        print("  MISMATCH", m)
    from pagedserve.bench.results import record

    record("soak", {"requests": figs.sent, "concurrency": args.concurrency, "wall_s": wall, "completed": figs.completed,
                    "aborted": figs.aborted, "disconnected": figs.disconnected, "timeouts": figs.timeouts,
                    "statuses": {str(k): v for k, v in dict(figs.statuses).items()},
                    "blocks_free": [stats.num_free_blocks, stats.num_total_blocks], "before": before, "after": after,
                    "greedy_checked": figs.greedy_checked, "greedy_near_ties": ties, "greedy_mismatched": len(figs.greedy_mismatched)},
           tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})
    return 1 if figs.greedy_mismatched or stats.num_free_blocks != stats.num_total_blocks else 0


if __name__ == "__main__":
    raise SystemExit(main())
