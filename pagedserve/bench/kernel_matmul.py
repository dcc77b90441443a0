"""``pagedserve bench kernels --op matmul``: the bf16 matmul this host uses against its peers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass  # imported where used: the CLI parser (and a server front) must not load torch

from pagedserve.bench.kernel_common import MATMUL_SHAPES, _case, _rev_csrc, alternate, build_variant


# -- matmul ----------------------------------------------------------------------------------
def op_matmul(args: argparse.Namespace, tmp: str) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagedserve.model.packed_linear import PackedLinear, attach_small_gemm, onednn_packs, pack_weight, packed_linear
    from pagedserve.ops.cpu import matmul as mm

    shapes, layers = MATMUL_SHAPES[args.shapes]
    if args.tiny:
        layers = 2
    default_rows = "1,32" if args.tiny else ("1,32,256" if args.dtype == "float32" else "1,4,16,32,64,256,2048")
    rows = [int(r) for r in (args.rows or default_rows).split(",")]
    g = torch.Generator().manual_seed(0)
    dims = [(n, k) for _ in range(layers) for n, k in shapes]
    if args.lm_head:
        dims.append((49152, 576))
    weights = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for n, k in dims]
    params = sum(n * k for n, k in dims)
    cases = []
    if args.dtype == "float32":
        wf = [w.float() for w in weights]
        packed = [pack_weight(w) for w in wf]
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g) for _, k in dims}
            torch.testing.assert_close(packed_linear(xs[wf[0].shape[1]], packed[0]), F.linear(xs[wf[0].shape[1]], wf[0]), rtol=1e-4, atol=1e-4)
            sides = alternate(
                {
                    "oneDNN fp32": lambda: [packed_linear(xs[w.shape[1]], p) for w, p in zip(wf, packed)],
                    "F.linear fp32": lambda: [F.linear(xs[w.shape[1]], w) for w in wf],
                },
                args.rounds,
            )
            cases.append(
                _case(
                    "matmul",
                    f"{args.shapes} fp32, {len(dims)} weights, M = {m}",
                    sides,
                    "oneDNN fp32",
                    {"GB/s": params * 4 / 1e9, "GFLOP/s": 2 * m * params / 1e9},
                    rows=m,
                    dtype="float32",
                )
            )
        return cases

    engine = []
    plans: dict = {}
    for w in weights:
        pl = PackedLinear(w)
        attach_small_gemm(pl, plans)
        engine.append(pl)
    kind = "AMX" if engine[0].amx_weight is not None else "AVX2 bf16" if engine[0].avx2_weight is not None else "oneDNN"
    onednn = [pack_weight(w) for w in weights] if onednn_packs(torch.bfloat16) and kind != "oneDNN" else None
    if onednn is not None:
        for p in onednn:
            mm.collapse_to_huge_pages(*mm._packed_address(p))
    avx2_host = kind == "AVX2 bf16"
    f32 = [pack_weight(w.float()) for w in weights] if avx2_host else None
    rev_fn = None
    if args.rev:
        lib = build_variant("decode", [], tmp, "rev", _rev_csrc(args.rev, tmp))
        rev_fn = {"AMX": lib.amx_gemm_bf16, "AVX2 bf16": lib.avx2_gemm_bf16, "oneDNN": lib.small_gemm_bf16}[kind]
    print(
        f"matmul: {len(dims)} weights of {args.shapes} ({params / 1e6:.1f} M params, bf16), the engine's kernel: {kind}"
        + ("" if kind != "oneDNN" else f" (small-M plans {sorted(set(v for v in plans.values() if v))})"),
        flush=True,
    )

    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in dims}
        small = kind == "oneDNN" and m <= mm.SMALL_GEMM_MAX_ROWS and all(pl.small_plan for pl in engine)
        if kind == "oneDNN":
            name = "small-M" if small else "oneDNN"
            if small:
                calls = [(xs[pl.in_features], pl.packed_weight, pl.out_features, pl.small_plan) for pl in engine]
                fns = {name: lambda calls=calls: [mm.small_gemm(x, p, None, n, plan) for x, p, n, plan in calls]}
                fns["oneDNN"] = lambda: [packed_linear(xs[pl.in_features], pl.packed_weight) for pl in engine]
            else:
                fns = {name: lambda: [packed_linear(xs[pl.in_features], pl.packed_weight) for pl in engine]}
        else:
            name = kind
            gemm = mm.amx_gemm if kind == "AMX" else mm.avx2_gemm
            own = [pl.amx_weight if kind == "AMX" else pl.avx2_weight for pl in engine]
            fns = {name: lambda gemm=gemm, own=own: [gemm(xs[w.shape[1]], o, None, w.shape[0]) for w, o in zip(weights, own)]}
            if onednn is not None:
                fns["oneDNN bf16"] = lambda: [packed_linear(xs[w.shape[1]], p) for w, p in zip(weights, onednn)]
        if f32 is not None:
            xf = {k: v.float() for k, v in xs.items()}
            fns["oneDNN fp32"] = lambda xf=xf: [packed_linear(xf[w.shape[1]], p) for w, p in zip(weights, f32)]
            if m <= 64:
                fns["F.linear bf16"] = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]
        if rev_fn is not None and (kind != "oneDNN" or small):
            ys = [torch.empty(m, w.shape[0], dtype=torch.bfloat16) for w in weights]
            if kind == "oneDNN":
                calls = [
                    (
                        xs[pl.in_features].data_ptr(),
                        pl.in_features,
                        torch.ops.mkldnn.data_ptr(pl.packed_weight),
                        y.data_ptr(),
                        pl.out_features,
                        *pl.small_plan,
                    )
                    for pl, y in zip(engine, ys)
                ]
                run = lambda calls=calls: [rev_fn(x, m, k, w, None, y, n, c, b) for x, k, w, y, n, c, b in calls]  # noqa: E731
            else:
                calls = [(xs[w.shape[1]].data_ptr(), w.shape[1], o.data_ptr(), y.data_ptr(), w.shape[0]) for w, o, y in zip(weights, own, ys)]
                run = lambda calls=calls: [rev_fn(x, m, k, w, None, y, n) for x, k, w, y, n in calls]  # noqa: E731
            fns[f"{name}@{args.rev}"] = run
        # Checks, once: the engine's side against oneDNN bit for bit (small-M) or a float32 product.
        got = fns[name]()
        w0 = weights[0]
        ref = xs[w0.shape[1]].float() @ w0.float().t()
        torch.testing.assert_close(got[0].float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        if small:
            ref_bits = fns["oneDNN"]()
            if any(not torch.equal(a, b) for a, b in zip(got, ref_bits)):
                raise SystemExit(f"M = {m}: the small-M kernel's output differs from oneDNN's")
        if rev_fn is not None and f"{name}@{args.rev}" in fns:
            fns[f"{name}@{args.rev}"]()
            if any(not torch.equal(a, b) for a, b in zip(got, ys)):
                raise SystemExit(f"M = {m}: {name} at {args.rev} gives other bits than this tree's")
        sides = alternate(fns, args.rounds, reps=max(1, 16 // m) if not args.tiny else 1)
        cases.append(
            _case(
                "matmul",
                f"{args.shapes} bf16, {len(dims)} weights, M = {m}",
                sides,
                name,
                {"GB/s": params * 2 / 1e9, "GFLOP/s": 2 * m * params / 1e9},
                rows=m,
                dtype="bfloat16",
                kernel=name,
            )
        )
    return cases
