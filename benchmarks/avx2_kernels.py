"""The float32 CPU paths on an AVX2 machine, each against its peer in the same script:

1. SmolLM2's projections and LM head (30 layers of distinct weights, read cold, as in a step)
   through ``F.linear`` (MKL) against oneDNN's packed weights (what pagedserve uses for float32,
   with bounded row counts: see benchmarks/README.md), at M = 1, 32 and 256 rows.
2. The same in bf16: ``F.linear`` (bf16 on a CPU without bf16 arithmetic, what pagedserve
   used before ``avx2_gemm.c``) and oneDNN's packed float32 (the float32 path) against the AVX2
   bf16 matmul (weights bf16 in memory, float32 FMA).
3. Decode attention over 32 sequences of 148-560 tokens (SmolLM2's 9 query / 3 KV heads,
   head_dim 64, a float32 cache of scattered 16-token blocks): ``paged_attention.c`` built as the
   engine builds it against the same source built with ``-mno-avx2 -mno-fma`` (the generic C
   path every AVX2-only CPU took before ``attention_avx2.c``). Outputs are checked against a
   PyTorch softmax(QK^T)V.

Rounds alternate the two sides; min and median per side and the ratio of medians are printed.

    .venv/bin/python benchmarks/avx2_kernels.py [--threads 2] [--rounds 6]
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
import torch.nn.functional as F

from pagedserve.model.packed_linear import pack_weight, packed_linear

CSRC = os.path.join(os.path.dirname(__file__), "..", "pagedserve", "ops", "cpu", "csrc")
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def ab(name: str, fns: dict, rounds: int, reps: int = 1) -> None:
    times = {k: [] for k in fns}
    for k, f in fns.items():
        f()  # warm-up
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            times[k].append((time.perf_counter() - t0) / reps * 1e3)
    last = list(fns)[-1]
    meds = {k: statistics.median(v) for k, v in times.items()}
    line = ", ".join(f"{k} min {min(v):.2f} med {meds[k]:.2f} ms" for k, v in times.items())
    ratios = ", ".join(f"{k} / {last} = {meds[k] / meds[last]:.2f}x" for k in fns if k != last)
    print(f"{name}: {line}; {ratios}")


def projections(rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES] for _ in range(30)]
    head = torch.randn(49152, 576, generator=g) * 0.05
    packed = [[pack_weight(w) for w in layer] for layer in layers]
    packed_head = pack_weight(head)
    for m in (1, 32, 256):
        xs = {k: torch.randn(m, k, generator=g) for _, k in SHAPES}
        for w, p in zip(layers[0], packed[0]):
            torch.testing.assert_close(packed_linear(xs[w.shape[1]], p), F.linear(xs[w.shape[1]], w), rtol=1e-4, atol=1e-4)

        def mkl():
            for layer in layers:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)
            F.linear(xs[576], head)

        def onednn():
            for layer, pl in zip(layers, packed):
                for w, p in zip(layer, pl):
                    packed_linear(xs[w.shape[1]], p)
            packed_linear(xs[576], packed_head)

        ab(f"projections + LM head, M = {m}", {"F.linear": mkl, "oneDNN packed": onednn}, rounds)


def projections_bf16(rounds: int, ms: tuple) -> None:
    """bf16 weights: F.linear (what bf16 took on AVX2 before), the AVX2 bf16 matmul, against
    oneDNN's packed float32 (the float32 path, twice the weight bytes)."""
    from pagedserve.ops.cpu import matmul as mm

    if not mm.avx2_gemm_available():
        print("AVX2 bf16 matmul not available here; skipped")
        return
    g = torch.Generator().manual_seed(2)
    layers = [[torch.randn(n, k, generator=g) * 0.05 for n, k in SHAPES] for _ in range(30)]
    head = torch.randn(49152, 576, generator=g) * 0.05
    bf = [[w.to(torch.bfloat16) for w in layer] for layer in layers]
    own = [[mm.avx2_layout(w) for w in layer] for layer in bf]
    f32 = [[pack_weight(w.float()) for w in layer] for layer in bf]
    head_bf, head_own, head_f32 = head.to(torch.bfloat16), mm.avx2_layout(head.to(torch.bfloat16)), pack_weight(head.to(torch.bfloat16).float())
    for m in ms:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in SHAPES}
        xf = {k: v.float() for k, v in xs.items()}
        for w, o in zip(bf[0], own[0]):
            x = xs[w.shape[1]]
            torch.testing.assert_close(mm.avx2_gemm(x, o, None, w.shape[0]).float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)
        sides = {
            "F.linear bf16": lambda: [F.linear(xs[w.shape[1]], w) for layer in bf for w in layer] + [F.linear(xs[576], head_bf)],
            "oneDNN fp32": lambda: [packed_linear(xf[w.shape[1]], p) for layer, pl in zip(bf, f32) for w, p in zip(layer, pl)] + [packed_linear(xf[576], head_f32)],
            "AVX2 bf16": lambda: [mm.avx2_gemm(xs[w.shape[1]], o, None, w.shape[0]) for layer, ol in zip(bf, own) for w, o in zip(layer, ol)] + [mm.avx2_gemm(xs[576], head_own, None, 49152)],
        }
        if m > 64:
            sides.pop("F.linear bf16")  # minutes at prefill sizes
        ab(f"bf16 projections + LM head, M = {m}", sides, rounds)


