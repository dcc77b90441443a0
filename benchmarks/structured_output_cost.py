"""What structured output costs the requests beside it.

W1's 32 requests (prompts 64-512 tokens, 128 output tokens) run together with K companions
that are in every step (prompts of 32 tokens, max_tokens 2,000, so they outlive W1). In one arm
the companions are constrained (a JSON schema whose array can grow long, so the grammar runs
the whole time: a bitmask per companion per step, applied to the logits); in the other they are
the same requests unconstrained, so the batches have the same shape. Reported: output tok/s of
the 32 W1 requests until the last of them finishes, arms interleaved, and the ratio.

    .venv/bin/python benchmarks/structured_output_cost.py [--companions 4] [--rounds 3] [--num-threads 2] [--model DIR]
    .venv/bin/python benchmarks/structured_output_cost.py --tiny    # smoke run: a tiny random model, 4 W1 requests

Appends its figures to benchmarks/results/structured_output_cost.jsonl.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.bench.datasets import add_dataset_args, build_requests
from pagedserve.bench.results import record
from pagedserve.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"log": {"type": "array", "items": {"type": "object", "properties": {
    "t": {"type": "integer"}, "msg": {"type": "string", "maxLength": 40}}, "required": ["t", "msg"]}, "minItems": 400}},
    "required": ["log"]}


def run_arm(llm: LLM, w1, companions: int, constrained: bool, companion_tokens: int = 2000) -> float:
    engine = llm.llm_engine
    w1_ids = []
    for r in w1:
        sp = SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True)
        w1_ids.append(engine.add_request(None, {"prompt_token_ids": r.prompt_token_ids}, sp))
    extra = []
    for i in range(companions):
        sp = SamplingParams(temperature=0.0, max_tokens=companion_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None)
        extra.append(engine.add_request(None, {"prompt_token_ids": w1[i].prompt_token_ids[:32]}, sp))
    pending = set(w1_ids)
    tokens = 0
    t0 = time.perf_counter()
    while pending:
        for out in engine.step():
            if out.request_id in pending and out.finished:
                pending.discard(out.request_id)
                tokens += len(out.outputs[0].token_ids)
            elif out.request_id in extra and out.finished:
                raise RuntimeError("a companion finished before W1: the arms would not compare the same batches")
    elapsed = time.perf_counter() - t0
    engine.abort_request(extra)
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--companions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 4 W1-shaped requests of 4 tokens, one round")
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dataset = argparse.ArgumentParser()
    add_dataset_args(dataset)
    w1_args, companion_tokens = [], 2000  # the defaults are W1
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.rounds, args.companions, companion_tokens = 1, 2, 64
        w1_args = ["--num-prompts", "4", "--min-input-len", "32", "--max-input-len", "64", "--output-len", "4"]
    llm = LLM(args.model, dtype="bfloat16", num_kv_blocks=512 if args.tiny else 4096, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    w1 = build_requests(dataset.parse_args(w1_args), tok, seed=0)
    run_arm(llm, w1[:4], 1, True, companion_tokens)  # warm-up: kernels, the grammar tokenizer
    results = {True: [], False: []}
    for _ in range(args.rounds):
        for constrained in (False, True):
            results[constrained].append(run_arm(llm, w1, args.companions, constrained, companion_tokens))
            print(f"{'constrained' if constrained else 'plain':11s} companions: W1 {results[constrained][-1]:7.1f} output tok/s", flush=True)
    plain, cons = statistics.median(results[False]), statistics.median(results[True])
    print(f"median W1 output tok/s: plain companions {plain:.1f}, constrained {cons:.1f}; ratio {cons / plain:.3f} "
          f"(cost {100 * (1 - cons / plain):.1f} %)")
    record("structured_output_cost", {"companions": args.companions, "rounds": args.rounds, "threads": torch.get_num_threads(),
                                      "w1_tok_s_plain": results[False], "w1_tok_s_constrained": results[True],
                                      "ratio_of_medians": cons / plain}, tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    main()
