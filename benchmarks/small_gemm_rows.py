"""Where the small-M bf16 matmul (``csrc/small_gemm.c``) stops beating oneDNN, on a CPU with
AVX512-BF16 and no AMX (where pagedserve uses both): SmolLM2-135M's projections and LM head (30
layers of distinct weights, read cold as in a step, on 2 MiB pages as the engine keeps them)
through oneDNN's packed bf16 kernel and through the small-M kernel reading the same packed
buffers with its calibrated plans (bit-identical outputs), at several row counts. Rounds
alternate the two; medians and the ratio per row count are printed. The engine sends decode
steps of up to ``SMALL_GEMM_MAX_ROWS`` sequences to the small-M kernel.

    .venv/bin/python benchmarks/small_gemm_rows.py [--rows 1,8,16,32,48,64] [--rounds 9] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.model.packed_linear import onednn_packs, pack_weight, packed_linear
from pagedserve.ops import cpu as ck
from pagedserve.ops.cpu import matmul

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16,32,48,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not onednn_packs(torch.bfloat16) or ck.get_small_gemm_lib() is None:
        raise SystemExit("needs oneDNN bf16 packing and the small-M kernel (AVX512-BF16)")
    lib = ck.get_small_gemm_lib()
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(30) for n, k in SHAPES]
    weights.append((torch.randn(49152, 576, generator=g) * 0.05).bfloat16())  # tied LM head
    packed = [pack_weight(w) for w in weights]
    plans = {}
    for w, p in zip(weights, packed):
        ck.collapse_to_huge_pages(*matmul._packed_address(p))
        if tuple(w.shape) not in plans:
            plans[tuple(w.shape)] = ck.calibrate_small_gemm(p, w.shape[0], w.shape[1], None)
    if any(p is None for p in plans.values()):
        raise SystemExit(f"no small-M plan for some shapes: {plans}")
    params = sum(w.numel() for w in weights)
    print(f"{args.threads} threads, {len(weights)} weights ({params / 1e6:.1f} M params), plans {plans}")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
        ys = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in (960, 576, 3072, 49152)}
        calls = [(xs[w.shape[1]].data_ptr(), w.shape[1], torch.ops.mkldnn.data_ptr(p), ys[w.shape[0]].data_ptr(), w.shape[0], *plans[tuple(w.shape)])
                 for w, p in zip(weights, packed)]

        def onednn():
            for w, p in zip(weights, packed):
                packed_linear(xs[w.shape[1]], p)

        def small():
            for x, k, wp, y, n, chain, body in calls:
                if lib.small_gemm_bf16(x, m, k, wp, None, y, n, chain, body) != 0:
                    raise RuntimeError(f"small_gemm_bf16 refused {m} rows (SG_MAX_ROWS)")

        times = {"oneDNN": [], "small-M": []}
        fns = {"oneDNN": onednn, "small-M": small}
        for f in fns.values():
            f()
        for _ in range(args.rounds):
            for name, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        gflop = 2 * m * params / 1e9
        print(f"M = {m:4d}: " + ", ".join(f"{k} {v:6.2f} ms ({gflop / v * 1e3:5.0f} GFLOP/s)" for k, v in med.items())
              + f"; oneDNN / small-M = {med['oneDNN'] / med['small-M']:.2f}x")


if __name__ == "__main__":
    main()
