"""The multi-LoRA delta kernel (``csrc/lora/``, through ``pagedserve.ops.cpu.lora_ops``) and the
slots' PyTorch path (``pagedserve.model.lora_slots``).

- ``add_lora_delta`` against the float64 ``out + (x @ AT[s]) @ BT[s]``, float32 and bf16, random
  shapes (T = 1 up, K, N and R not multiples of the vectors or the blocks, ranks padded below R,
  rows of -1 and of an empty slot left bit for bit): float32 within ``RTOL_F32`` of the size of
  the terms, bf16 within its unit roundoff of the result plus that;
- bf16 weights (the slots of a bf16 model), with float32 and bf16 x and out: against the float64
  reference computed from the same bf16 weights (the same tolerances), and bit for bit the result
  of float32 weights holding those values (the kernel widens them exactly);
- batch invariance: a row alone gives the bits it gives in a batch (also over two threads), for
  float32 and bf16 weights;
- every ISA unit (``PAGEDSERVE_CPU_ISA`` caps scalar / avx2 / avx512, each in a child process)
  passes these checks, and the AVX2 and AVX-512 units give the same bits (both fuse each product
  and sum; the portable unit rounds each product, so its last bits differ);
- the PyTorch path agrees (float32 and bf16 slots); bad arguments raise ValueError and write
  nothing.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from pagedserve.model import lora_slots
from pagedserve.ops.cpu import lora_ops

RTOL_F32 = 1e-5
BF16_U = 2.0**-8

needs_lora = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or os.environ.get("PAGEDSERVE_CPU_KERNELS") == "0", reason="no C kernels here"
)

# (S slots, R rank columns, K inputs, N outputs, T rows)
SHAPES = [(1, 8, 16, 64, 1), (3, 16, 100, 70, 11), (4, 48, 576, 960, 9), (2, 24, 33, 7, 1), (5, 32, 256, 129, 40), (2, 19, 3, 5, 17)]


def _case(shape, seed: int, dtype=torch.float32):
    """at, bt, ranks (slot 0 full, the last slot empty when S > 1, others padded), x, out,
    row_slots (every slot, -1 rows)."""
    S, R, K, N, T = shape
    g = torch.Generator().manual_seed(seed)
    at = torch.randn(S, K, R, generator=g) * 0.1
    bt = torch.randn(S, R, N, generator=g) * 0.1
    ranks = torch.randint(1, R + 1, (S,), generator=g, dtype=torch.int32)
    ranks[0] = R
    if S > 1:
        ranks[-1] = 0
    for s in range(S):  # padding columns are zero in the slots
        at[s, :, int(ranks[s]) :] = 0
        bt[s, int(ranks[s]) :] = 0
    x = torch.randn(T, K, generator=g).to(dtype)
    out = torch.randn(T, N, generator=g).to(dtype)
    row_slots = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    return at, bt, ranks, x, out, row_slots


def _reference(at, bt, x, out, row_slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result and the size of its terms (|out| + (|x| @ |AT|) @ |BT|)."""
    ref, size = out.double().clone(), out.double().abs()
    for t, s in enumerate(row_slots.tolist()):
        if s >= 0:
            ref[t] += (x[t].double() @ at[s].double()) @ bt[s].double()
            size[t] += (x[t].double().abs() @ at[s].double().abs()) @ bt[s].double().abs()
    return ref, size


def check_against_float64() -> None:
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            at, bt, ranks, x, out, row_slots = _case(shape, seed=i, dtype=dtype)
            y = out.clone()
            lora_ops.add_lora_delta(y, x, at, bt, ranks, row_slots)
            ref, size = _reference(at, bt, x, out, row_slots)
            err = (y.double() - ref).abs()
            bound = RTOL_F32 * size + (BF16_U * ref.abs() if dtype == torch.bfloat16 else 0) + 1e-30
            assert (err <= bound).all(), (shape, dtype, (err / (size + 1e-30)).max().item())
            untouched = (row_slots < 0) | (ranks[row_slots.clamp(min=0).long()] == 0)
            assert torch.equal(y[untouched], out[untouched]), (shape, dtype)


def check_bf16_weights() -> None:
    """bf16 weights against the float64 reference from the same bf16 values, and bit for bit the
    kernel's result on float32 weights holding them; -1 rows and empty slots untouched."""
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            at, bt, ranks, x, out, row_slots = _case(shape, seed=300 + i, dtype=dtype)
            at16, bt16 = at.bfloat16(), bt.bfloat16()
            y = out.clone()
            lora_ops.add_lora_delta(y, x, at16, bt16, ranks, row_slots)
            ref, size = _reference(at16, bt16, x, out, row_slots)
            err = (y.double() - ref).abs()
            bound = RTOL_F32 * size + (BF16_U * ref.abs() if dtype == torch.bfloat16 else 0) + 1e-30
            assert (err <= bound).all(), (shape, dtype, (err / (size + 1e-30)).max().item())
            untouched = (row_slots < 0) | (ranks[row_slots.clamp(min=0).long()] == 0)
            assert torch.equal(y[untouched], out[untouched]), (shape, dtype)
            y32 = out.clone()
            lora_ops.add_lora_delta(y32, x, at16.float(), bt16.float(), ranks, row_slots)
            assert torch.equal(y, y32), (shape, dtype)


