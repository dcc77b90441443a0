"""Embeddings throughput (issue 51): pagedserve's ``LLM.embed`` (``runner="pooling"``) against HF
transformers' batched forward on the same weights, in the same process, on the same inputs.

Workload: ``--num-inputs`` (256) inputs whose lengths are uniform in ``--min-len``..``--max-len``
(32-512 tokens, seed ``--seed``), each a window of token ids cut from real English text (the
corpus of ``pagedserve bench``: Python's ``pydoc_data.topics`` tokenized with the model's
tokenizer, each window at its own offset, no special tokens added). Both sides get these token
ids as they are, so both embed exactly the same tokens.

Weights: the model's folder as ``resolve_model`` gives it. For a GGUF-backed folder (the default
model, SmolLM2-135M-Instruct Q4_1) pagedserve runs ``quantization="none"`` (the file dequantized
in memory) and HF loads the same file with its own GGUF loader (``AutoModel.from_pretrained(dir,
gguf_file=...)``, dequantized too); a safetensors folder is loaded as it is by both. Same dtype on
both sides (``--dtype auto``: bfloat16 where the CPU computes in it, AVX512-BF16 or AMX, else
float32), same torch threads (``--threads``, default: every usable core).

The embedding: the final-norm hidden states (HF's ``AutoModel(...).last_hidden_state``) pooled
``--pooling`` LAST (the last token's) or MEAN (the mean over the input), L2-normalized.

    pagedserve  ``LLM(model, runner="pooling", pooler_config={...}, dtype, quantization="none",
                num_threads)``, the engine's defaults otherwise: token budget 2,048 a step and
                64 running (``--max-num-batched-tokens``, ``--max-num-seqs`` change them),
                chunked prefill, prefix caching on (LAST; emptied before each timed pass, and
                the cached tokens of every timed pass are checked to be 0);
                ``llm.embed(all inputs as token-id lists)``: vectors as lists of floats.
    hf          ``AutoModel`` (the base model, no LM head), ``eval()``, under
                ``torch.inference_mode()``: the inputs sorted by length, longest first (as
                sentence-transformers' ``encode`` does; ``--hf-order input`` keeps the input
                order), in batches of ``--hf-batch-size`` (32), right-padded with an
                ``attention_mask``, ``use_cache=False``; pooled and normalized in torch per
                batch, vectors left as a tensor (pagedserve's are converted to lists: its API).

Timing: a warm-up of each side on the first ``--hf-batch-size`` inputs, then ``--rounds`` (3)
timed passes over all inputs per side, alternating (pagedserve first, then HF, the order
reversed every other round). Printed: each pass, then per side the median (the headline) and the
best pass, inputs/s and tokens/s (tokens = the inputs' own tokens: HF's padding is not counted;
its padded share is printed), the ratio pagedserve / HF and PASS / MISS against the 3x target.

Correctness in the same run: the cosine between the two sides' vectors of each input (the first
pass's); the minimum is printed and checked against ``--min-cosine`` (default 0.999 in float32,
0.99 in bfloat16, where the two sides round differently over every layer).

    .venv/bin/python benchmarks/embeddings_vs_hf.py                      # SmolLM2, 256 inputs, LAST
    .venv/bin/python benchmarks/embeddings_vs_hf.py --pooling MEAN --rounds 5 --threads 2
    .venv/bin/python benchmarks/embeddings_vs_hf.py --num-inputs 8 --max-len 64 --rounds 1   # a quick look
    .venv/bin/python benchmarks/embeddings_vs_hf.py --tiny               # smoke run: a tiny random model

Appends its figures to benchmarks/results/embeddings_vs_hf.jsonl (``--output-json F``: the
whole result, per-pass times included, as one JSON file too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGET = 3.0  # issue 51: pagedserve / HF >= 3x


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def make_inputs(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` token-id windows of real text, lengths uniform in ``lo..hi`` (pagedserve.bench's
    ``random`` dataset)."""
    from pagedserve.bench.datasets import sample_random

    return [r.prompt_token_ids for r in sample_random(tokenizer, n, (lo, hi), (1, 1), seed)]


