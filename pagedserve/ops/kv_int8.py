"""The int8 KV cache (``kv_cache_dtype="int8"``): its layout, and quantization in PyTorch.

The C kernels' twin is ``pagedserve/ops/cpu/csrc/common/kv_int8.h``; both quantize with the
same float32 operations, so a row written by either is the same bytes.

Layout. A layer's cache is ``[2, num_blocks, num_kv_heads, cell_bytes(block_size, head_dim)]``
int8: for K (index 0) and V (1), each (block, KV head) cell holds the block's tokens as int8
``[block_size, head_dim]`` followed by their float32 scales ``[block_size]``. Keeping the scales
inside the block means everything that moves blocks (the prefix cache, KV transfer between
instances) moves them too, and the attention kernel finds a row's scale beside its values.

Quantization: symmetric, per token and KV head (the granularity of KIVI's per-token V and of
vLLM's per-token-head dynamic KV quantization): ``scale = max|x| / 127``,
``q = round_half_even(x * (127 / max|x|))`` clamped to [-127, 127], ``x ~= q * scale``. The row
quantized is the one a bf16/float32 cache would store (after RoPE, rounded to the model dtype).
For head_dim 64 a token costs 68 bytes per KV head instead of 128 in bf16 (1.88x the blocks).
"""

from __future__ import annotations

import torch

KV_INT8 = "int8"
TINY = 1e-30  # rows with max |x| at or below this are stored as zeros (127 / max|x| would overflow); Q8_TINY in C


def cell_bytes(block_size: int, head_dim: int) -> int:
    """Bytes of one (block, KV head) cell of K or V: int8 values plus float32 scales."""
    return block_size * head_dim + 4 * block_size


def cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's int8 cache: ``(2, num_blocks, num_kv_heads, cell_bytes)``."""
    return (2, num_blocks, num_kv_heads, cell_bytes(block_size, head_dim))


def split(cache: torch.Tensor, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one of K or V, ``cache [num_blocks, num_kv_heads, cell_bytes]`` int8:
    (values ``[num_blocks, num_kv_heads, block_size, head_dim]`` int8, scales ``[num_blocks,
    num_kv_heads, block_size]`` float32). Writing to them writes the cache."""
    n = block_size * head_dim
    values = cache[..., :n].unflatten(-1, (block_size, head_dim))
    scales = cache[..., n:].view(torch.float32)
    return values, scales


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., head_dim]`` (any float dtype) -> (int8 ``[..., head_dim]``, float32 scales
    ``[...]``), computed in float32 as the C quantizer does."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # tensor / tensor: PyTorch computes scalar / tensor through a reciprocal (other roundings)
    inv = torch.where(amax > TINY, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = (xf * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q, amax / torch.full_like(amax, 127.0)


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values [..., head_dim]`` int8 times ``scales [...]`` -> ``[..., head_dim]`` in ``dtype``."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)
