"""The matmul on quantized weights and their dequantization (``csrc/quant/``, through
``pagedserve.ops.cpu.quant_matmul``).

- ``qdequant`` is bit for bit ``QuantizedWeight.dequantize(dtype)`` (float32 and bf16);
- ``qgemm`` (any M) against the float64 product ``x.double() @ w.dequantize().double().T``: each
  output within ``RTOL_F32`` (float32 out) or bf16's unit roundoff 2^-8 plus that (bf16 out) of
  ``|x| @ |W|.T``, the size of the terms summed (a float32 sum of 576 terms is within ~3e-5 of it
  at worst, ~3e-7 observed);
- ``qgemm``'s rows do not depend on the batch: a row alone gives the bits it gives among others
  (the register tiles of few rows and the dequantized panels of many compute the same sums);
- ``quant_matmul`` the same (qgemm at every M by default; dequantize + ``F.linear`` above
  ``QGEMM_MAX_ROWS`` when set: bf16 rounds the weight too, 2^-7), with a bias, and ``F.linear``
  on the reference without the kernels; bad arguments raise ValueError (C: a nonzero return).

Every ISA path runs: this host's in the process, and each ``PAGEDSERVE_CPU_ISA`` cap (scalar,
avx2, avx512) in a child process running this file (the cap is read once per library), as
``test_kernel_isa.py`` does; a cap above the host's level runs the host's.
"""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedserve.ops.cpu import quant_matmul as qm
from pagedserve.ops.quantized import QuantizedWeight

RTOL_F32 = 1e-5
BF16_U = 2.0**-8  # bf16's unit roundoff (8 significant bits)

needs_quant = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or os.environ.get("PAGEDSERVE_CPU_KERNELS") == "0", reason="no C kernels here"
)