# -- pagedserve ------------------------------------------------------------------------------
class PagedSide:
    name = "pagedserve"

    def __init__(self, model: str, dtype: str, quantization: Optional[str], pooling: str, threads: int, engine_kw: dict[str, Any]) -> None:
        from pagedserve import LLM

        kw: dict[str, Any] = dict(runner="pooling", pooler_config={"pooling_type": pooling, "normalize": True}, dtype=dtype, num_threads=threads)
        kw.update({k: v for k, v in engine_kw.items() if v is not None})
        if quantization is not None:
            kw["quantization"] = quantization
        t0 = time.perf_counter()
        self.llm = LLM(model, **kw)
        self.load_s = time.perf_counter() - t0
        worker = getattr(self.llm.llm_engine.core, "worker", None)
        self.weights = getattr(getattr(worker, "weights", None), "kind", "?")
        self.config = self.llm.llm_engine.config

    def run(self, inputs: list[list[int]]) -> tuple[float, torch.Tensor, int]:
        """(seconds, [n, hidden] float32 vectors, tokens served from the prefix cache)."""
        self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = self.llm.embed([{"prompt_token_ids": ids} for ids in inputs], use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float32), sum(o.num_cached_tokens for o in outs)


# -- HF transformers -------------------------------------------------------------------------
def load_hf_model(model_dir: str, dtype: torch.dtype):
    """transformers' ``AutoModel`` on the same weights: the GGUF file a GGUF-backed folder stands
    for (transformers' own GGUF loader), else the folder."""
    import transformers
    from transformers import AutoModel

    from pagedserve.model.loader import gguf_source

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    src = gguf_source(model_dir)
    if src is not None:
        try:  # transformers' GGUF loader draws its own progress bar: quiet it
            import functools

            from transformers import modeling_gguf_pytorch_utils as gguf_utils

            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
        except (ImportError, AttributeError):
            pass
        model = AutoModel.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src), dtype=dtype)
        how = f"AutoModel.from_pretrained({os.path.dirname(src)}, gguf_file={os.path.basename(src)})"
    else:
        model = AutoModel.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        how = f"AutoModel.from_pretrained({model_dir})"
    return model.eval(), how


class HFSide:
    name = "hf"

    def __init__(self, model_dir: str, dtype: torch.dtype, pooling: str, batch_size: int, sort: bool, pad_id: int) -> None:
        t0 = time.perf_counter()
        self.model, self.how = load_hf_model(model_dir, dtype)
        self.load_s = time.perf_counter() - t0
        self.pooling, self.bs, self.sort, self.pad_id = pooling, batch_size, sort, pad_id
        self.attn = getattr(self.model.config, "_attn_implementation", "?")
        self.padded_tokens = 0

    def _batch(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(len(x) for x in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = 1
        self.padded_tokens += len(batch) * width
        h = self.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        if self.pooling == "LAST":
            lens = mask.sum(dim=1)
            v = h[torch.arange(len(batch)), lens - 1]
        else:  # MEAN over the real tokens, summed in float32 (as the engine sums)
            m = mask.unsqueeze(-1).float()
            v = (h.float() * m).sum(dim=1) / m.sum(dim=1)
        return torch.nn.functional.normalize(v.float(), p=2, dim=-1)

    def run(self, inputs: list[list[int]]) -> tuple[float, torch.Tensor, int]:
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i])) if self.sort else list(range(len(inputs)))
        self.padded_tokens = 0
        out: list[Optional[torch.Tensor]] = [None] * len(inputs)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, len(order), self.bs):
                idx = order[s : s + self.bs]
                vecs = self._batch([inputs[i] for i in idx])
                for j, i in enumerate(idx):
                    out[i] = vecs[j]
        dt = time.perf_counter() - t0
        return dt, torch.stack(out), 0  # type: ignore[arg-type]


