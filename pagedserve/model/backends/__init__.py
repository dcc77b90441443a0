"""Backends of the model's non-projection ops (norms, activation, RoPE + KV-cache write, paged
attention, greedy argmax), chosen once when the model is loaded: the model has one ``forward``
and calls its backend."""

from __future__ import annotations

import torch

from pagedserve.model.backends.cpu_backend import CpuBackend, cpu_kernels_usable
from pagedserve.model.backends.torch_backend import TorchBackend

__all__ = ["TorchBackend", "CpuBackend", "select_backend"]


def select_backend(model, device: torch.device, dtype: torch.dtype) -> TorchBackend:
    """The C-kernel backend on a CPU where the kernels handle the model, else PyTorch."""
    attn = model.layers[0].self_attn
    if device.type == "cpu" and cpu_kernels_usable(model.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype):
        return CpuBackend(dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim)
    return TorchBackend()
