"""The int8 KV cache against the bf16 one on SmolLM2 (bf16 weights), in one script.

Quality (real English text from pydoc_data, greedy, EOS ignored):
- agreement: 32 prompts x 128 tokens, the common prefix of each int8 answer with the bf16 one,
  and the issue's bar over the first 8 prompts x 64 tokens (first 8 tokens equal on >= 6
  prompts, mean common prefix >= 24);
- mean KL(bf16 || int8) of the next-token distribution along the bf16 answers: the int8 run is
  teacher-forced onto the bf16 tokens (its sampler's choice replaced), one request at a time,
  and every step's full log-softmax is kept from both runs.
Capacity: blocks in the same KV memory. Speed, interleaved bf16 / int8 for `--rounds` rounds:
`bench throughput` on W1 (32 prompts 64-512 tokens, 128 out), and decode tok/s of 16 sequences
at 3,000 tokens of context (128 steps; the prefill's time subtracted).

    PYTHONPATH=. .venv/bin/python benchmarks/kv_int8.py [--rounds 2] [--skip-speed] [--output-json F]
    PYTHONPATH=. .venv/bin/python benchmarks/kv_int8.py --tiny     # smoke run: a tiny random model, every part, seconds

The kernels alone (int8 against bf16 decode attention, the quantizing KV write):
``pagedserve bench kernels --op kv_int8``. Appends its figures to benchmarks/results/kv_int8.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's package, and benchmarks.kv_int8 for the decode subprocess
from pagedserve.bench.results import record  # noqa: E402


def _text_windows(tokenizer, n: int, length: int) -> list[list[int]]:
    import pydoc_data.topics

    ids = tokenizer("\n".join(pydoc_data.topics.topics.values())[:400_000])["input_ids"]
    step = (len(ids) - length) // n
    return [ids[i * step: i * step + length] for i in range(n)]


class _Recorder:
    """Wraps the runner's sampler: keeps each step's log-softmax of row 0 and, when ``forced``
    is set, replaces the sampled token with the next forced one (batch of one request)."""

    def __init__(self, real) -> None:
        self.real, self.forced, self.logprobs = real, None, []

    def __call__(self, logits, meta):
        self.logprobs.append(torch.log_softmax(logits[0].float(), -1))
        res = self.real(logits, meta)
        if self.forced is not None:
            res.sampled_token_ids[0] = self.forced[len(self.logprobs) - 1]
        return res


def quality(n_prompts: int, out_len: int, threads: int, model=None) -> dict:
    from pagedserve import LLM, SamplingParams

    llms = {kvd: LLM(model, dtype="bfloat16", kv_cache_dtype=kvd, num_threads=threads, kv_cache_memory_bytes=256 << 20,
                     max_model_len=1024, enable_prefix_caching=False) for kvd in ("auto", "int8")}
    prompts = _text_windows(llms["auto"].get_tokenizer(), n_prompts, 256)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    answers = {kvd: [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
               for kvd, llm in llms.items()}
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), out_len) for x, y in zip(answers["auto"], answers["int8"])]
    short = [min(c, 64) for c in common[:8]] or [0]
    kls = []
    for p in prompts:
        recs, ref = {}, None
        for kvd, llm in llms.items():  # bf16 first: its answer alone (AMX: may differ from batched) is the reference
            runner = llm.llm_engine.core.worker.model_runner
            rec = _Recorder(runner.sampler)
            rec.forced = ref
            runner.sampler = rec
            try:
                got = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
            finally:
                runner.sampler = rec.real
            if ref is None:
                ref = got
            assert got == ref, "the forced run did not follow the bf16 answer"
            recs[kvd] = torch.stack(rec.logprobs)
        a, b = recs["auto"], recs["int8"]
        kls.append(float((a.exp() * (a - b)).sum(-1).mean()))
    blocks = {kvd: llm.stats().num_total_blocks for kvd, llm in llms.items()}
    return {
        "prompts": n_prompts, "output_len": out_len, "common_prefix": common,
        "mean_common_prefix": sum(common) / len(common), "identical_answers": sum(c == out_len for c in common),
        "bar_8x64": {"first8_equal": sum(c >= 8 for c in short), "mean_common_prefix": sum(short) / len(short)},
        "mean_kl_nats": sum(kls) / len(kls), "max_prompt_kl_nats": max(kls),
        "blocks_in_256MiB": blocks, "block_ratio": blocks["int8"] / blocks["auto"],
    }


def throughput(kvd: str, threads: int, model=None, tiny: bool = False) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        path = fh.name
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--backend", "pagedserve",
           "--dtype", "bfloat16", "--kv-cache-dtype", kvd, "--num-threads", str(threads), "--output-json", path]
    if model:
        cmd += ["--model", model]
    if tiny:
        cmd += ["--num-prompts", "4", "--min-input-len", "16", "--max-input-len", "64", "--output-len", "4",
                "--peak-measure-seconds", "0.2", "--kv-cache-memory", "32000000"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(path) as fh:
        res = json.load(fh)
    os.unlink(path)
    return float(res["results"]["pagedserve"]["output_tokens_per_s"])


def long_decode(kvd: str, threads: int, n: int = 16, prompt_len: int = 3000, out_len: int = 128, model=None) -> float:
    """Decode tok/s of ``n`` sequences at ~``prompt_len`` tokens of context: the time of
    generating ``out_len + 1`` tokens minus the time of generating 1 (the prefill), on distinct
    prompts with prefix caching off, in a subprocess so the two caches never share the cores."""
    code = f"""
