"""Does a long prompt stall streaming users? (issue 5, chunked prefill target)

16 requests are decoding when a 2,000-token prompt arrives. We record the time every one of
the 16 streams receives each token and report their inter-token latency (ITL) with chunked
prefill (token budget --budget, default 256) against the same run without chunking (the whole
prompt in one step). Target: p99 ITL with chunking <= 1/3 of the p99 without.

    .venv/bin/python benchmarks/chunked_prefill_itl.py [--budget 256] [--long-len 2000] [--model DIR]
    .venv/bin/python benchmarks/chunked_prefill_itl.py --tiny      # smoke run: a tiny random model, seconds

Appends its figures to benchmarks/results/chunked_prefill_itl.jsonl.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedserve import LLM, SamplingParams
from pagedserve.bench.results import record


def run(chunked: bool, budget: int, long_len: int, num_streams: int, out_len: int, model=None, tiny: bool = False) -> dict:
    llm = LLM(
        model,
        dtype="bfloat16",
        kv_cache_memory_bytes=(64 << 20) if tiny else (512 << 20),
        max_model_len=4096,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget if chunked else 4096,
        enable_prefix_caching=False,
    )
    eng = llm.llm_engine
    rng = random.Random(0)
    stream_ids = []
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i in range(num_streams):
        ids = [rng.randrange(100, 40000) for _ in range(rng.randint(32, 128))]
        stream_ids.append(eng.add_request(f"s{i}", {"prompt_token_ids": ids}, params))
    token_times: dict[str, list[float]] = {rid: [] for rid in stream_ids}
    step = 0
    long_added = None
    long_first_token = None
    while eng.has_unfinished_requests():
        if step == (3 if tiny else 10):  # streams are decoding by now
            ids = [rng.randrange(100, 40000) for _ in range(long_len)]
            eng.add_request("long", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            long_added = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in token_times:
                token_times[o.request_id].append(now)
            elif o.request_id == "long" and long_first_token is None:
                long_first_token = now
        step += 1
    itls = []
    for ts in token_times.values():
        ts = ts[2 if tiny else 5:]  # skip the prefill and first decodes of the streams themselves
        itls += [b - a for a, b in zip(ts, ts[1:])]
    itls.sort()
    return {
        "p50_ms": 1e3 * statistics.median(itls),
        "p99_ms": 1e3 * itls[int(0.99 * (len(itls) - 1))],
        "max_ms": 1e3 * itls[-1],
        "long_ttft_ms": 1e3 * (long_first_token - long_added),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=256, help="token budget per step with chunked prefill")
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--num-streams", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 4 streams, a 300-token prompt")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.budget, args.long_len, args.num_streams, args.output_len = 64, 300, 4, 12
    res = {}
    for chunked in (False, True):
        res[chunked] = r = run(chunked, args.budget, args.long_len, args.num_streams, args.output_len, args.model, args.tiny)
        label = f"chunked prefill (budget {args.budget})" if chunked else "no chunking"
        print(f"{label:32s} ITL p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  max {r['max_ms']:7.1f} ms  "
              f"long prompt TTFT {r['long_ttft_ms']:7.0f} ms")
    ratio = res[True]["p99_ms"] / res[False]["p99_ms"]
    print(f"p99 ITL chunked / unchunked = {ratio:.2f} (target <= 0.33)")
    record("chunked_prefill_itl", {"budget": args.budget, "long_len": args.long_len, "num_streams": args.num_streams,
                                   "chunked": res[True], "unchunked": res[False], "p99_ratio": ratio},
           tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    main()
