"""Where the small-M bf16 matmul (``csrc/small_gemm.c``) stops beating oneDNN, on a CPU with
AVX512-BF16 and no AMX (where pagedserve uses both): a model's projections (``--shapes
smollm2``: SmolLM2-135M's, 30 layers and the LM head; ``1b``: Llama-3.2-1B's, 4 layers), distinct
weights read cold as in a step, on 2 MiB pages as the engine keeps them, through oneDNN's packed
bf16 kernel and through the small-M kernel reading the same packed buffers with its calibrated
plans (bit-identical outputs; checked at calibration), at several row counts. ``--peer-rev REV``
adds the small-M kernel as built from an earlier commit (its ``csrc/`` from ``git show``),
checked to give the same bits as this one. Rounds alternate; medians and ratios per row count are printed. The engine sends decode
steps of up to ``SMALL_GEMM_MAX_ROWS`` sequences to the small-M kernel.

    .venv/bin/python benchmarks/small_gemm_rows.py [--shapes smollm2|1b] [--rows 1,8,16,32,48,64]
        [--rounds 9] [--threads 2] [--peer-rev HEAD~1]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from pagedserve.model.packed_linear import onednn_packs, pack_weight, packed_linear
from pagedserve.ops import cpu as ck
from pagedserve.ops.cpu import build, matmul

SHAPES = {  # (out, in) of qkv, o, gate_up, down; layers
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 4),
}


def peer_kernel(rev: str):
    """``small_gemm_bf16`` compiled from ``csrc/`` at git revision ``rev``, with the engine's flags."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(build._CSRC, root)
    tmp = tempfile.mkdtemp(prefix="small_gemm_peer_")
    names = subprocess.run(["git", "-C", root, "ls-tree", "--name-only", f"{rev}:{rel}"], check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        with open(os.path.join(tmp, name), "wb") as fh:
            fh.write(subprocess.run(["git", "-C", root, "show", f"{rev}:{rel}/{name}"], check=True, capture_output=True).stdout)
    so = os.path.join(tmp, "decode.so")
    try:
        subprocess.run(["cc", *build._COMMON_FLAGS, *build._LIBS["decode"][1], os.path.join(tmp, "decode_step.c"), "-o", so, "-lm"], check=True)
        fn = ctypes.CDLL(so).small_gemm_bf16  # stays mapped after the file is removed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [p, i64, i64, p, p, p, i64, i64, i64], ctypes.c_int
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rows", default="1,8,16,32,48,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-rev", default=None, help="also time the small-M kernel of this git revision")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not onednn_packs(torch.bfloat16) or ck.get_small_gemm_lib() is None:
        raise SystemExit("needs oneDNN bf16 packing and the small-M kernel (AVX512-BF16)")
    kernels = {"small-M": ck.get_small_gemm_lib().small_gemm_bf16}
    if args.peer_rev:
        kernels[f"small-M@{args.peer_rev}"] = peer_kernel(args.peer_rev)
    shapes, layers = SHAPES[args.shapes]
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(layers) for n, k in shapes]
    if args.shapes == "smollm2":
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
    ks = {k for _, k in shapes}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in ks}
        fns = {"oneDNN": lambda: [packed_linear(xs[w.shape[1]], p) for w, p in zip(weights, packed)]}
        outs = {}
        for name, fn in kernels.items():
            ys = [torch.empty(m, w.shape[0], dtype=torch.bfloat16) for w in weights]  # one output per weight
            outs[name] = ys
            calls = [(xs[w.shape[1]].data_ptr(), w.shape[1], torch.ops.mkldnn.data_ptr(p), y.data_ptr(), w.shape[0], *plans[tuple(w.shape)])
                     for w, p, y in zip(weights, packed, ys)]

            def run(fn=fn, calls=calls):
                for x, k, wp, y, n, chain, body in calls:
                    if fn(x, m, k, wp, None, y, n, chain, body) != 0:
                        raise RuntimeError(f"small_gemm_bf16 refused {m} rows of {k} inputs")

            fns[name] = run
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn()
        for name, ys in outs.items():  # every weight's output against oneDNN's
            if any(not torch.equal(y, packed_linear(xs[w.shape[1]], p)) for w, p, y in zip(weights, packed, ys)):
                raise SystemExit(f"M = {m}: {name}'s output differs from oneDNN's")
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        gflop = 2 * m * params / 1e9
        ratios = "; ".join(f"{k} / small-M = {v / med['small-M']:.2f}x" for k, v in med.items() if k != "small-M")
        print(f"M = {m:4d}: " + ", ".join(f"{k} {v:6.2f} ms ({gflop / v * 1e3:5.0f} GFLOP/s)" for k, v in med.items()) + f"; {ratios}", flush=True)


if __name__ == "__main__":
    main()
