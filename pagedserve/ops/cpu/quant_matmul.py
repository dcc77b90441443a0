"""Matmuls on quantized weights (:class:`~pagedserve.ops.quantized.QuantizedWeight`) through the C
kernels of ``csrc/quant/``:

- :func:`quant_matmul`: ``x @ W.T (+ bias)``, by default ``qgemm`` at every M: each quantized
  weight is read once per call; with few rows (decode) each 16 weights are widened to float32 in
  registers once for all rows, with many (prefill) each thread dequantizes a panel of weight rows
  into a buffer and runs register tiles over it; both give the same sums, so a row's result never
  depends on the batch. With :data:`QGEMM_MAX_ROWS` set, more rows than that dequantize the weight
  (``qdequant``, into a buffer each thread reuses) and call ``F.linear`` (faster from
  :data:`QGEMM_CROSSOVER_ROWS` rows on an AMX CPU, but its rows depend on the batch).
- :func:`qgemm`: the C matmul alone, for any number of rows;
- :func:`dequantize`: the dense weight, bit-exact with :meth:`QuantizedWeight.dequantize`.

Measured (``pagedserve bench kernels --op qmatmul``: SmolLM2-135M's 120 projections, bf16 x, 2
threads, a 2-core Intel Xeon with AMX, memory-read probe 32.5 GB/s): at M = 1, 4-bit qgemm 4.6 ms
(17.2 GB/s of quantized weights, 53% of the probe), 8-bit 6.2 ms (19.2 GB/s), the engine's bf16
AMX matmul 9.9 ms; from 24 rows on dequantize + ``F.linear`` is faster (:data:`QGEMM_CROSSOVER_ROWS`).

Without the kernels (``PAGEDSERVE_CPU_KERNELS=0``, no C compiler) both use the reference
``QuantizedWeight.dequantize`` and ``F.linear``. The tensors are checked here; the C code trusts
them.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.ops.cpu.build import get_quant_lib
from pagedserve.ops.quantized import QuantizedWeight

# Rows of x above which quant_matmul dequantizes the weight and calls F.linear instead of qgemm;
# None (the default): qgemm at every M. F.linear's rows depend on the batch (oneDNN / MKL block by
# M), and the engine wants each row alone to equal the same row batched, bit for bit
# (tests/model/test_quantized_model.py), which qgemm gives at any M. A caller that can give that
# up for prefill speed on an AMX CPU may set it to QGEMM_CROSSOVER_ROWS.
QGEMM_MAX_ROWS: Optional[int] = None
# Where dequantize + F.linear starts to beat qgemm (`pagedserve bench kernels --op qmatmul --rows
# 1,4,8,12,16,24,32,64`, SmolLM2's 120 projections, bf16 x, 2 threads, a 2-core Intel Xeon with
# AMX: qgemm's AVX-512 unit against oneDNN's AMX bf16 kernel), 4-bit weights: qgemm 25.0 / 33.1 /
# 41.0 / 72.9 ms against 29.8 / 32.6 / 33.9 / 38.8 ms at 16 / 24 / 32 / 64 rows (8-bit qgemm about
# 5% slower): 24 rows. (qgemm's register tiles alone, before its dequantized panels for 12+ rows,
# crossed at 16: 26.3 against 26.3 ms.) A shared host, figures indicative; not measured on CPUs
# without AMX, where F.linear in bf16 is slower.
QGEMM_CROSSOVER_ROWS = 24

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# The per-thread buffer the dense weight is dequantized into above QGEMM_MAX_ROWS, reused: a fresh
# multi-MB tensor per call costs as much when the allocator hands back freed memory, but 1.6x more
# (its page faults) when it does not (measured: SmolLM2's 120 weights at 32 rows, 34 against 54 ms
# after other allocations). Weights larger than this get a fresh tensor.
_SCRATCH_MAX_BYTES = 64 << 20
_scratch = threading.local()


def _weight_args(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The weight's tensors as the C code reads them (contiguous; copies only if they are not)."""
    mins = None if w.mins is None else w.mins.contiguous()
    return w.qdata.contiguous(), w.scales.contiguous(), mins


def _weight_pointers(w: QuantizedWeight, tensors: tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]) -> tuple:
    """``(qdata, bits, group, scales, mins)`` as the C functions take them (mins: NULL when None)."""
    q, scales, mins = tensors
    return q.data_ptr(), w.bits, w.group, scales.data_ptr(), None if mins is None else mins.data_ptr()


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[N, K]`` weight in ``dtype``, bit for bit :meth:`QuantizedWeight.dequantize`
    (``qdequant`` for float32 and bfloat16 when the kernels are available)."""
    return _dequantize_into(w, dtype, None)


def _dequantize_into(w: QuantizedWeight, dtype: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    lib = get_quant_lib()
    if lib is None or dtype not in _KERNEL_DTYPES:
        return w.dequantize(dtype)
    n, k = w.shape
    if out is None:
        out = torch.empty(n, k, dtype=dtype)
    tensors = _weight_args(w)  # kept alive through the call
    rc = lib.qdequant(*_weight_pointers(w, tensors), n, k, out.data_ptr(), int(dtype == torch.bfloat16))
    if rc != 0:
        raise RuntimeError(f"qdequant failed ({rc}) for a {w.qtype} weight {tuple(w.shape)}")
    return out


def _scratch_weight(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight in this thread's reusable buffer (a fresh tensor when it is too large)."""
    n, k = w.shape
    if n * k * torch.finfo(dtype).bits // 8 > _SCRATCH_MAX_BYTES:
        return _dequantize_into(w, dtype, None)
    bufs: dict[torch.dtype, torch.Tensor] = getattr(_scratch, "bufs", None) or {}
    _scratch.bufs = bufs
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < n * k:
        buf = bufs[dtype] = torch.empty(n * k, dtype=dtype)
    return _dequantize_into(w, dtype, buf[: n * k].view(n, k))


