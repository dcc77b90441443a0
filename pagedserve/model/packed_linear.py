"""Linear layers with weights pre-packed for the CPU (bfloat16 and float32).

``F.linear`` on the CPU reorders the weight into oneDNN's blocked layout on every call; packing
it once at load time (the same thing torch.compile's CPU "freezing" pass does) makes decode-size
matmuls faster: measured here, [32 x 576] @ [576 x 3072] 0.190 -> 0.145 ms and batch-1 matmuls
about 2x. Results are bit-identical to ``F.linear`` in bfloat16. In float32, ``F.linear`` goes to
MKL, which runs far below the AVX2 peak on AMD CPUs; oneDNN's kernels were 1.3-1.6x faster on a
Zen 3 (docs/perf-history.md, "AVX2: a CPU without AVX-512").

oneDNN (through ideep) builds and caches one primitive per input shape, and process memory grew
by GBs when every step brought a new row count M (a cached primitive for a few rows holds ~0.6
MB, and cached primitives pin freed activation buffers). So M is rounded up to one of a few row
counts (:func:`onednn_rows`: 52 per weight), the padding rows are zeros, and inputs over
``ONEDNN_MAX_ROWS`` are cut into pieces. Each row's result does not depend on the other rows
(:func:`rows_independent`; where it does, inputs keep their row count), so padding and cutting
change no output bit. The steps are finest at decode sizes, where padding would cost most (the
matmuls are compute-bound from ~24 rows: float32 on Zen 3, 33 -> 48 rows cost 1.5x).

On CPUs with AMX (Sapphire Rapids and later) the weight is instead kept only in the layout of
pagedserve's AMX matmul (``csrc/gemm/amx.c``), which every product then uses, whatever M: it
streams the weights faster than oneDNN at decode sizes (SmolLM2's projections at M = 32: 9.0
against 13.0 ms a step, 30 layers from memory) and is as fast at prefill sizes, and each row's
result is independent of the other rows, so greedy output does not depend on batching (oneDNN's
AMX kernels sum in an order that depends on M). Shapes that are not multiples of 32 keep oneDNN.

On CPUs with AVX2 and no AVX-512 (AMD Zen 2/3, Intel client cores) oneDNN cannot pack bf16
weights, and bf16 weights are kept in the layout of pagedserve's AVX2 matmul
(``csrc/gemm/avx2.c``): bf16 in memory, widened to float32 in registers, float32 FMA over k in
order, so each row's result is independent of the other rows there too.

Elsewhere, inputs of 1-64 rows skip oneDNN:
``pagedserve.ops.cpu.small_gemm`` streams the same packed buffer with no per-call set-up,
bit-identical to oneDNN's batched result (its partial-sum structure is calibrated per weight
shape at load time; shapes that do not match keep oneDNN). The packed buffers are also moved
to 2 MiB pages where Linux allows it.

Disable with ``PAGEDSERVE_PACK_WEIGHTS=0`` (packing), ``PAGEDSERVE_AMX=0`` (the AMX matmul),
``PAGEDSERVE_AVX2_GEMM=0`` (the AVX2 bf16 matmul) or ``PAGEDSERVE_SMALL_GEMM=0`` (small-M path).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Optional

import torch
from torch import nn

from pagedserve import platform
from pagedserve.ops.cpu import matmul as cpu_kernels

logger = logging.getLogger(__name__)

_BATCH_HINT = 32  # oneDNN picks the packed layout for about this many rows; any M works
ONEDNN_MAX_ROWS = 2048  # larger inputs are cut into pieces of at most this many rows


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections of ``dtype`` on ``device`` are packed (bfloat16 or float32 on CPU,
    unless ``PAGEDSERVE_PACK_WEIGHTS=0``): for oneDNN, or for the AVX2 bf16 matmul."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and platform.switch_on("PAGEDSERVE_PACK_WEIGHTS")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (onednn_packs(dtype) or avx2_bf16(dtype))
    )


def avx2_bf16(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` projections take the AVX2 bf16 matmul: bf16 where oneDNN cannot pack
    bf16 weights (no AVX-512), the CPU has AVX2 + FMA (``matmul.avx2_gemm_available``) and
    ``PAGEDSERVE_AVX2_GEMM`` is not 0."""
    return dtype == torch.bfloat16 and not onednn_packs(dtype) and platform.switch_on("PAGEDSERVE_AVX2_GEMM") and cpu_kernels.avx2_gemm_available()


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of ``dtype`` on this CPU and gives the right product.
    bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises a RuntimeError elsewhere
    (AVX2-only CPUs such as AMD Zen 3), where bf16 projections take the AVX2 matmul
    (:func:`avx2_bf16`) or, without it, ``F.linear``."""
    try:
        w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = packed_linear(x, pack_weight(w)).float()
    except RuntimeError as e:
        logger.info(
            "oneDNN cannot pack %s weights on this CPU (%s); those projections take the AVX2 bf16 matmul where it runs, else F.linear",
            dtype,
            str(e).splitlines()[0],
        )
        return False
    return bool(torch.allclose(got, x.float() @ w.float().t(), rtol=2e-2, atol=2e-2))


_PROBE_ROWS = (2, 5, 17, 64, 72, 96, 144)  # against the same rows inside a 520-row product
_rows_independent: dict = {}


def rows_independent(packed: torch.Tensor, out_features: int, in_features: int) -> bool:
    """Whether oneDNN computes each row of products with ``packed [out_features, in_features]``
    independently of the row count, so that padding and cutting change no bit: checked once per
    (dtype, shape) on this weight, random rows at 2 to 144 rows against the same rows inside a
    520-row product. False where oneDNN's kernels sum in an M-dependent order (its bf16 AMX
    kernels, for shapes the AMX matmul does not take): those inputs keep their row count."""
    key = (packed.dtype, out_features, in_features)
    if key not in _rows_independent:
        x = torch.randn(520, in_features, generator=torch.Generator().manual_seed(3)).to(packed.dtype)
        full = packed_linear(x, packed)
        _rows_independent[key] = all(torch.equal(packed_linear(x[:m].contiguous(), packed), full[:m]) for m in _PROBE_ROWS)
        if not _rows_independent[key]:
            logger.info(
                "oneDNN's %s rows for weight %s x %s depend on the row count; exact row counts there", packed.dtype, out_features, in_features
            )
    return _rows_independent[key]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` -> an opaque oneDNN tensor for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]``, like ``F.linear``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class PackedLinear(nn.Module):
    """Drop-in inference replacement for an ``nn.Linear`` (weights frozen): ``weight [out, in]``
    in the AMX matmul's layout (``amx_weight``) where :func:`amx_copy` takes it, in the AVX2
    bf16 matmul's (``avx2_weight``) where :func:`avx2_bf16` holds, else packed for oneDNN
    (``packed_weight``).

    ``small_plan``: the small-M kernel's partial-sum plan for the oneDNN buffer
    (``pagedserve.ops.cpu.calibrate_small_gemm``), or None.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.amx_weight: Optional[torch.Tensor] = amx_copy(weight, self.bias) if weight.dtype == torch.bfloat16 else None
        self.avx2_weight: Optional[torch.Tensor] = None
        if self.amx_weight is None and avx2_bf16(weight.dtype):
            self.avx2_weight = cpu_kernels.avx2_layout(weight)
            cpu_kernels.collapse_to_huge_pages(self.avx2_weight.data_ptr(), self.avx2_weight.numel() * 2)
        # The weight in pagedserve's own layout and its matmul, or None: oneDNN's packed copy.
        self._own = (
            (self.amx_weight, cpu_kernels.amx_gemm)
            if self.amx_weight is not None
            else (self.avx2_weight, cpu_kernels.avx2_gemm)
            if self.avx2_weight is not None
            else None
        )
        self.packed_weight: Optional[torch.Tensor] = None if self._own else pack_weight(weight)
        self.small_plan: Optional[tuple[int, int]] = None
        self.pad_rows = self.packed_weight is not None and rows_independent(self.packed_weight, self.out_features, self.in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._own is not None:
            weight, gemm = self._own
            shape = x.shape
            y = gemm(x.reshape(-1, shape[-1]).contiguous(), weight, self.bias, self.out_features)
            return y.view(*shape[:-1], self.out_features)
        return packed_or_small_linear(x, self.packed_weight, self.bias, self.out_features, self.small_plan, self.pad_rows)

    def decode_entries(self) -> Optional[list[int]]:
        """This projection's four entries in ``csrc/step/decode_step.c``'s layer table (weight
        address, bias address or 0, and the small-M plan, or (0, -1) for the AMX matmul, (0, -2)
        for the AVX2 one); None when it has none of them (then the one-call decode step cannot
        run)."""
        bias = 0 if self.bias is None else self.bias.data_ptr()
        if self.amx_weight is not None:
            return [self.amx_weight.data_ptr(), bias, 0, -1]
        if self.avx2_weight is not None:
            return [self.avx2_weight.data_ptr(), bias, 0, -2]
        if self.small_plan is None:
            return None
        return [torch.ops.mkldnn.data_ptr(self.packed_weight), bias, *self.small_plan]


def amx_copy(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``weight [out, in]`` in the AMX matmul's layout (``matmul.amx_layout``, on 2 MiB pages),
    or None where that kernel does not run (no AMX, ``PAGEDSERVE_AMX=0``, a dimension not a
    multiple of 32). Checked on random rows against an fp32 product (a layout error would be far
    outside bf16 rounding): on a mismatch, a warning and None."""
    n, k = weight.shape
    if n % 32 or k % 32 or not platform.switch_on("PAGEDSERVE_AMX") or not cpu_kernels.amx_available():
        return None
    own = cpu_kernels.amx_layout(weight)
    cpu_kernels.collapse_to_huge_pages(own.data_ptr(), own.numel() * 2)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = cpu_kernels.amx_gemm(x, own, bias, n).float()
    ref = x.float() @ weight.detach().float().t() + (0 if bias is None else bias.float())
    if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()) + 1e-6):
        logger.warning("AMX matmul disagrees with the reference for weight %s x %s; oneDNN only", n, k)
        return None
    return own


def packed_or_small_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_features: int,
    small_plan: Optional[tuple[int, int]],
    pad_rows: bool = False,
) -> torch.Tensor:
    """:func:`packed_linear` (on :func:`onednn_rows` rows when ``pad_rows``, which
    :func:`rows_independent` decides per weight shape), or the small-M kernel for a contiguous
    bf16 ``x [M <= SMALL_GEMM_MAX_ROWS, in]`` when ``small_plan`` is set (the same result bit
    for bit as oneDNN's batched kernel)."""
    if (
        small_plan is not None
        and x.dim() == 2
        and 0 < x.shape[0] <= cpu_kernels.SMALL_GEMM_MAX_ROWS
        and x.is_contiguous()
        and x.dtype == torch.bfloat16
    ):
        return cpu_kernels.small_gemm(x, packed, bias, out_features, small_plan)
    if not pad_rows:
        if x.dim() == 2 and x.shape[0] == 1:  # see onednn_rows: never one row
            return packed_linear(x.expand(2, -1).contiguous(), packed, bias)[:1]
        return packed_linear(x, packed, bias)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    if m <= ONEDNN_MAX_ROWS:
        y = _padded_linear(rows, packed, bias)
    else:
        y = torch.cat([_padded_linear(rows[s : s + ONEDNN_MAX_ROWS], packed, bias) for s in range(0, m, ONEDNN_MAX_ROWS)])
    return y.view(*x.shape[:-1], out_features)


_pad_buffers = threading.local()  # per thread: {(in_features, dtype): zero-initialised [rows, in] scratch}


def _padded_linear(rows: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`packed_linear` of ``rows [n <= ONEDNN_MAX_ROWS, in]`` on :func:`onednn_rows` rows.

    The rows are copied into the head of a scratch buffer kept per (in_features, dtype) and
    thread (in inference mode, as the engine runs; otherwise a padded copy is made); its padding
    rows hold zeros or the rows of an earlier call. Either way they change no output row
    (padding is used only where rows are independent), and no fresh padded input is made per
    call (1.02x for the matmuls of a ~140-row step: docs/perf-history.md, "Padding without a
    fresh tensor")."""
    n, k = rows.shape
    padded = onednn_rows(n)
    if padded == n:
        return packed_linear(rows.contiguous(), packed, bias)
    if not torch.is_inference_mode_enabled():  # the buffer is an inference tensor: no in-place use, no graph, outside
        return packed_linear(torch.cat([rows, rows.new_zeros(padded - n, k)]), packed, bias)[:n]
    bufs = getattr(_pad_buffers, "by_shape", None)
    if bufs is None:
        bufs = _pad_buffers.by_shape = {}
    buf = bufs.get((k, rows.dtype))
    if buf is None or buf.shape[0] < padded:
        grown = max(padded, 64, 2 * (0 if buf is None else buf.shape[0]))  # doubling: few re-allocations
        buf = bufs[(k, rows.dtype)] = rows.new_zeros(max(padded, min(grown, ONEDNN_MAX_ROWS)), k)
    x = buf[:padded]
    x[:n].copy_(rows)
    return packed_linear(x, packed, bias)[:n]


def onednn_rows(m: int) -> int:
    """The row count oneDNN is called with for ``1 <= m <= ONEDNN_MAX_ROWS`` rows: the next
    power of two up to 16 (never 1: oneDNN's one-row kernel sums in another order than its
    batched one for some K, 1536, 4096, 4864 in bf16, ~1 output in 10^4, and a sequence's result
    must not depend on being alone in the step; these sizes stream the weights, so padding is
    nearly free), then a multiple of 4 up to 64, of 8 up to 128, of 16 up to 256, of 32 up to
    512 and of 128 beyond: 52 shapes per weight up to 2,048 rows, padding at most 12 % from 65
    to 512 rows (25 % at 513)."""
    if m <= 16:
        return max(2, 1 << (m - 1).bit_length())
    step = 4 if m <= 64 else 8 if m <= 128 else 16 if m <= 256 else 32 if m <= 512 else 128
    return -(-m // step) * step


def prepare_small_gemm(
    packed: torch.Tensor, out_features: int, in_features: int, bias: Optional[torch.Tensor], plans: dict
) -> Optional[tuple[int, int]]:
    """Move ``packed``'s buffer to huge pages and return its small-M plan (cached in ``plans``
    per (out, in, has bias)); None when the small-M path is unavailable (``PAGEDSERVE_SMALL_GEMM=0``
    among others) or does not match."""
    try:
        cpu_kernels.collapse_to_huge_pages(*cpu_kernels._packed_address(packed))
    except (RuntimeError, AttributeError):
        pass
    key = (out_features, in_features, bias is not None)
    if key not in plans:
        on = platform.switch_on("PAGEDSERVE_SMALL_GEMM")
        plans[key] = cpu_kernels.calibrate_small_gemm(packed, out_features, in_features, bias) if on else None
        if on and plans[key] is None:
            logger.info("small-M matmul cannot read oneDNN's buffer for weight %s x %s", out_features, in_features)
    return plans[key]


def attach_small_gemm(packed: PackedLinear, plans: dict) -> None:
    """Give an oneDNN-packed bf16 layer its small-M plan (see :func:`prepare_small_gemm`)."""
    if packed.packed_weight is not None and packed.packed_weight.dtype == torch.bfloat16:
        packed.small_plan = prepare_small_gemm(packed.packed_weight, packed.out_features, packed.in_features, packed.bias, plans)


def pack_linears(model: nn.Module, plans: Optional[dict] = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (with its small-M
    plan, see :func:`prepare_small_gemm`); returns how many."""
    plans = {} if plans is None else plans
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                packed = PackedLinear.from_linear(child)
                attach_small_gemm(packed, plans)
                setattr(module, name, packed)
                count += 1
    return count
