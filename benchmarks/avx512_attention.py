"""Decode attention on a CPU with AVX512-BF16 or AVX2 (no AMX): one task per (query token, KV
head) against one task per query token over all KV heads (``csrc/attention_avx512.c``,
``csrc/attention_avx2_tokens.c``; what the kernel picks with at least 4 tokens per thread), in
the same script.

Both sides are ``paged_attention.c`` as the engine builds it, the peer with
``-DTOKEN_TASKS_PER_THREAD`` set out of reach; with ``--rev REV`` a third side is the per-token
kernel of git revision REV (the source of an earlier commit: A/B of a kernel change); ``--avx2``
builds every side with ``-mno-avx512f`` (the AVX2 kernel on an AVX-512 CPU's memory system).
Outputs are checked bit-identical. Work: 32 decode rows of 148-560 tokens over SmolLM2's 9 query
/ 3 KV heads (``--heads 32,8``: the 1.1B model's), head_dim 64, bf16, 16-token blocks, 30 layers
of distinct caches (read cold, as in a step), with each sequence's blocks in order (as after a
prefill), as W1 leaves them (prompt blocks in order, the last 8 blocks of each sequence
interleaved with the others', as decodes append them) and scattered over the pool
(``--pool-blocks``, default 1.5x the blocks in use; the engine's default pool on SmolLM2 is
~11,650 blocks). Rounds alternate the sides; medians and the ratios to the first are printed,
and the K/V bytes read per second.

    .venv/bin/python benchmarks/avx512_attention.py [--rounds 9] [--threads 2] [--rev HEAD~1] [--pool-blocks 11650] [--avx2] [--heads 32,8]
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CSRC = os.path.join(ROOT, "pagedserve", "ops", "cpu", "csrc")
HEAD_DIM, BLOCK, SEQS, LAYERS = 64, 16, 32, 30


def build(flags: list[str], out: str, csrc: str = CSRC):
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast", *flags,
                    os.path.join(csrc, "paged_attention.c"), "-o", out, "-lm"], check=True)
    fn = ctypes.CDLL(out).paged_attention_bf16
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_int
    fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float]
    return fn


def build_rev(rev: str, flags: list[str], tmp: str):
    """``build`` from git revision ``rev``'s kernel sources (extracted under ``tmp``)."""
    rev_src = os.path.join(tmp, "rev")
    os.makedirs(rev_src)
    tree = subprocess.run(["git", "archive", rev, "pagedserve/ops/cpu/csrc"], cwd=ROOT, check=True, stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-f", "-", "-C", rev_src], input=tree, check=True)
    return build(flags, os.path.join(tmp, "rev.so"), os.path.join(rev_src, "pagedserve", "ops", "cpu", "csrc"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rev", default=None, help="also time the per-token kernel of this git revision")
    ap.add_argument("--pool-blocks", type=int, default=None, help="blocks per layer cache (default: 1.5x those in use)")
    ap.add_argument("--avx2", action="store_true", help="build every side with -mno-avx512f: the AVX2 kernel")
    ap.add_argument("--heads", default="9,3", help="query heads,KV heads (default 9,3: SmolLM2; 32,8: the 1.1B model)")
    args = ap.parse_args()
    HEADS, KV_HEADS = (int(x) for x in args.heads.split(","))
    flags = ["-mno-avx512f"] if args.avx2 else []
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read when the libraries' OpenMP starts
    with open("/proc/cpuinfo") as fh:
        cpu_flags = set(next((line for line in fh if line.startswith("flags")), "").split())
    if not ({"avx512_bf16"} <= cpu_flags or {"avx2", "fma"} <= cpu_flags) or "amx_bf16" in cpu_flags:
        raise SystemExit("needs a CPU with AVX512-BF16 or AVX2 and no AMX (elsewhere the kernel takes another path)")
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(148, 561, (SEQS,), generator=g)
    nblocks = [math.ceil(int(n) / BLOCK) for n in lens]
    pool = args.pool_blocks or int(sum(nblocks) * 1.5)
    if pool < sum(nblocks):
        raise SystemExit(f"--pool-blocks must be at least the {sum(nblocks)} blocks in use")
    caches = [torch.randn(2, pool, KV_HEADS, BLOCK, HEAD_DIM, generator=g).bfloat16() for _ in range(LAYERS)]
    q = torch.randn(SEQS, HEADS, HEAD_DIM, generator=g).bfloat16()
    # W1's: each prompt's blocks in order, then its last 8 blocks interleaved with the other sequences'.
    prompt_blocks = [max(nb - 8, 0) for nb in nblocks]
    starts = [sum(prompt_blocks[:i]) for i in range(SEQS)]
    w1 = [b for i, nb in enumerate(nblocks) for b in
          list(range(starts[i], starts[i] + prompt_blocks[i])) + [sum(prompt_blocks) + j * SEQS + i for j in range(nb - prompt_blocks[i])]]
    layouts = {"blocks in order": torch.arange(sum(nblocks)), "W1's layout": torch.tensor(w1),
               "blocks scattered": torch.randperm(pool, generator=g)[: sum(nblocks)]}
    nbytes = sum(int(n) for n in lens) * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS
    with tempfile.TemporaryDirectory() as tmp:
        side = "per token"
        fns = {side: build(flags, os.path.join(tmp, "token.so"))}
        fns["per (token, KV head)"] = build(flags + ["-DTOKEN_TASKS_PER_THREAD=1000000"], os.path.join(tmp, "head.so"))
        if args.rev:
            fns[f"{side} at {args.rev}"] = build_rev(args.rev, flags, tmp)
        for layout, ids in layouts.items():
            tables = torch.zeros(SEQS, max(nblocks), dtype=torch.int64)
            at = 0
            for i, nb in enumerate(nblocks):
                tables[i, :nb] = ids[at: at + nb]
                at += nb
            outs = {name: torch.empty_like(q) for name in fns}

            def run(name):
                fn, out = fns[name], outs[name]
                for c in caches:
                    k = c.data_ptr()
                    rc = fn(q.data_ptr(), k, k + c.stride(0) * 2, tables.data_ptr(), tables.shape[1], None, lens.data_ptr(),
                            out.data_ptr(), SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, 0.125)
                    assert rc == 0

            for name in fns:
                run(name)
            first = next(iter(outs.values()))
            assert all(torch.equal(first, o) for o in outs.values()), "every side must give the same bits"
            times = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name in fns:
                    t0 = time.perf_counter()
                    run(name)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            base = med[side]
            print(f"{layout}, {args.threads} threads, 30 layers: " + ", ".join(
                f"{k} {v:.2f} ms ({nbytes / v / 1e6:.1f} GB/s, {v / base:.2f}x the time)" for k, v in med.items()) + " (bit-identical)")


if __name__ == "__main__":
    main()