def _check(x: torch.Tensor, w: QuantizedWeight, bias: Optional[torch.Tensor]) -> None:
    if not isinstance(w, QuantizedWeight):
        raise ValueError(f"quant_matmul needs a QuantizedWeight, got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K], got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"x must be on the CPU, got {x.device}")
    n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} inputs, the weight {k} (weight {w.qtype} {n} x {k})")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,) or not bias.is_floating_point()):
        raise ValueError(
            f"bias must be a float tensor of shape ({n},), got {tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}"
        )


def check_settings() -> None:
    """Check the environment's settings of these kernels once, at start-up (the engine calls it
    when it loads quantized weights), rather than at the first request.

    Raises:
        ValueError: a malformed ``PAGEDSERVE_QGEMM_MAX_ROWS``.
    """
    _max_rows()


def _max_rows() -> Optional[int]:
    """``PAGEDSERVE_QGEMM_MAX_ROWS`` (an integer, or ``all`` for None) where set, else
    :data:`QGEMM_MAX_ROWS`. Read per call (tests and benchmarks switch it at run time).

    Raises:
        ValueError: a value that is neither ``all`` nor an integer >= 0.
    """
    env = os.environ.get("PAGEDSERVE_QGEMM_MAX_ROWS")
    if env is None or env == "":
        return QGEMM_MAX_ROWS
    if env == "all":
        return None
    if not env.isdigit():
        raise ValueError(f"PAGEDSERVE_QGEMM_MAX_ROWS must be 'all' or an integer >= 0, got {env!r}")
    return int(env)


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)``: ``[M, N]`` in x's dtype (float32 or bfloat16; float16 is
    computed in float32 and rounded back).

    ``qgemm`` (each output a float32 sum of ``x * W``, plus the bias in float32, rounded once to
    x's dtype; a row's bits independent of M); above :data:`QGEMM_MAX_ROWS` rows when it is set,
    the weight dequantized to x's dtype and ``F.linear``. Without the kernels:
    ``F.linear(x, w.dequantize(x.dtype), bias)``.

    Raises:
        ValueError: x not a 2-D float32/bfloat16 CPU tensor with the weight's K inputs, or a bias
            not of shape ``(N,)``.
    """
    if isinstance(x, torch.Tensor) and x.dtype == torch.float16:  # float16 activations: computed in float32
        return quant_matmul(x.float(), w, bias).to(torch.float16)
    _check(x, w, bias)
    lib = get_quant_lib()
    max_rows = _max_rows()
    if lib is None:
        return F.linear(x, w.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
    if max_rows is not None and x.shape[0] > max_rows:
        return F.linear(x, _scratch_weight(w, x.dtype), None if bias is None else bias.to(x.dtype))
    if bias is None:
        return _qgemm(lib, x, w, x.dtype)
    # with a bias the sum stays float32 until the bias is added: one rounding to bf16, as F.linear
    out = _qgemm(lib, x, w, torch.float32)
    out += bias.to(torch.float32)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def qgemm(x: torch.Tensor, w: QuantizedWeight, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The C ``qgemm`` for any number of rows: ``x [M, K] @ W.T`` as ``[M, N]`` in ``out_dtype``
    (float32 or bfloat16; default x's), each output a float32 sum of ``x * W`` rounded once.

    Raises:
        ValueError: bad shapes or dtypes (as :func:`quant_matmul`).
        RuntimeError: the kernels are not available.
    """
    _check(x, w, None)
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    lib = get_quant_lib()
    if lib is None:
        raise RuntimeError("the quantized-weight kernels are not available (PAGEDSERVE_CPU_KERNELS=0 or no C compiler)")
    return _qgemm(lib, x, w, out_dtype)


def _qgemm(lib, x: torch.Tensor, w: QuantizedWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`qgemm` on arguments already checked."""
    m, k = x.shape
    n = w.out_features
    out = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return out
    if x.stride(1) != 1 or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    ldx = x.stride(0) if m > 1 else k  # rows ldx apart (a row of a wider tensor, or a column slice)
    tensors = _weight_args(w)  # kept alive through the call
    rc = lib.qgemm(
        x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, ldx, *_weight_pointers(w, tensors), n, out.data_ptr(), int(out_dtype == torch.bfloat16), n
    )
    if rc != 0:
        raise RuntimeError(f"qgemm failed ({rc}) for x {tuple(x.shape)} and a {w.qtype} weight {tuple(w.shape)}")
    return out
