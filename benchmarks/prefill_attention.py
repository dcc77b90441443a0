"""Prefill attention on a CPU with AVX512-BF16 or AVX2 + FMA (no AMX): this tree's kernel against
an earlier revision's, in the same script (``csrc/attention_avx512_tiles.c``,
``csrc/attention_avx2_tiles.c``: a prefill chunk's tokens in tiles that share each K/V block,
against one task per token).

Work: one 2,048-token prefill step of prompts of P tokens each (2,048 / P prompts, each
attending causally to itself), from the paged cache, one layer, repeated; with
``--shapes smollm2`` 9 query / 3 KV heads, with ``--shapes 1b`` Llama-3.2-1B's 32 / 8, with
``--shapes mha`` 8 / 8 (head_dim 64, bf16, 16-token blocks). The values span 2^-8..2^8 around a
large shared term, so that a change in the order of any sum shows in the output: the sides must
give the same bits. Rounds alternate the sides; medians, the ratio and the attention FLOP rate
(4 * head_dim per query head and key) are printed.

    .venv/bin/python benchmarks/prefill_attention.py --rev HEAD~1 [--prompt-lens 512,256,128,64] [--shapes smollm2|1b|mha] [--rounds 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from avx512_attention import build, build_rev  # noqa: E402

SHAPES = {"smollm2": (9, 3), "1b": (32, 8), "mha": (8, 8)}
HEAD_DIM, BLOCK, STEP_TOKENS = 64, 16, 2048


def case(prompt_len: int, heads: int, kv_heads: int, seed: int = 0):
    """Cache, block tables, queries, token_seq and token_lens of one prefill step."""
    g = torch.Generator().manual_seed(seed)
    seqs = max(1, STEP_TOKENS // prompt_len)
    per_seq = -(-prompt_len // BLOCK)
    wide = lambda x: x * torch.exp2(torch.randint(-8, 9, x.shape, generator=g).float())  # noqa: E731
    cache = wide(torch.randn(2, seqs * per_seq, kv_heads, BLOCK, HEAD_DIM, generator=g))
    cache[0, ..., 0] = 2.0**11
    cache = cache.bfloat16()
    tables = torch.randperm(seqs * per_seq, generator=g).reshape(seqs, per_seq).contiguous()
    q = wide(torch.randn(seqs * prompt_len, heads, HEAD_DIM, generator=g))
    q[..., 0] = 2.0**11
    token_seq = torch.arange(seqs, dtype=torch.int64).repeat_interleave(prompt_len).contiguous()
    token_lens = (torch.arange(prompt_len, dtype=torch.int64) + 1).repeat(seqs).contiguous()
    return cache, tables, q.bfloat16(), token_seq, token_lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="the earlier revision whose kernel is the peer")
    ap.add_argument("--prompt-lens", default="512,256,128,64")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with open("/proc/cpuinfo") as fh:
        cpu_flags = set(next((line for line in fh if line.startswith("flags")), "").split())
    if not ({"avx512_bf16"} <= cpu_flags or {"avx2", "fma"} <= cpu_flags) or "amx_bf16" in cpu_flags:
        raise SystemExit("needs a CPU with AVX512-BF16 or AVX2 + FMA and no AMX (elsewhere the kernel takes another path)")
    heads, kv_heads = SHAPES[args.shapes]
    with tempfile.TemporaryDirectory() as tmp:
        fns = {f"at {args.rev}": build_rev(args.rev, [], tmp),
               "this tree": build([], os.path.join(tmp, "new.so"))}
        for p in (int(x) for x in args.prompt_lens.split(",")):
            cache, tables, q, token_seq, token_lens = case(p, heads, kv_heads)
            outs = {name: torch.empty_like(q) for name in fns}

            def run(name):
                k = cache.data_ptr()
                rc = fns[name](q.data_ptr(), k, k + cache.stride(0) * 2, tables.data_ptr(), tables.shape[1], token_seq.data_ptr(),
                               token_lens.data_ptr(), outs[name].data_ptr(), q.shape[0], heads, kv_heads, HEAD_DIM, BLOCK, 2.0**-13)
                assert rc == 0

            times = {name: [] for name in fns}
            for _ in range(args.rounds + 2):
                for name in fns:
                    t0 = time.perf_counter()
                    run(name)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            first = next(iter(outs.values()))
            assert all(torch.equal(first, o) for o in outs.values()), "the sides must give the same bits"
            med = {k: statistics.median(v[2:]) for k, v in times.items()}
            flop = float(token_lens.sum()) * 4 * HEAD_DIM * heads
            old, new = med.values()
            print(f"{args.shapes}, {q.shape[0] // p} prompts of {p} tokens, {args.threads} threads: " + ", ".join(
                f"{k} {v:.2f} ms ({flop / v / 1e6:.0f} GFLOP/s)" for k, v in med.items()) + f"; {old / new:.2f}x (bit-identical)")


if __name__ == "__main__":
    main()
