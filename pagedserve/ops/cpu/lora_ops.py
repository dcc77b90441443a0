"""The multi-LoRA delta on the CPU through the C kernel of ``csrc/lora/`` (ctypes):
:func:`add_lora_delta` adds, to each row of a projection's output whose adapter slot is >= 0,
``B[s] @ (A[s] @ x[t])``, in place, for rows of several adapters and of the base model in one
batch (S-LoRA / Punica's shrink and expand, here one C call per projection). The weights come
transposed, ``AT = A^T [K, R]`` and ``BT = B^T [R, N]`` per slot: the delta is ``(x @ AT) @ BT``,
and both phases read contiguous rows (vector loops across the rank columns, then across the
outputs; no sum is split across vector lanes).

The arithmetic (``csrc/lora/lora.h``): each rank value a float32 dot product in a fixed order
(four partial sums over k, added pairwise), each delta a float32 sum over the rank in order,
added to the output widened to float32 and rounded once to its dtype; each product and sum fused
where the CPU has FMA. A row's bits depend on that row alone (its input, its adapter), never on
the other rows of the batch nor on the threads (nor on AVX-512 against AVX2: the same fused sums;
the portable loops round each product). The work is split over torch's OpenMP pool (tiles of up
to 8 rows of one adapter times chunks of 16 rank columns, then times blocks of 64 outputs) from
about 128k multiply-adds up.

Measured (one thread, best of 300, a shared 2-core Xeon with AVX-512 and AMX, bf16 x, 4 adapters
of rank 16 on SmolLM2-135M's qkv: K 576, N 960, 48 rank columns): 32 rows 44 us, 1 row 6 us
(``checked=True``; the checks add ~5 us); bf16 ``F.linear`` on the base qkv weight 83 and 66 us.

The weights are float32 or bfloat16 (a bf16 model's slots): bf16 ones are widened exactly as they
are read (a shift, or for BT a shift and a mask over pairs, even and odd outputs apart and put back
in place), so the result is that of float32 weights of the same values, bit for bit, from half
the bytes. While the factors sit in L2 the kernel is bound by its arithmetic (bf16 about even
with float32); in a decode step they stream from L3 or memory (30 layers' slots in turn), where
bf16 slots took (same machine, 32 rows, medians of alternating rounds, the ctypes call alone)
qkv 48 us against 68-74 us for float32 slots, gate_up (K 576, N 3072, 32 rank columns) 83
against 115-147 us, o 17 against 24, down 30 against 44; with one layer's factors in L2, qkv 40
against 42 and gate_up 69 against 81.

The tensors are checked here (ValueError); the C code trusts their layout but checks the slots
and ranks (a slot outside ``[-1, S)`` or a rank outside ``[0, R]`` writes nothing: ValueError).
:mod:`pagedserve.model.lora_slots` holds the adapters' stacked weights and the PyTorch path used
off the CPU or without the kernels.
"""

from __future__ import annotations

import torch

from pagedserve.ops.cpu.build import get_lora_lib

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def lora_kernel_available() -> bool:
    """Whether the C kernel is built and loaded (False with ``PAGEDSERVE_CPU_KERNELS=0`` or no
    C compiler)."""
    return get_lora_lib() is not None


def _check(out: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor) -> None:
    for name, t in (("out", out), ("x", x), ("at", at), ("bt", bt), ("ranks", ranks), ("row_slots", row_slots)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if out.dim() != 2 or x.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"out [T, N] and x [T, K] must be 2-D with the same rows, got {tuple(out.shape)} and {tuple(x.shape)}")
    if x.dtype != out.dtype or x.dtype not in _KERNEL_DTYPES + (torch.float16,):
        raise ValueError(f"x and out must share a float32, bfloat16 or float16 dtype, got {x.dtype} and {out.dtype}")
    if at.dim() != 3 or bt.dim() != 3 or at.dtype not in _KERNEL_DTYPES or bt.dtype != at.dtype:
        raise ValueError(
            f"at [S, K, R] and bt [S, R, N] must be 3-D, both float32 or both bfloat16, got {tuple(at.shape)} {at.dtype} and {tuple(bt.shape)} {bt.dtype}"
        )
    s, k, r = at.shape
    n = out.shape[1]
    if tuple(bt.shape) != (s, r, n) or k != x.shape[1]:
        raise ValueError(f"at {tuple(at.shape)} and bt {tuple(bt.shape)} do not fit x {tuple(x.shape)} and out {tuple(out.shape)}")
    if r < 1 or k < 1 or n < 1:
        raise ValueError(f"empty dimensions: at {tuple(at.shape)}, bt {tuple(bt.shape)}")
    if not (at.is_contiguous() and bt.is_contiguous()):
        raise ValueError("at and bt must be contiguous")
    if ranks.dtype != torch.int32 or tuple(ranks.shape) != (s,) or not ranks.is_contiguous():
        raise ValueError(f"ranks must be a contiguous int32 tensor of shape ({s},), got {ranks.dtype} {tuple(ranks.shape)}")
    if row_slots.dtype != torch.int32 or tuple(row_slots.shape) != (x.shape[0],):
        raise ValueError(f"row_slots must be an int32 tensor of shape ({x.shape[0]},), got {row_slots.dtype} {tuple(row_slots.shape)}")


