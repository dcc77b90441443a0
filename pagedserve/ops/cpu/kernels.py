"""ctypes wrappers of the attention kernel and the fused element-wise ops (``csrc/attention/``,
``csrc/fused/``). Tensors are checked here; the C code trusts them."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from pagedserve.ops.cpu.build import get_fused_lib, get_lib
from pagedserve.ops.kv_int8 import cell_bytes


@functools.lru_cache(maxsize=None)  # asked once per layer per step; the answer never changes
def prefill_kernel_preferred(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether prefill chunks should use the C kernel: only on its vectorised bf16 paths
    (AVX512-BF16, or AVX2 + FMA, where bf16 SDPA has no bf16 arithmetic to use). Elsewhere
    (float32, other shapes) it computes one query row at a time and is slower than PyTorch's
    flash SDPA on long prompts (e.g. 2048 float32 tokens: 180 vs 72 ms, 1 thread); for decode
    rows the kernel is always the faster choice. In the kernel every K/V is read from the cache,
    so a prompt's result does not depend on how it was chunked."""
    lib = get_lib()
    if lib is None or dtype != torch.bfloat16 or num_heads % num_kv_heads:
        return False
    return bool(lib.paged_attention_bf16_fast_path(num_heads // num_kv_heads, head_dim))


def _kv_pointers(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Addresses of K and V in a contiguous ``[2, ...]`` cache (cheaper than indexing views)."""
    base = kv_cache.data_ptr()
    return base, base + kv_cache.stride(0) * kv_cache.element_size()


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: Optional[torch.Tensor],
    token_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_size: Optional[int] = None,
    window: int = 0,
    softcap: float = 0.0,
) -> bool:
    """Attention straight from the paged cache into ``out``, one query token at a time.

    Query token ``t`` attends to the first ``token_lens[t]`` tokens of the sequence whose block
    table is row ``token_seq[t]`` (row ``t`` when ``token_seq`` is None: decode, one token per
    sequence). A prefill chunk passes, for its token at position ``p``, ``token_lens = p + 1``:
    causal attention over cached context and the chunk itself, whose K/V are already in the cache.
    Every row is computed the same way whatever else is in the batch, so chunking, prefix-cache
    hits and batch composition do not change a row's result.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` contiguous, float32 or bfloat16.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``, same dtype; or the
            int8 cache ``[2, num_blocks, num_kv_heads, cell_bytes]`` of
            :mod:`pagedserve.ops.kv_int8` (then ``block_size`` is required).
        block_tables: ``[num_seqs, max_blocks]`` int64, contiguous.
        token_seq: ``[num_tokens]`` int64 row of ``block_tables`` per token, or None.
        token_lens: ``[num_tokens]`` int64 (tokens attended to, the query's own included).
        out: ``[num_tokens, num_heads, head_dim]`` contiguous, written in place.
        window: sliding window in tokens (0: full attention). Token ``t`` then attends only to
            keys ``[max(0, token_lens[t] - window), token_lens[t])``, HF's rule (Mistral, Gemma
            2/3: key ``k`` seen from position ``p`` iff ``p - window < k <= p``); keys before
            that are never read, so their blocks may hold anything.
        softcap: Gemma 2's attention-logit cap (0: none): scores ``cap * tanh(s / cap)`` after
            the scale, before the softmax.
    Returns:
        False (and writes nothing) when the kernel cannot run here: no compiled library, a
        device other than CPU, or another dtype or layout.
    """
    lib = get_lib()
    if lib is None or query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16):
        return False
    int8 = kv_cache.dtype == torch.int8
    if (kv_cache.dtype != query.dtype and not int8) or not (query.is_contiguous() and out.is_contiguous() and kv_cache.is_contiguous()):
        return False
    if not (block_tables.is_contiguous() and token_lens.is_contiguous()) or (token_seq is not None and not token_seq.is_contiguous()):
        return False
    n, h, d = query.shape
    if int8:
        if block_size is None or kv_cache.dim() != 4 or kv_cache.shape[3] != cell_bytes(block_size, d):
            return False
        nkv, bs, kd = kv_cache.shape[2], block_size, d
    else:
        _, _, nkv, bs, kd = kv_cache.shape
    if out.dtype != query.dtype or out.shape != query.shape or kd != d or h % nkv != 0:
        return False
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or token_lens.dtype != torch.int64 or token_lens.numel() != n:
        return False
    if token_seq is not None and (token_seq.dtype != torch.int64 or token_seq.numel() != n):
        return False
    if token_seq is None and block_tables.shape[0] < n:
        return False
    if window < 0 or not softcap >= 0:
        return False
    tail: tuple = ()
    if window > 0 or softcap > 0:  # one entry for every storage type: its flags, window and cap after the scale
        fn = lib.paged_attention_window
        tail = (int(query.dtype == torch.bfloat16), int(int8), window, softcap)
    elif int8:
        fn = lib.paged_attention_q8_bf16 if query.dtype == torch.bfloat16 else lib.paged_attention_q8_f32
    else:
        fn = lib.paged_attention_bf16 if query.dtype == torch.bfloat16 else lib.paged_attention_f32
    rc = fn(
        query.data_ptr(),
        *_kv_pointers(kv_cache),
        block_tables.data_ptr(),
        block_tables.shape[1],
        None if token_seq is None else token_seq.data_ptr(),
        token_lens.data_ptr(),
        out.data_ptr(),
        n,
        h,
        nkv,
        d,
        bs,
        scale,
        *tail,
    )
    return rc == 0


_FUSED_MAX_DIM = 16384  # MAX_DIM in csrc/fused/fused.h (hidden size of one row)


def fused_ops_usable(x: torch.Tensor) -> bool:
    """Whether the fused element-wise ops can run on tensors like ``x`` (CPU, float32 or
    bfloat16, compiled library present)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and get_fused_lib() is not None


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (or ``x`` when residual is None), then RMSNorm of it with HF
    LlamaRMSNorm's rounding (Zhang & Sennrich 2019).

    Args:
        x: ``[rows, dim]`` contiguous; residual: same shape, updated in place (or None);
            weight: ``[dim]``, same dtype. Callers check ``fused_ops_usable``.
    Returns:
        (normed ``[rows, dim]``, residual) where residual is the updated tensor (``x`` itself
        when None was given).
    """
    lib = get_fused_lib()
    assert lib is not None and x.is_contiguous() and weight.dtype == x.dtype and x.shape[-1] <= _FUSED_MAX_DIM
    out = torch.empty_like(x)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    rows, dim = x.shape
    lib.add_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        int(x.dtype == torch.bfloat16),
    )
    return out, (x if residual is None else residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [rows, 2 * inter]`` (gate first) -> ``[rows, inter]``,
    with PyTorch's rounding (silu rounded to the storage type before the product)."""
    lib = get_fused_lib()
    assert lib is not None and gate_up.is_contiguous()
    rows, two_inter = gate_up.shape
    out = torch.empty(rows, two_inter // 2, dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, two_inter // 2, int(gate_up.dtype == torch.bfloat16))
    return out


def rope_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    num_heads: int,
    block_size: Optional[int] = None,
) -> torch.Tensor:
    """RoPE (NeoX halves, HF rounding) on Q and K, K and V written to their cache slots
    (quantized to int8 with their scales when the cache is int8).

    Args:
        qk: ``[rows, (num_heads + num_kv_heads) * head_dim]`` view with unit inner stride (rows
            may be strided, e.g. a slice of the fused QKV output); v: ``[rows, num_kv_heads *
            head_dim]`` likewise. positions, slot_mapping: ``[rows]`` int64 contiguous.
        cos, sin: float32 ``[max_positions, head_dim]`` tables.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` contiguous, same dtype,
            or the int8 cache of :mod:`pagedserve.ops.kv_int8` (``block_size`` required).
    Returns:
        q ``[rows, num_heads, head_dim]`` contiguous, rotated.
    Raises:
        ValueError: head_dim odd or under 2 (RoPE rotates two halves).
    """
    lib = get_fused_lib()
    assert lib is not None
    if kv_cache.dtype == torch.int8:
        nkv = kv_cache.shape[2]
        hd = v.shape[-1] // nkv
        bs = block_size
        assert bs is not None and kv_cache.shape[3] == cell_bytes(bs, hd) and hd <= 512
        fn = lib.rope_write_kv_q8
    else:
        _, _, nkv, bs, hd = kv_cache.shape
        fn = lib.rope_write_kv
    if hd < 2 or hd % 2:
        raise ValueError(f"RoPE needs an even head_dim (two halves), got {hd}")
    rows = qk.shape[0]
    assert qk.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
    assert positions.is_contiguous() and slot_mapping.is_contiguous() and cos.dtype == torch.float32
    q = torch.empty(rows, num_heads, hd, dtype=qk.dtype)
    fn(
        qk.data_ptr(),
        qk.stride(0),
        v.data_ptr(),
        v.stride(0),
        positions.data_ptr(),
        slot_mapping.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        *_kv_pointers(kv_cache),
        rows,
        num_heads,
        nkv,
        hd,
        bs,
        int(qk.dtype == torch.bfloat16),
    )
    return q


def argmax_bf16(x: torch.Tensor) -> torch.Tensor:
    """``[rows]`` int64: the index of each row's largest value of ``x [rows, cols]`` (bf16, CPU,
    unit inner stride), the first one on ties and the first NaN if any, as ``x.max(-1)``.
    Raises ValueError when the rows are empty (``cols == 0``)."""
    lib = get_fused_lib()
    assert lib is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"
    if x.shape[1] < 1:
        raise ValueError("argmax over an empty row")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_bf16_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