def check_rows_do_not_depend_on_the_batch() -> None:
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            for wdtype in (torch.float32, torch.bfloat16):
                at, bt, ranks, x, out, row_slots = _case(shape, seed=100 + i, dtype=dtype)
                at, bt = at.to(wdtype), bt.to(wdtype)
                full = out.clone()
                lora_ops.add_lora_delta(full, x, at, bt, ranks, row_slots)
                T = shape[4]
                for lo, hi in ((0, 1), (T - 1, T), (0, T // 2), (T // 3, T)):
                    if hi <= lo:
                        continue
                    part = out[lo:hi].clone()
                    lora_ops.add_lora_delta(part, x[lo:hi], at, bt, ranks, row_slots[lo:hi].clone())
                    assert torch.equal(part, full[lo:hi]), (shape, dtype, wdtype, lo, hi)


def results_digest() -> str:
    """A digest of the kernel's bits on every case (float32 and bf16 weights)."""
    h = hashlib.sha256()
    for i, shape in enumerate(SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            for wdtype in (torch.float32, torch.bfloat16):
                at, bt, ranks, x, out, row_slots = _case(shape, seed=200 + i, dtype=dtype)
                lora_ops.add_lora_delta(out, x, at.to(wdtype), bt.to(wdtype), ranks, row_slots)
                h.update(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy().tobytes())
    return h.hexdigest()


@needs_lora
def test_lora_kernel_against_float64():
    check_against_float64()


@needs_lora
def test_lora_kernel_bf16_weights():
    check_bf16_weights()


@needs_lora
def test_lora_kernel_rows_do_not_depend_on_the_batch():
    check_rows_do_not_depend_on_the_batch()


@needs_lora
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_lora_kernel_threads_do_not_change_the_bits(wdtype):
    at, bt, ranks, x, out, row_slots = _case((3, 16, 256, 256, 40), seed=7)
    at, bt = at.to(wdtype), bt.to(wdtype)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y = out.clone()
            lora_ops.add_lora_delta(y, x, at, bt, ranks, row_slots)
            results.append(y)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(results[0], results[1])


@needs_lora
def test_lora_kernel_strided_and_float16():
    at, bt, ranks, x, out, row_slots = _case((3, 16, 100, 70, 11), seed=3)
    want = out.clone()
    lora_ops.add_lora_delta(want, x, at, bt, ranks, row_slots)
    wide_x, wide_out = torch.randn(11, 130), torch.randn(11, 90)
    wide_x[:, 20:120] = x
    wide_out[:, 10:80] = out
    before = wide_out.clone()
    lora_ops.add_lora_delta(wide_out[:, 10:80], wide_x[:, 20:120], at, bt, ranks, row_slots)
    assert torch.equal(wide_out[:, 10:80], want)
    assert torch.equal(wide_out[:, :10], before[:, :10]) and torch.equal(wide_out[:, 80:], before[:, 80:])
    out_t = out.T.contiguous().T  # column-major: computed in a copy, copied back
    lora_ops.add_lora_delta(out_t, x, at, bt, ranks, row_slots)
    assert torch.equal(out_t, want)
    h = out.half()
    lora_ops.add_lora_delta(h, x.half(), at, bt, ranks, row_slots)
    w32 = out.half().float()
    lora_ops.add_lora_delta(w32, x.half().float(), at, bt, ranks, row_slots)
    assert torch.equal(h, w32.half())


@needs_lora
def test_lora_kernel_bad_arguments_write_nothing():
    at, bt, ranks, x, out, row_slots = _case((3, 16, 100, 70, 11), seed=4)
    y = out.clone()
    bad = row_slots.clone()
    bad[5] = 3
    with pytest.raises(ValueError, match="row slot"):
        lora_ops.add_lora_delta(y, x, at, bt, ranks, bad)
    bad[5] = -2
    with pytest.raises(ValueError, match="row slot"):
        lora_ops.add_lora_delta(y, x, at, bt, ranks, bad)
    with pytest.raises(ValueError, match="rank"):
        lora_ops.add_lora_delta(y, x, at, bt, torch.tensor([17, 1, 1], dtype=torch.int32), row_slots)
    assert torch.equal(y, out)
    with pytest.raises(ValueError, match="int32"):
        lora_ops.add_lora_delta(y, x, at, bt, ranks, row_slots.long())
    with pytest.raises(ValueError, match="dtype"):
        lora_ops.add_lora_delta(y, x.double(), at, bt, ranks, row_slots)
    with pytest.raises(ValueError, match="do not fit"):
        lora_ops.add_lora_delta(y, x[:, :50], at, bt, ranks, row_slots)
    with pytest.raises(ValueError, match="float32"):
        lora_ops.add_lora_delta(y, x, at.half(), bt, ranks, row_slots)
    with pytest.raises(ValueError, match="both float32 or both bfloat16"):
        lora_ops.add_lora_delta(y, x, at.bfloat16(), bt, ranks, row_slots)
    with pytest.raises(ValueError, match="same rows"):
        lora_ops.add_lora_delta(y[:3], x, at, bt, ranks, row_slots)
    lora_ops.add_lora_delta(y[:0], x[:0], at, bt, ranks, row_slots[:0])  # no rows: nothing to do
    assert torch.equal(y, out)


@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16])
def test_torch_path_agrees_with_the_kernel(monkeypatch, slot_dtype):
    """LoRASlots.add_delta through PyTorch (no kernel) against the float64 reference (from the
    slots' values: bf16 slots hold rounded factors), and against the kernel where it is available;
    rows of -1 and of an empty slot untouched."""
    from pagedserve.model.lora import LoRAModelSpec

    spec = LoRAModelSpec(num_layers=1, hidden_size=64, q_size=64, kv_size=32, intermediate_size=96)
    slots = lora_slots.LoRASlots(spec, max_loras=3, max_rank=8, device=torch.device("cpu"), dtype=slot_dtype)
    assert slots.dtype == slot_dtype and slots.AT[(0, "qkv")].dtype == slots.BT[(0, "down")].dtype == slot_dtype
    g = torch.Generator().manual_seed(0)
    for s, r in ((0, 8), (1, 3)):  # slot 2 empty
        slots.AT[(0, "gate_up")][s, :, : 2 * r] = torch.randn(64, 2 * r, generator=g)
        slots.BT[(0, "gate_up")][s, : 2 * r] = torch.randn(2 * r, 192, generator=g) * 0.1
        slots.ranks[(0, "gate_up")][s] = 2 * r
        slots._ranks_list[(0, "gate_up")][s] = 2 * r
    row_slots = torch.tensor([0, 1, -1, 2, 1, 0, 0, -1], dtype=torch.int32)
    at, bt = slots.AT[(0, "gate_up")], slots.BT[(0, "gate_up")]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8, 64, generator=g).to(dtype)
        out = torch.randn(8, 192, generator=g).to(dtype)
        ref, size = _reference(at, bt, x, out, row_slots)
        results = {}
        for kernel in (False, True):
            if kernel and not lora_ops.lora_kernel_available():
                continue
            monkeypatch.setattr(lora_slots, "lora_kernel_available", lambda k=kernel: k)
            y = out.clone()
            slots.add_delta(y, x, 0, "gate_up", row_slots)
            err = (y.double() - ref).abs()
            bound = RTOL_F32 * size + (BF16_U * ref.abs() if dtype == torch.bfloat16 else 0) + 1e-30
            assert (err <= bound).all(), (dtype, kernel, slot_dtype)
            assert torch.equal(y[[2, 3, 7]], out[[2, 3, 7]])
            results[kernel] = y
        if len(results) == 2 and dtype == torch.float32:
            torch.testing.assert_close(results[False], results[True], rtol=1e-5, atol=1e-5)
    # the PyTorch path groups a step's rows once (the same tensor), again once modified in place
    monkeypatch.setattr(lora_slots, "lora_kernel_available", lambda: False)
    x, y = torch.randn(8, 64), torch.zeros(8, 192)
    slots.add_delta(y, x, 0, "gate_up", row_slots)
    first = slots._groups(row_slots)
    assert slots._groups(row_slots) is first
    row_slots[2] = 0
    assert slots._groups(row_slots) is not first
    with pytest.raises(ValueError, match="outside"):
        slots.add_delta(y, x, 0, "gate_up", torch.tensor([0, 1, 3, 0, 0, 0, 0, 0], dtype=torch.int32))


@needs_lora
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the ISA units are x86-64's")
def test_lora_kernel_under_each_isa_cap():
    digests = {}
    for cap in ("scalar", "avx2", "avx512"):
        env = dict(os.environ, PAGEDSERVE_CPU_ISA=cap, OMP_NUM_THREADS="2")
        r = subprocess.run([sys.executable, __file__, cap], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"ok {cap} " in r.stdout, (cap, r.stdout)
        digests[cap] = r.stdout.split()[-1]
    assert digests["avx2"] == digests["avx512"]  # on a host without AVX-512 both run the AVX2 unit


if __name__ == "__main__":  # a child of test_lora_kernel_under_each_isa_cap
    assert lora_ops.lora_kernel_available()
    check_against_float64()
    check_bf16_weights()
    check_rows_do_not_depend_on_the_batch()
    print("ok", sys.argv[1], results_digest())