def random_weight(bits: int, group: int, n: int, k: int, mins: bool, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    mn = torch.randn(n, k // group, generator=g) * 0.05 if mins else None
    return QuantizedWeight(q, scales, mn, bits, group, f"test{bits}")


# (bits, group (0: K), N, K, mins): every group of each bit width, N odd and even, K up to 576
WEIGHTS = [
    (bits, group, n, k, mins)
    for (bits, group), (n, k), mins in itertools.product(
        [(4, 32), (4, 64), (4, 0), (8, 16), (8, 32), (8, 64), (8, 0)], [(7, 64), (33, 576), (96, 32)], [False, True]
    )
    if (group or k) <= k and k % (group or k) == 0
]
ROWS = [1, 2, 3, 5, 8, 16, 17, 40]


def _weight(spec: tuple) -> QuantizedWeight:
    bits, group, n, k, mins = spec
    return random_weight(bits, group or k, n, k, mins, seed=hash(spec) % 1000)


def _check_close(y: torch.Tensor, x: torch.Tensor, w: QuantizedWeight, rtol: float, bias=None, wd=None) -> None:
    wd = w.dequantize().double() if wd is None else wd
    ref = x.double() @ wd.T
    size = x.double().abs() @ wd.abs().T
    if bias is not None:
        ref, size = ref + bias.double(), size + bias.double().abs()
    err = (y.double() - ref).abs()
    assert (err <= rtol * size + 1e-30).all(), f"max relative error {(err / (size + 1e-30)).max().item():.3g} > {rtol:.3g}"


def check_qgemm_and_dequant(specs=WEIGHTS, rows=ROWS) -> None:
    """The numerical checks of every test (also run under each ISA cap)."""
    for spec in specs:
        w = _weight(spec)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(qm.dequantize(w, dtype), w.dequantize(dtype)), (spec, dtype)
        g = torch.Generator().manual_seed(1)
        wd = w.dequantize().double()
        for m in rows:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, w.in_features, generator=g).to(dtype)
                y = qm.qgemm(x, w)
                assert y.dtype == dtype and y.shape == (m, w.out_features)
                _check_close(y, x, w, RTOL_F32 if dtype == torch.float32 else BF16_U + RTOL_F32, wd=wd)


@needs_quant
@pytest.mark.parametrize("spec", WEIGHTS, ids=lambda s: "q{}-g{}-{}x{}{}".format(s[0], s[1] or "K", s[2], s[3], "-min" if s[4] else ""))
def test_quant_qgemm_and_qdequant(spec):
    check_qgemm_and_dequant([spec])


def check_every_row_count(top: int = 50) -> None:
    """Every M up to ``top`` (each register tile, and the balanced tiles of several passes), with
    whole tiles of outputs and single ones after (N = 19), both bit widths."""
    for bits in (4, 8):
        w = random_weight(bits, 32, 19, 64, True, seed=bits)
        wd = w.dequantize().double()
        x = torch.randn(top, 64, generator=torch.Generator().manual_seed(2))
        for m in range(1, top + 1):
            _check_close(qm.qgemm(x[:m], w), x[:m], w, RTOL_F32, wd=wd)


def check_rows_do_not_depend_on_the_batch() -> None:
    """Slices of a 70-row x (alone, few rows: register tiles; many: the panels) give the bits of
    the same rows in the whole batch."""
    for bits, group, (n, k), mins in itertools.product((4, 8), (32, 64), [(7, 64), (130, 576)], (False, True)):
        w = random_weight(bits, group, n, k, mins, seed=n + bits)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(70, k, generator=torch.Generator().manual_seed(3)).to(dtype)
            full = qm.qgemm(x, w)
            for lo, hi in ((0, 1), (69, 70), (0, 2), (5, 13), (3, 19), (0, 40), (30, 70)):
                assert torch.equal(qm.qgemm(x[lo:hi], w), full[lo:hi]), (bits, group, n, k, mins, dtype, lo, hi)


@needs_quant
def test_quant_qgemm_every_row_count():
    check_every_row_count()


@needs_quant
def test_quant_qgemm_rows_do_not_depend_on_the_batch():
    check_rows_do_not_depend_on_the_batch()


@needs_quant
@pytest.mark.parametrize("max_rows", [None, 16])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_matmul_with_and_without_bias(m, dtype, max_rows, monkeypatch):
    monkeypatch.setattr(qm, "QGEMM_MAX_ROWS", max_rows)
    w = random_weight(4, 32, 33, 576, True)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(33, generator=torch.Generator().manual_seed(7)).to(dtype)
    dense = max_rows is not None and m > max_rows  # dequantize + F.linear: a bf16 weight is rounded too
    rtol = RTOL_F32 if dtype == torch.float32 else (2 * BF16_U if dense else BF16_U) + RTOL_F32
    for b in (None, bias):
        y = qm.quant_matmul(x, w, b)
        assert y.dtype == dtype and y.shape == (m, 33)
        _check_close(y, x, w, rtol, b)
        if not dense:  # qgemm, then the bias in float32 and one rounding
            want = qm.qgemm(x, w, torch.float32) + (0 if b is None else b.float())
            assert torch.equal(y, want.to(dtype))


def test_quant_matmul_uses_qgemm_at_every_m_by_default():
    """Rows independent of the batch, as the engine needs; F.linear only where a caller sets
    QGEMM_MAX_ROWS."""
    assert qm.QGEMM_MAX_ROWS is None and qm.QGEMM_CROSSOVER_ROWS > 0


@needs_quant
def test_quant_matmul_x_rows_apart_and_strided():
    w = random_weight(8, 16, 96, 64, True)
    wide = torch.randn(5, 100).to(torch.bfloat16)
    x = wide[:, 10:74]  # rows 100 apart
    want = qm.qgemm(x.contiguous(), w)
    assert torch.equal(qm.qgemm(x, w), want)
    assert torch.equal(qm.quant_matmul(x, w), want)
    xt = x.contiguous().t().contiguous().t()  # column-major
    assert torch.equal(qm.quant_matmul(xt, w), want)
    assert torch.equal(qm.quant_matmul(wide[2:3, 10:74], w), want[2:3])
    assert qm.quant_matmul(x[:0], w).shape == (0, 96)
    # float32 out of bf16 x: the same sums, rounded once to bf16 after
    assert torch.equal(qm.qgemm(x, w, torch.float32).to(torch.bfloat16), want)


def test_quant_matmul_without_the_kernels_is_the_reference(monkeypatch):
    monkeypatch.setattr(qm, "get_quant_lib", lambda: None)
    w = random_weight(4, 64, 33, 576, True)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 576).to(dtype)
        bias = torch.randn(33).to(dtype)
        assert torch.equal(qm.quant_matmul(x, w, bias), F.linear(x, w.dequantize(dtype), bias))
        assert torch.equal(qm.dequantize(w, dtype), w.dequantize(dtype))
    with pytest.raises(RuntimeError):
        qm.qgemm(torch.randn(1, 576), w)