import time, torch
from pagedserve import LLM, SamplingParams
import benchmarks.kv_int8 as b
llm = LLM({model!r}, dtype="bfloat16", kv_cache_dtype={kvd!r}, num_threads={threads}, kv_cache_memory_bytes={3 << 30 if model is None else 64 << 20},
          max_model_len={prompt_len + out_len + 16}, enable_prefix_caching=False, max_num_seqs={n})
ps = b._text_windows(llm.get_tokenizer(), {2 * n}, {prompt_len})
def t(prompts, k):
    t0 = time.perf_counter()
    llm.generate([{{"prompt_token_ids": p}} for p in prompts], SamplingParams(max_tokens=k, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0
t(ps[:2], 2)
full = t(ps[:{n}], {out_len + 1})
prefill = t(ps[{n}:], 1)
print({n} * {out_len} / (full - prefill))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


WORKLOADS = {"W1": None, "long-decode": None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 2 prompts x 8 tokens, one small speed round")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.prompts, args.output_len, args.rounds = 2, 8, 1
    torch.set_num_threads(args.threads)
    result: dict = {}
    if not args.skip_quality:
        q = quality(args.prompts, args.output_len, args.threads, args.model)
        result["quality"] = q
        print(f"quality over {q['prompts']} prompts x {q['output_len']} tokens: mean common prefix {q['mean_common_prefix']:.1f}, "
              f"identical answers {q['identical_answers']}/{q['prompts']}, mean KL {q['mean_kl_nats']:.2e} nats "
              f"(worst prompt {q['max_prompt_kl_nats']:.2e})")
        b = q["bar_8x64"]
        print(f"bar (8 prompts x 64): first 8 equal on {b['first8_equal']}/8 (>= 6), mean common prefix {b['mean_common_prefix']:.1f} (>= 24)")
        print(f"blocks in 256 MiB: bf16 {q['blocks_in_256MiB']['auto']}, int8 {q['blocks_in_256MiB']['int8']} ({q['block_ratio']:.2f}x)")
    if not args.skip_speed:
        speed = {name: {"auto": [], "int8": []} for name in WORKLOADS}
        for r in range(args.rounds):
            for name, wl in WORKLOADS.items():
                for kvd in ("auto", "int8"):
                    if name == "W1":
                        speed[name][kvd].append(throughput(kvd, args.threads, args.model, args.tiny))
                    elif args.tiny:
                        speed[name][kvd].append(long_decode(kvd, args.threads, n=2, prompt_len=64, out_len=4, model=args.model))
                    else:
                        speed[name][kvd].append(long_decode(kvd, args.threads, model=args.model))
                a, b = speed[name]["auto"][-1], speed[name]["int8"][-1]
                unit = "out tok/s" if name == "W1" else "decode tok/s"
                print(f"round {r + 1} {name}: bf16 {a:.1f} {unit}, int8 {b:.1f} ({b / a:.2f}x)", flush=True)
        result["speed"] = speed
    record("kv_int8", result, tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
