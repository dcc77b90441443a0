"""Backends of the model's non-projection ops (norms, activation, RoPE + KV-cache write, paged
attention, greedy argmax), chosen once when the model is loaded: the model has one ``forward``
and calls its backend."""

from __future__ import annotations

import logging

import torch

from pagedserve import platform
from pagedserve.model.backends.cpu_backend import CpuBackend, cpu_kernels_usable
from pagedserve.model.backends.torch_backend import TorchBackend

__all__ = ["TorchBackend", "CpuBackend", "select_backend"]

logger = logging.getLogger(__name__)


def select_backend(model, device: torch.device, dtype: torch.dtype) -> TorchBackend:
    """The C-kernel backend on a CPU where the kernels handle the model; on CUDA the Triton
    paged-attention backend where triton imports and the heads fit it
    (``PAGEDSERVE_TRITON_ATTENTION=0``: off); else PyTorch."""
    attn = model.layers[0].self_attn
    if device.type == "cpu" and cpu_kernels_usable(model.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype):
        return CpuBackend(dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim)
    if device.type == "cuda" and platform.switch_on("PAGEDSERVE_TRITON_ATTENTION"):
        try:  # imported here: triton is needed on CUDA only
            from pagedserve.model.backends import triton_attention
        except ImportError as e:
            logger.warning("triton is not importable (%s): attention takes PyTorch's gather + SDPA path", e)
        else:
            if triton_attention.supports(attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype):
                return triton_attention.TritonBackend()
    return TorchBackend()