def add_lora_delta(
    out: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor, checked: bool = False
) -> None:
    """``out[t] += (x[t] @ at[s]) @ bt[s]`` in place, for each row ``t`` with ``s = row_slots[t] >= 0``
    (the first ``ranks[s]`` rank columns of slot ``s``; rows of slot -1 or of a rank-0 slot
    untouched, bit for bit). Each delta is a float32 sum added to ``out`` widened to float32,
    rounded once to its dtype (float16: computed through float32 copies, then rounded back).
    bfloat16 weights are widened exactly as they are read: the bits of float32 weights holding
    the same values (``at.float()``, ``bt.float()``), from half the bytes.

    Args:
        out: ``[T, N]`` float32, bfloat16 or float16, CPU; rows may be a wider tensor's (stride 1
            within a row), else computed in a copy and copied back.
        x: ``[T, K]``, out's dtype, CPU (copied to row-major when it is not).
        at: ``[S, K, R]`` float32 or bfloat16, contiguous: slot s's A transposed (rank columns
            from ``ranks[s]`` on unused).
        bt: ``[S, R, N]``, at's dtype, contiguous: slot s's B transposed (scaling folded in).
        ranks: ``[S]`` int32, contiguous, each in ``[0, R]``.
        row_slots: ``[T]`` int32, each in ``[-1, S)``.
        checked: the caller has checked the shapes, dtypes and devices above (skips those checks,
            about 4 us; the slots and ranks are still checked by the C code).

    Raises:
        ValueError: a tensor of the wrong shape, dtype or device, a slot outside ``[-1, S)``,
            a rank outside ``[0, R]`` (then nothing is written).
        RuntimeError: the kernel is not available (:func:`lora_kernel_available`), or out of memory.
    """
    if not checked:
        _check(out, x, at, bt, ranks, row_slots)
    lib = get_lora_lib()
    if lib is None:
        raise RuntimeError("the LoRA CPU kernel is not available (PAGEDSERVE_CPU_KERNELS=0 or no C compiler)")
    t, n = out.shape
    if t == 0:
        return
    if out.dtype == torch.float16:  # through float32: out rounded once, as for the other dtypes
        out32 = out.float()
        add_lora_delta(out32, x.float(), at, bt, ranks, row_slots, checked=True)
        out.copy_(out32)
        return
    if out.stride(1) != 1 or (t > 1 and out.stride(0) < n):
        tmp = out.contiguous()
        add_lora_delta(tmp, x, at, bt, ranks, row_slots, checked=True)
        out.copy_(tmp)
        return
    s, k, r = at.shape
    if x.stride(1) != 1 or (t > 1 and x.stride(0) < k):
        x = x.contiguous()
    if not row_slots.is_contiguous():
        row_slots = row_slots.contiguous()
    ldx = x.stride(0) if t > 1 else k
    ldo = out.stride(0) if t > 1 else n
    bf16, w_bf16 = int(out.dtype == torch.bfloat16), int(at.dtype == torch.bfloat16)
    rc = lib.lora_add_delta(
        x.data_ptr(), ldx, out.data_ptr(), ldo, bf16, t, row_slots.data_ptr(), s, ranks.data_ptr(), at.data_ptr(), bt.data_ptr(), w_bf16, r, k, n
    )
    if rc == -1:
        raise ValueError(f"lora_add_delta: a row slot outside [-1, {s}) or a rank outside [0, {r}] (nothing written)")
    if rc != 0:
        raise RuntimeError(f"lora_add_delta failed ({rc}: out of memory) for x {tuple(x.shape)}, at {tuple(at.shape)}")