def test_quant_matmul_bad_arguments_raise_value_error():
    w = random_weight(8, 32, 7, 64, False)
    with pytest.raises(ValueError, match="inputs"):
        qm.quant_matmul(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="2-D"):
        qm.quant_matmul(torch.randn(64), w)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        qm.quant_matmul(torch.randn(2, 64).double(), w)
    x16 = torch.randn(2, 64).half()  # float16 is computed in float32 and rounded back
    assert torch.equal(qm.quant_matmul(x16, w), qm.quant_matmul(x16.float(), w).half())
    with pytest.raises(ValueError, match="bias"):
        qm.quant_matmul(torch.randn(2, 64), w, torch.randn(8))
    with pytest.raises(ValueError, match="QuantizedWeight"):
        qm.quant_matmul(torch.randn(2, 64), w.dequantize())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out_dtype"):
        qm.qgemm(torch.randn(2, 64), w, torch.float16)


@needs_quant
def test_quant_c_entry_points_reject_bad_arguments():
    lib = qm.get_quant_lib()
    assert lib is not None
    w = random_weight(4, 32, 7, 64, True)
    x, out = torch.randn(2, 64), torch.empty(2, 7)
    q, s, mn = w.qdata.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr()

    def gemm(bits=4, group=32, m=2, k=64, ldx=64, n=7, ldo=7):
        return lib.qgemm(x.data_ptr(), 0, m, k, ldx, q, bits, group, s, mn, n, out.data_ptr(), 0, ldo)

    assert gemm() == 0
    for bad in ({"bits": 5}, {"group": 16}, {"group": 48}, {"group": 0}, {"m": -1}, {"k": 0}, {"ldx": 32}, {"n": -1}, {"ldo": 6}, {"k": 80}):
        assert gemm(**bad) == -1, bad
    assert gemm(bits=8, group=16, k=32) == 0 and gemm(m=0) == 0 and gemm(n=0) == 0
    assert lib.qgemm(x.data_ptr(), 0, 2, 64, 64, None, 4, 32, s, mn, 7, out.data_ptr(), 0, 7) == -1
    dense = torch.empty(7, 64)
    assert lib.qdequant(q, 4, 32, s, mn, 7, 64, dense.data_ptr(), 0) == 0
    assert lib.qdequant(q, 4, 32, s, mn, 7, 80, dense.data_ptr(), 0) == -1
    assert lib.qdequant(q, 4, 32, None, mn, 7, 64, dense.data_ptr(), 0) == -1


@needs_quant
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the ISA units are x86-64's")
@pytest.mark.parametrize("cap", ["scalar", "avx2", "avx512"])
def test_quant_kernels_under_each_isa_cap(cap):
    env = dict(os.environ, PAGEDSERVE_CPU_ISA=cap, OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, __file__, cap], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ok {cap}" in r.stdout


if __name__ == "__main__":  # a child of test_quant_kernels_under_each_isa_cap
    assert qm.get_quant_lib() is not None
    check_qgemm_and_dequant()
    check_every_row_count()
    check_rows_do_not_depend_on_the_batch()
    print("ok", sys.argv[1])