# -- the run ---------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="both sides (auto: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both sides (default: every usable core)")
    ap.add_argument("--pooling", default="LAST", choices=["LAST", "MEAN"], type=str.upper)
    ap.add_argument("--num-inputs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="pagedserve's token budget a step (default: the engine's, 2048)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="pagedserve's most running requests (default: the engine's, 64)")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--hf-order", default="sorted", choices=["sorted", "input"],
                    help="HF batches: inputs sorted by length, longest first (sentence-transformers), or in input order")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes per side, alternating (default: %(default)s)")
    ap.add_argument("--min-cosine", type=float, default=None, help="least cosine accepted (default: 0.999 float32, 0.99 bfloat16)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 8 inputs of 32-64 tokens, 1 round")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.num_inputs, args.min_len, args.max_len, args.rounds, args.hf_batch_size = 8, 32, 64, 1, 4
    if args.min_len < 1 or args.max_len < args.min_len or args.num_inputs < 1 or args.rounds < 1 or args.hf_batch_size < 1:
        raise SystemExit("need 1 <= --min-len <= --max-len, --num-inputs >= 1, --rounds >= 1, --hf-batch-size >= 1")

    from pagedserve import platform
    from pagedserve.bench.results import record
    from pagedserve.model.loader import gguf_source, load_tokenizer, resolve_model

    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if platform.cpu_has_bf16() else "float32")
    dtype = getattr(torch, dtype_name)
    min_cos = args.min_cosine if args.min_cosine is not None else (0.999 if dtype_name == "float32" else 0.99)
    model_dir = resolve_model(args.model)
    gguf = gguf_source(model_dir)
    quantization = "none" if gguf is not None else None
    host = f"{platform.cpu_model_name()} (class {platform.cpu_class()}, {usable_cores()} usable cores)"
    print(f"host: {host}; {threads} torch threads on both sides; dtype {dtype_name} on both sides")

    tok = load_tokenizer(model_dir)
    inputs = make_inputs(tok, args.num_inputs, args.min_len, args.max_len, args.seed)
    lens = [len(x) for x in inputs]
    tokens = sum(lens)
    pad_id = next((int(v) for v in (tok.pad_token_id, tok.eos_token_id) if v is not None), 0)
    print(f"workload: {len(inputs)} inputs of {min(lens)}-{max(lens)} tokens (uniform in {args.min_len}-{args.max_len}, seed {args.seed}; "
          f"mean {statistics.mean(lens):.0f}, {tokens} tokens in all), token-id windows of real text (pydoc topics), the same ids to both; "
          f"pooling {args.pooling}, normalized")

    engine_kw = {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs}
    paged = PagedSide(model_dir, dtype_name, quantization, args.pooling, threads, engine_kw)
    torch.set_num_threads(threads)  # the engine sets its threads in this process too: keep both the same
    cfg = paged.config
    src = f" (the GGUF {gguf})" if gguf else ""
    print(f"pagedserve: {model_dir}{src}, quantization={quantization!r} (weights {paged.weights}), loaded in {paged.load_s:.1f} s; "
          f"token budget {cfg.max_num_batched_tokens}, max_num_seqs {cfg.max_num_seqs}, prefix caching {cfg.enable_prefix_caching} "
          f"(emptied before each pass)")
    hf = HFSide(model_dir, dtype, args.pooling, args.hf_batch_size, args.hf_order == "sorted", pad_id)
    print(f"hf: {hf.how}, {dtype_name}, attn {hf.attn}, loaded in {hf.load_s:.1f} s; batches of {args.hf_batch_size}, "
          f"{'sorted by length, longest first' if hf.sort else 'in input order'}, right-padded (pad id {pad_id}) with an attention mask")
    sides = {"pagedserve": paged, "hf": hf}

    warm = inputs[: args.hf_batch_size]
    for s in sides.values():
        s.run(warm)
    gc.collect()

    times: dict[str, list[float]] = {k: [] for k in sides}
    vecs: dict[str, torch.Tensor] = {}
    cached: list[int] = []
    padded = 0
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        line = []
        for k in order:
            dt, v, c = sides[k].run(inputs)
            times[k].append(dt)
            vecs.setdefault(k, v)
            if k == "pagedserve":
                cached.append(c)
            else:
                padded = hf.padded_tokens
            line.append(f"{k} {dt:.2f} s ({len(inputs) / dt:.1f} inputs/s, {tokens / dt:.0f} tok/s)")
            gc.collect()
        print(f"round {r + 1}: " + ", ".join(line))
    if any(cached):
        print(f"WARNING: pagedserve served {cached} tokens from the prefix cache in its timed passes: its figures are inflated")

    cos = (vecs["pagedserve"] * vecs["hf"]).sum(dim=-1) / (vecs["pagedserve"].norm(dim=-1) * vecs["hf"].norm(dim=-1)).clamp_min(1e-12)
    worst = int(cos.argmin())
    cos_ok = bool(cos.min().item() >= min_cos)
    print(f"cosine pagedserve vs hf over {len(inputs)} inputs: min {cos.min().item():.6f} (input {worst}, {lens[worst]} tokens), "
          f"mean {cos.mean().item():.6f}; {'ok' if cos_ok else 'WARNING: below'} {min_cos}")

    fig: dict[str, Any] = {}
    for k in sides:
        med, best = statistics.median(times[k]), min(times[k])
        fig[k] = {"median_s": med, "best_s": best, "times_s": times[k], "inputs_per_s": len(inputs) / med, "tokens_per_s": tokens / med,
                  "best_inputs_per_s": len(inputs) / best, "best_tokens_per_s": tokens / best}
        extra = f"; padded tokens {padded} = {padded / tokens:.2f}x the inputs' own" if k == "hf" else ""
        print(f"{k:>10}: median of {len(times[k])} {med:.2f} s: {len(inputs) / med:.1f} inputs/s, {tokens / med:.0f} tok/s "
              f"(best {len(inputs) / best:.1f} inputs/s, {tokens / best:.0f} tok/s){extra}")
    ratio = statistics.median(times["hf"]) / statistics.median(times["pagedserve"])
    best_ratio = min(times["hf"]) / min(times["pagedserve"])
    print(f"pagedserve / hf (inputs/s = tokens/s, same inputs): median {ratio:.2f}x, best {best_ratio:.2f}x; "
          f"target >= {TARGET:g}x: {'PASS' if ratio >= TARGET else 'MISS'} (on the medians) [{host}, {dtype_name}, {threads} threads]")

    fig.update({
        "model": args.model or "SmolLM2-135M-Instruct", "weights": {"pagedserve": paged.weights, "hf": hf.how}, "dtype": dtype_name,
        "threads": threads, "pooling": args.pooling, "num_inputs": len(inputs), "len_range": [args.min_len, args.max_len], "tokens": tokens,
        "hf_batch_size": args.hf_batch_size, "hf_order": args.hf_order, "hf_padded_tokens": padded, "hf_attn": hf.attn, "rounds": args.rounds,
        "ratio_median": ratio, "ratio_best": best_ratio, "target": TARGET, "pass": ratio >= TARGET, "min_cosine": cos.min().item(),
        "mean_cosine": cos.mean().item(), "cosine_ok": cos_ok, "prefix_cached_tokens": cached,
        "pagedserve_engine": {"max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs},
        "loadavg_1min_end": os.getloadavg()[0],
    })
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(fig, fh, indent=2)
    record("embeddings_vs_hf", fig, tiny=args.tiny, extra={"model": fig["model"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
