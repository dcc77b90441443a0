"""The AMX kernels against what they replaced, in one script (issue 15, round three).

- matmul: pagedserve's AMX matmul (``ops/cpu/csrc/amx_gemm.c``) against oneDNN's packed
  linear on SmolLM2's four projection shapes, 30 layers of distinct weights (so every layer is
  read from memory, as in a decode step), for several M; ms per 30 layers and the ratio.
- attention: the paged attention kernel on W1-like decode rows (32 sequences of 148-560 tokens,
  9 query / 3 KV heads, head_dim 64), 30 layers of KV (cold) and one layer repeated (hot), with
  the AMX path and with ``PAGEDSERVE_AMX=0`` (the AVX-512 kernel), each in its own process.

    .venv/bin/python benchmarks/amx_kernels.py [--rows 1,4,16,32,64,256,2048] [--rounds 3]

Needs a CPU with AMX-BF16 (exits otherwise). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

import torch


def best_ms(fn, reps: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e3)
    return best


def matmul_part(rows: list[int], rounds: int) -> None:
    from pagedserve.model.packed_linear import pack_weight, packed_linear
    from pagedserve.ops.cpu import matmul

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for n, k in shapes] for _ in range(30)]
    amx = [[matmul.amx_layout(w) for w in ws] for ws in weights]
    onednn = [[pack_weight(w) for w in ws] for ws in weights]
    mb = 30 * sum(n * k * 2 for n, k in shapes) / 1e6
    print(f"matmul: SmolLM2's projections, 30 layers ({mb:.0f} MB of weights), ms per 30 layers, best of {rounds}")
    for m in rows:
        x = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in shapes}
        reps = max(1, 64 // m)

        def run_amx():
            for layer in amx:
                for (n, k), w in zip(shapes, layer):
                    matmul.amx_gemm(x[k], w, None, n)

        def run_onednn():
            for layer in onednn:
                for (n, k), w in zip(shapes, layer):
                    packed_linear(x[k], w)

        a1, o, a2 = best_ms(run_amx, reps, rounds), best_ms(run_onednn, reps, rounds), best_ms(run_amx, reps, rounds)
        a = min(a1, a2)
        print(f"  M={m:5d}: AMX {a:8.2f} ({mb / a:5.1f} GB/s)  oneDNN {o:8.2f} ({mb / o:5.1f} GB/s)  oneDNN / AMX {o / a:.2f}x")


def attention_child(rounds: int) -> None:
    from pagedserve.ops.cpu import kernels

    rng = random.Random(0)
    lens = [rng.randint(84, 496) + 64 for _ in range(32)]
    nb = [-(-n // 16) for n in lens]
    tables = torch.zeros(32, max(nb), dtype=torch.int64)
    b = 0
    for s, count in enumerate(nb):
        tables[s, :count] = torch.arange(b, b + count)
        b += count
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, b, 3, 16, 64, generator=g).to(torch.bfloat16) for _ in range(30)]
    q = torch.randn(32, 9, 64, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    seq_lens = torch.tensor(lens)

    def layers(which):
        def run():
            for c in which:
                kernels.paged_attention_cpu(q, c, tables, None, seq_lens, 0.125, out)
        return run

    cold = best_ms(layers(caches), 3, rounds) / 30
    hot = best_ms(layers([caches[0]] * 30), 3, rounds) / 30
    mb = sum(lens) * 3 * 64 * 4 / 1e6
    print(f"{cold:.3f} {hot:.3f} {mb:.2f}")


def attention_part(rounds: int) -> None:
    print("attention: 32 decode rows (148-560 tokens, 3 KV heads, head_dim 64), ms per layer, best of", rounds)
    res = {}
    for name, amx in (("AMX", "1"), ("AVX-512", "0"), ("AMX again", "1")):
        env = dict(os.environ, PAGEDSERVE_AMX=amx)
        line = subprocess.run([sys.executable, __file__, "--attention-child", "--rounds", str(rounds)], env=env,
                              capture_output=True, text=True, check=True).stdout.split()
        cold, hot, mb = map(float, line[-3:])
        res[name] = cold
        print(f"  {name:9s}: cold {cold:.3f} ({mb / cold:.1f} GB/s)  hot {hot:.3f}")
    print(f"  AVX-512 / AMX (cold): {res['AVX-512'] / min(res['AMX'], res['AMX again']):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16,32,64,256,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention_child:
        attention_child(args.rounds)
        return
    from pagedserve.ops.cpu import matmul

    if not matmul.amx_available():
        sys.exit("no AMX-BF16 here (or PAGEDSERVE_AMX=0): nothing to compare")
    matmul_part([int(r) for r in args.rows.split(",")], args.rounds)
    attention_part(args.rounds)


if __name__ == "__main__":
    main()