def _build(flags: list[str], out: str, fn_name: str):
    src = os.path.join(CSRC, "paged_attention.c")
    subprocess.run(["cc", "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast", src, "-o", out, "-lm"], check=True)
    fn = getattr(ctypes.CDLL(out), fn_name)
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn.restype = ctypes.c_int
    fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float]
    return fn


def attention(rounds: int, dtype: torch.dtype) -> None:
    heads, kv_heads, d, bs, seqs = 9, 3, 64, 16, 32
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(148, 561, (seqs,), generator=g)
    nblocks = [math.ceil(int(n) / bs) for n in lens]
    pool = sum(nblocks) * 30  # one layer's blocks scattered over a 30-layer-sized pool: read cold
    kc, vc = torch.randn(pool, kv_heads, bs, d, generator=g), torch.randn(pool, kv_heads, bs, d, generator=g)
    ids = torch.randperm(pool, generator=g)[: sum(nblocks)]
    tables = torch.zeros(seqs, max(nblocks), dtype=torch.int64)
    at = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = ids[at : at + nb]
        at += nb
    q = torch.randn(seqs, heads, d, generator=g)
    kc, vc, q = kc.to(dtype), vc.to(dtype), q.to(dtype)
    scale = 1 / math.sqrt(d)
    want = torch.empty(q.shape)
    for t in range(seqs):
        k, v = (c[tables[t, : nblocks[t]]].transpose(0, 1).reshape(kv_heads, -1, d)[:, : int(lens[t])] for c in (kc, vc))
        qq = q[t].view(kv_heads, heads // kv_heads, d)
        k, v, qq = k.float(), v.float(), qq.float()
        want[t] = (torch.softmax(qq @ k.transpose(1, 2) * scale, -1) @ v).reshape(heads, d)
    with tempfile.TemporaryDirectory() as tmp:
        name = "paged_attention_f32" if dtype == torch.float32 else "paged_attention_bf16"
        fns = {"generic C": _build(["-mno-avx2", "-mno-fma"], os.path.join(tmp, "generic.so"), name), "AVX2": _build([], os.path.join(tmp, "avx2.so"), name)}
        calls = {}
        for name, fn in fns.items():
            out = torch.empty_like(q)
            args = (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), tables.shape[1], None, lens.data_ptr(), out.data_ptr(), seqs, heads, kv_heads, d, bs, scale)
            assert fn(*args) == 0
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), want.float(), rtol=tol * 10, atol=tol)
            calls[name] = lambda fn=fn, args=args, keep=out: fn(*args)  # keep: out must outlive the calls
        ab(f"decode attention, 32 x 148-560 tokens, one layer, {dtype}", calls, rounds, reps=20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--only", choices=["fp32", "bf16", "attention"], default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256], help="M of the bf16 comparison")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0] if os.path.exists("/proc/cpuinfo") else ""
    print(f"threads {args.threads}; avx2 {' avx2' in flags}, avx512f {' avx512f' in flags}")
    if args.only in (None, "fp32"):
        projections(args.rounds)
    if args.only in (None, "bf16"):
        projections_bf16(args.rounds, tuple(args.rows))
    if args.only in (None, "attention"):
        attention(args.rounds, torch.float32)
        attention(args.rounds, torch.bfloat16)


if __name__ == "__main__":
    main()
