"""Linear layers with weights pre-packed for oneDNN (CPU, bfloat16).

``F.linear`` on the CPU reorders the weight into oneDNN's blocked layout on every call; packing
it once at load time (the same thing torch.compile's CPU "freezing" pass does) makes decode-size
matmuls faster: measured here, [32 x 576] @ [576 x 3072] 0.190 -> 0.145 ms and batch-1 matmuls
about 2x. Results are bit-identical to ``F.linear`` in bfloat16.

Inputs of 1-16 rows (decode of a few sequences) skip oneDNN: ``pagedserve.ops.cpu.small_gemm`` streams
the same packed buffer with no per-call set-up, bit-identical to oneDNN's batched result (its
partial-sum structure is calibrated per weight shape at load time; shapes that do not match keep
oneDNN). The packed buffers are also moved to 2 MiB pages where Linux allows it.

Disable with ``PAGEDSERVE_PACK_WEIGHTS=0`` (packing) or ``PAGEDSERVE_SMALL_GEMM=0`` (small-M path).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import nn

from pagedserve.ops.cpu import matmul as cpu_kernels

logger = logging.getLogger(__name__)

_BATCH_HINT = 32  # oneDNN picks the packed layout for about this many rows; any M works
# Own copies (AMX, see small_gemm_own_copy): only for models whose projections total at most
# this, where oneDNN's per-op cost is a large share of a decode step (SmolLM2 batch-1 decode
# 50 -> 68 tok/s); on the 1.1B model they were slower (batch 1: 12.3 -> 11.3 tok/s; 16 clients
# 89 -> 52 tok/s: 16 rows of vdpbf16ps against oneDNN's AMX). And only up to this many rows.
OWN_COPY_MAX_MODEL_BYTES = 512 << 20
OWN_COPY_MAX_ROWS = 4


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and os.environ.get("PAGEDSERVE_PACK_WEIGHTS", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` -> an opaque oneDNN tensor for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]``, like ``F.linear``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class PackedLinear(nn.Module):
    """Drop-in inference replacement for an ``nn.Linear`` (weights frozen).

    ``small_plan``: the small-M kernel's partial-sum plan for this weight shape
    (``pagedserve.ops.cpu.calibrate_small_gemm``), or None to always use oneDNN.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = pack_weight(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.small_plan: Optional[tuple[int, int]] = None
        self.small_weight: Optional[torch.Tensor] = None  # own copy for the small-M path (see small_gemm_own_copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_or_small_linear(x, self.packed_weight, self.bias, self.out_features, self.small_plan, self.small_weight)

    def small_weight_address(self) -> int:
        """Address of the buffer the small-M kernel reads (oneDNN's, or the own copy)."""
        return self.small_weight.data_ptr() if self.small_weight is not None else torch.ops.mkldnn.data_ptr(self.packed_weight)


def packed_or_small_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int, small_plan: Optional[tuple[int, int]],
    small_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`packed_linear`, or the small-M kernel for a contiguous bf16 ``x [M <= 16, in]``
    when ``small_plan`` is set (on oneDNN's buffer: the same result bit for bit as its batched
    kernel; on ``small_weight``, an own copy: see :func:`small_gemm_own_copy`)."""
    max_rows = cpu_kernels.SMALL_GEMM_MAX_ROWS if small_weight is None else OWN_COPY_MAX_ROWS
    if small_plan is not None and x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.is_contiguous() and x.dtype == torch.bfloat16:
        return cpu_kernels.small_gemm(x, packed if small_weight is None else small_weight, bias, out_features, small_plan)
    if x.dim() == 2 and x.shape[0] == 1:
        # oneDNN's one-row kernel sums in another order than its batched one for some K (1536,
        # 4096, 4864: ~1 output in 10^4); two rows take the batched kernel, so a sequence's
        # result does not depend on whether it was alone in the step.
        return packed_linear(x.expand(2, -1).contiguous(), packed, bias)[:1]
    return packed_linear(x, packed, bias)


def prepare_small_gemm(packed: torch.Tensor, out_features: int, in_features: int, bias: Optional[torch.Tensor], plans: dict) -> Optional[tuple[int, int]]:
    """Move ``packed``'s buffer to huge pages and return its small-M plan (cached in ``plans``
    per (out, in, has bias)); None when the small-M path is unavailable or does not match."""
    try:
        cpu_kernels.collapse_to_huge_pages(*cpu_kernels._packed_address(packed))
    except (RuntimeError, AttributeError):
        pass
    key = (out_features, in_features, bias is not None)
    if key not in plans:
        plans[key] = cpu_kernels.calibrate_small_gemm(packed, out_features, in_features, bias)
        if plans[key] is None:
            logger.info("small-M matmul cannot read oneDNN's buffer for weight %s x %s", out_features, in_features)
    return plans[key]


def small_gemm_own_copy(weight: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[tuple[tuple[int, int], torch.Tensor]]:
    """Where oneDNN's packed buffer is not the layout the small-M kernel reads (on CPUs with AMX
    oneDNN packs for its AMX kernels), a copy of ``weight [out, in]`` in that layout
    ([out/64][in/2][64][2] bf16, on 2 MiB pages) and a plan for it: batch-1..16 decode then
    streams it instead of calling oneDNN once per op. oneDNN's AMX results depend on the batch
    size anyway, so nothing bit-identical is lost; the copy costs the weights' size once more.
    Used for at most ``OWN_COPY_MAX_ROWS`` rows, in models of at most ``OWN_COPY_MAX_MODEL_BYTES``.
    Checked against oneDNN on random rows (a layout error would be far outside bf16 rounding).
    Returns (plan, copy), or None (shape not supported, ``PAGEDSERVE_SMALL_GEMM=0``)."""
    n, k = weight.shape
    if cpu_kernels.get_small_gemm_lib() is None or n % 64 or k % 2:
        return None
    own = weight.detach().to(torch.bfloat16).contiguous().view(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    cpu_kernels.collapse_to_huge_pages(own.data_ptr(), own.numel() * 2)
    k2 = k // 2
    plan = (256, k2 - k2 % 256)
    x = torch.randn(cpu_kernels.SMALL_GEMM_MAX_ROWS, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = cpu_kernels.small_gemm(x, own, bias, n, plan).float()
    ref = packed_linear(x, packed, bias).float()
    if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()) + 1e-6):
        logger.warning("small-M matmul on an own copy disagrees with oneDNN for %s x %s; oneDNN only", n, k)
        return None
    return plan, own


def _attach_small_gemm(packed: PackedLinear, weight: torch.Tensor, plans: dict, own_copies: bool) -> None:
    packed.small_plan = prepare_small_gemm(packed.packed_weight, packed.out_features, packed.in_features, packed.bias, plans)
    if packed.small_plan is None and own_copies:
        own = small_gemm_own_copy(weight, packed.packed_weight, packed.bias)
        if own is not None:
            packed.small_plan, packed.small_weight = own


def pack_linears(model: nn.Module, plans: Optional[dict] = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (with its small-M
    plan, see :func:`prepare_small_gemm`); returns how many."""
    plans = {} if plans is None else plans
    count = 0
    own_copies = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear)) <= OWN_COPY_MAX_MODEL_BYTES
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                packed = PackedLinear(child)
                _attach_small_gemm(packed, child.weight, plans, own_copies)
                setattr(module, name, packed)
                count += 1
    return count
