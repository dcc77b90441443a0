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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_or_small_linear(x, self.packed_weight, self.bias, self.out_features, self.small_plan)


def packed_or_small_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], out_features: int, small_plan: Optional[tuple[int, int]]
) -> torch.Tensor:
    """:func:`packed_linear`, or the small-M kernel for a contiguous bf16 ``x [M <= 16, in]``
    when ``small_plan`` is set (same result bit for bit as oneDNN's batched kernel)."""
    if small_plan is not None and x.dim() == 2 and 0 < x.shape[0] <= cpu_kernels.SMALL_GEMM_MAX_ROWS and x.is_contiguous() and x.dtype == torch.bfloat16:
        return cpu_kernels.small_gemm(x, packed, bias, out_features, small_plan)
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
            logger.info("small-M matmul unavailable for weight %s x %s; oneDNN only", out_features, in_features)
    return plans[key]


def pack_linears(model: nn.Module, plans: Optional[dict] = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (with its small-M
    plan, see :func:`prepare_small_gemm`); returns how many."""
    plans = {} if plans is None else plans
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                packed = PackedLinear(child)
                packed.small_plan = prepare_small_gemm(packed.packed_weight, packed.out_features, packed.in_features, packed.bias, plans)
                setattr(module, name, packed)
                count += 1
    return count
