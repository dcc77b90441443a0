"""Prefix-caching benchmark: a shared-prefix workload with caching on versus off, in one run.

Workload (issue 3): 8 system prompts of ~400 tokens, 16 questions of ~40 tokens under each
(128 chat requests), 64 output tokens each (ignore_eos, greedy), all submitted at once through
``LLM.generate``. Reports, for caching off and on: total wall time, mean time to first token
(``metrics.first_token_time - metrics.arrival_time``), prefill tokens actually computed, the
measured prefix-cache hit rate, and the off/on ratios. Greedy outputs of the two runs are
compared too.

    .venv/bin/python benchmarks/prefix_caching.py                # SmolLM2-135M-Instruct, bf16
    .venv/bin/python benchmarks/prefix_caching.py --threads 1 --dtype float32
    .venv/bin/python benchmarks/prefix_caching.py --tiny       # smoke run: a tiny random model, seconds

It takes minutes on a 2-core CPU; tests/entrypoints/test_benchmark_scripts.py runs its ``--tiny`` mode.
Appends its figures to benchmarks/results/prefix_caching.jsonl.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.bench.results import record

WORDS = (
    "account order refund shipping warranty invoice delivery customer policy product return "
    "store manager payment card discount member address parcel tracking service support team "
    "battery charger cable screen laptop phone tablet printer router camera speaker headset "
    "monday tuesday friday weekend morning evening holiday season quickly politely clearly "
    "always never only also please check confirm explain escalate apologise verify record"
).split()


def make_workload(llm: LLM, num_systems: int, num_questions: int, sys_tokens: int, q_tokens: int, seed: int):
    """Chat prompts as token ids: ``num_systems`` distinct system prompts of about
    ``sys_tokens`` tokens, each followed by ``num_questions`` distinct questions of about
    ``q_tokens`` tokens."""
    rnd = random.Random(seed)
    tok = llm.get_tokenizer()

    def text_of(n_tokens: int, head: str) -> str:
        words = head.split()
        while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) < n_tokens:
            words.append(rnd.choice(WORDS))
        return " ".join(words)

    prompts = []
    for s in range(num_systems):
        system = text_of(sys_tokens, f"You are support assistant number {s} of the ACME company. Follow these rules:")
        for q in range(num_questions):
            question = text_of(q_tokens, f"Question {q}:") + "?"
            conv = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            prompts.append({"prompt_token_ids": llm.apply_chat_template(conv)})
    return prompts


def run(llm: LLM, prompts, params: SamplingParams, first_wave: int) -> dict:
    before = llm.stats()
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.monotonic() - t0
    after = llm.stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(
        total_s=total,
        mean_ttft_s=statistics.mean(ttft),
        p50_ttft_s=statistics.median(ttft),
        # The first max_num_seqs requests start at once; later ones also queue behind their
        # decodes, which caching does not shorten.
        first_wave_ttft_s=statistics.mean(ttft[:first_wave]),
        prompt_tokens=prompt_tokens,
        # Prompt tokens actually run through the model: all of them minus the cache hits.
        computed_prefill_tokens=prompt_tokens - hits,
        output_tokens=out_tokens,
        hit_rate=hits / queries if queries else 0.0,
        hits=hits,
        preemptions=after.num_preemptions - before.num_preemptions,
        token_ids=[o.outputs[0].token_ids for o in outs],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per engine")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 2 x 3 requests, 4 output tokens")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.systems, args.questions, args.system_tokens, args.question_tokens, args.output_tokens = 2, 3, 48, 8, 4
        args.kv_cache_memory, args.max_num_seqs = 32 << 20, 8
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {}
    for caching in (False, True):
        engines[caching] = LLM(
            args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_memory, max_model_len=2048,
            max_num_seqs=args.max_num_seqs, enable_prefix_caching=caching,
        )
    prompts = make_workload(engines[True], args.systems, args.questions, args.system_tokens, args.question_tokens, args.seed)
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for llm in engines.values():  # warm up kernels and allocator, then start from a cold cache
        llm.generate([{"prompt_token_ids": list(range(100, 164))}], warm, use_tqdm=False)
        assert llm.reset_prefix_cache()

    print(
        f"workload: {len(prompts)} requests = {args.systems} system prompts x {args.questions} questions, "
        f"prompt {min(lens)}-{max(lens)} tokens (mean {statistics.mean(lens):.0f}), {args.output_tokens} output tokens, "
        f"dtype {args.dtype}, torch threads {torch.get_num_threads()}, max_num_seqs {args.max_num_seqs}"
    )
    res = {}
    for caching in (False, True):
        r = res[caching] = run(engines[caching], prompts, params, args.max_num_seqs)
        print(
            f"caching {'on ' if caching else 'off'}: total {r['total_s']:7.1f} s, mean TTFT {r['mean_ttft_s']:7.2f} s "
            f"(p50 {r['p50_ttft_s']:.2f} s, first {args.max_num_seqs}: {r['first_wave_ttft_s']:.2f} s), prefill computed {r['computed_prefill_tokens']}/{r['prompt_tokens']} tokens, "
            f"hit rate {100 * r['hit_rate']:.1f}%, preemptions {r['preemptions']}, "
            f"{r['output_tokens'] / r['total_s']:.1f} output tok/s"
        )
    off, on = res[False], res[True]
    same = sum(a == b for a, b in zip(off["token_ids"], on["token_ids"]))
    print(
        f"off/on: total time {off['total_s'] / on['total_s']:.2f}x, mean TTFT {off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x "
        f"(first {args.max_num_seqs}: {off['first_wave_ttft_s'] / on['first_wave_ttft_s']:.2f}x), "
        f"prefill tokens {off['computed_prefill_tokens'] / max(1, on['computed_prefill_tokens']):.2f}x; "
        f"identical greedy outputs: {same}/{len(prompts)}"
    )
    keep = ("total_s", "mean_ttft_s", "p50_ttft_s", "first_wave_ttft_s", "prompt_tokens", "computed_prefill_tokens", "output_tokens",
            "hit_rate", "preemptions")
    record("prefix_caching", {
        "requests": len(prompts), "systems": args.systems, "questions": args.questions, "output_tokens": args.output_tokens,
        "dtype": args.dtype, "threads": torch.get_num_threads(), "caching_off": {k: off[k] for k in keep},
        "caching_on": {k: on[k] for k in keep}, "identical_outputs": same,
    }, tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    main()
