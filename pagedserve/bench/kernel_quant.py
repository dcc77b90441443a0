"""``pagedserve bench kernels --op qmatmul``: the matmul on quantized weights (``csrc/quant/``)
against the bf16 matmul the engine uses here, on a model's projections (``--shapes``), at each of
``--rows`` (default 1, 4, 16, 32, 64).

Sides: ``qgemm`` on 4-bit weights (group 32 with a scale and a min: Q4_K / Q4_1 as loaded) and on
8-bit ones (group 32, no min: Q8_0), the 4-bit weights dequantized to bf16 then ``F.linear`` (what
``quant_matmul`` does above ``QGEMM_MAX_ROWS`` where a caller sets it: where it crosses qgemm is
``QGEMM_CROSSOVER_ROWS``), and the engine's bf16 ``PackedLinear``. Every side's weights are distinct and read cold, as in a step,
from 2 MiB pages. Per side the weights' bytes per second (quantized bytes: values, scales and mins)
and their share of the memory-read bandwidth the probe (``stream_read``, as ``bench latency``)
measures on this host: batch-1 decode is bound by it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from pagedserve.bench.kernel_common import MATMUL_SHAPES, _case, alternate

if TYPE_CHECKING:
    import torch

    from pagedserve.ops.quantized import QuantizedWeight


def _arena(weights: list["QuantizedWeight"]) -> list["QuantizedWeight"]:
    """The weights copied into one buffer (64-byte aligned tensors) on 2 MiB pages where Linux
    allows, as the engine keeps weights."""
    import dataclasses

    import torch

    from pagedserve.ops.cpu import matmul as mm

    def tensors(w: "QuantizedWeight") -> list["torch.Tensor"]:
        return [t for t in (w.qdata, w.scales, w.mins) if t is not None]

    size = sum(-(-t.numel() * t.element_size() // 64) * 64 for w in weights for t in tensors(w))
    arena = torch.empty(size, dtype=torch.uint8)
    off = 0
    out = []

    def place(t: "torch.Tensor") -> "torch.Tensor":
        nonlocal off
        n = t.numel() * t.element_size()
        view = arena[off : off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        off += -(-n // 64) * 64
        return view

    for w in weights:
        mins = None if w.mins is None else place(w.mins)
        out.append(dataclasses.replace(w, qdata=place(w.qdata), scales=place(w.scales), mins=mins))
    mm.collapse_to_huge_pages(arena.data_ptr(), size)
    return out


def _random_weight(bits: int, n: int, k: int, mins: bool, g: "torch.Generator") -> "QuantizedWeight":
    import torch

    from pagedserve.ops.quantized import QuantizedWeight

    group = 32
    if bits == 4:
        q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * (0.01 if bits == 4 else 0.0005)
    mn = -8 * scales if mins else None
    return QuantizedWeight(q, scales, mn, bits, group, "Q4_K" if bits == 4 else "Q8_0")


def op_qmatmul(args: argparse.Namespace, tmp: str) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagedserve.model.packed_linear import PackedLinear, attach_small_gemm
    from pagedserve.ops.cpu import matmul as mm
    from pagedserve.ops.cpu import quant_matmul as qm

    if qm.get_quant_lib() is None:
        raise SystemExit("the quantized-weight kernels are not available here")
    shapes, layers = MATMUL_SHAPES[args.shapes]
    if args.tiny:
        layers = 1
    rows = [int(r) for r in (args.rows or ("1,32" if args.tiny else "1,4,16,32,64")).split(",")]
    g = torch.Generator().manual_seed(0)
    dims = [(n, k) for _ in range(layers) for n, k in shapes]
    q4 = _arena([_random_weight(4, n, k, True, g) for n, k in dims])
    q8 = _arena([_random_weight(8, n, k, False, g) for n, k in dims])
    dense = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for n, k in dims]
    plans: dict = {}
    engine = []
    for w in dense:
        pl = PackedLinear(w)
        attach_small_gemm(pl, plans)
        engine.append(pl)
    kind = "AMX" if engine[0].amx_weight is not None else "AVX2 bf16" if engine[0].avx2_weight is not None else "oneDNN"
    nbytes = {
        "qgemm q4": sum(w.nbytes for w in q4),
        "qgemm q8": sum(w.nbytes for w in q8),
        "dequant+F.linear q4": sum(w.nbytes for w in q4),
        f"bf16 {kind}": sum(w.numel() * 2 for w in dense),
    }
    bw = mm.memory_read_bandwidth(32 << 20, 2) if args.tiny else mm.memory_read_bandwidth()
    params = sum(n * k for n, k in dims)
    probe = f"memory read bandwidth (stream_read) {bw / 1e9:.1f} GB/s" if bw else "no bandwidth probe (no kernels)"
    print(
        f"qmatmul: {len(dims)} weights of {args.shapes} ({params / 1e6:.1f} M params); MB read per pass: "
        + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in nbytes.items())
        + f"; {probe}; QGEMM_MAX_ROWS = {qm.QGEMM_MAX_ROWS}, QGEMM_CROSSOVER_ROWS = {qm.QGEMM_CROSSOVER_ROWS}",
        flush=True,
    )
    cases = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in shapes}
        fns: dict[str, Any] = {
            "qgemm q4": lambda: [qm.qgemm(xs[w.in_features], w) for w in q4],
            "qgemm q8": lambda: [qm.qgemm(xs[w.in_features], w) for w in q8],
            "dequant+F.linear q4": lambda: [F.linear(xs[w.in_features], qm._scratch_weight(w, torch.bfloat16)) for w in q4],
            f"bf16 {kind}": lambda: [pl(xs[pl.in_features]) for pl in engine],
        }
        # checks, once: each quantized side against the float product of its dequantized weight
        for name, ws in (("qgemm q4", q4), ("qgemm q8", q8), ("dequant+F.linear q4", q4)):
            got = fns[name]()[0].float()
            ref = xs[ws[0].in_features].float() @ ws[0].dequantize().T
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()), msg=f"{name}, M = {m}: not the float product")
        sides = alternate(fns, args.rounds, reps=max(1, 16 // m) if not args.tiny else 1)
        for name, s in sides.items():
            s["GB/s"] = nbytes[name] / (s["median_ms"] / 1e3) / 1e9
            if bw:
                s["bandwidth_share"] = s["GB/s"] * 1e9 / bw
        cases.append(
            _case(
                "qmatmul",
                f"{args.shapes}, {len(dims)} weights, bf16 x, M = {m}",
                sides,
                "qgemm q4",
                rows=m,
                bandwidth_gbs=(bw or 0) / 1e9,
                kernel=kind,
            )
        )
        print(
            f"qmatmul | M = {m}: weights read at "
            + ", ".join(f"{k} {s['GB/s']:.1f} GB/s" + (f" ({100 * s['bandwidth_share']:.0f}%)" if bw else "") for k, s in sides.items())
            + (" of the probe's bandwidth" if bw else ""),
            flush=True,
        )
    return cases
