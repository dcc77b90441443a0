"""Paged attention in one Triton launch per layer, and the CUDA backend that uses it.

The kernel reads K/V where they live in the paged cache, through int32 block tables (no gather
copy), for the whole flat batch at once: decodes, fresh prompts, and chunks after cached context
(chunked prefill, prefix-cache hits) in the same launch. The design follows vLLM's unified
Triton attention (``vllm/v1/attention/ops/triton_unified_attention.py``, Ringlein, van Lunteren,
Yang, Parnell), on our head-major cache and our int8 KV layout:

- Query tiles. Sequence ``i``'s new tokens are ``[query_start_loc[i], query_start_loc[i + 1])``
  of the flat batch; they are cut into tiles of ``BLOCK_Q`` tokens. Global tile ``g`` belongs to
  the last sequence with ``query_start_loc[i] // BLOCK_Q + i <= g`` (a binary search), so the
  grid ``(num_tokens // BLOCK_Q + num_seqs, num_kv_heads[, num_splits])`` covers every tile
  and the surplus programs return at once. A program's ``BLOCK_M = BLOCK_Q * queries_per_kv``
  rows are the query heads of one GQA group for ``BLOCK_Q`` tokens (row ``m``: token
  ``m // queries_per_kv``, head ``kv_head * queries_per_kv + m % queries_per_kv``), so K/V of
  a KV head are read once for its whole group.
- Keys. Query token ``j`` of a chunk after ``ctx`` cached tokens sits at position ``ctx + j``
  and attends to keys ``0 .. ctx + j`` (causal within the new tokens). A program walks key tiles
  of ``TILE`` positions up to its last row's position; position ``p`` is read from block
  ``block_tables[seq, p // block_size]``, slot ``p % block_size``, of the cache
  ``[2, num_blocks, num_kv_heads, block_size, head_dim]``.
- Online softmax (FlashAttention-2, Dao 2023) in float32: running max ``m``, sum ``l`` and
  accumulator ``acc [BLOCK_M, head_dim]``, rescaled by ``exp2(m_old - m_new)`` per tile;
  ``log2(e)`` folded into the scale. float32 inputs take IEEE dot products (no TF32).
- The int8 cache (:mod:`pagedserve.ops.kv_int8`: per (block, KV head) cell, int8 values
  ``[block_size, head_dim]`` then float32 scales ``[block_size]``): int8 values convert exactly
  to the query dtype; the per-token K scale multiplies the scores ``Q K^T`` and the V scale the
  probabilities before ``P V`` (vLLM's per-token-head int8 mode), so no dequantized copy exists.
- Split-KV for decode batches too small to fill the GPU (flash-decoding): ``num_splits``
  programs per (tile, KV head) each take a contiguous share of the key tiles and store their
  unnormalized ``acc``, ``m`` and ``l`` in float32; a second kernel combines them.
- Sliding window (Mistral, Gemma 2/3; HF's rule: the query at position ``p`` reads key ``k`` iff
  ``p - window < k <= p``): a program starts at the key tile holding its first row's first key
  (split-KV shares divide the tiles from there) and masks the partial tile; keys before the
  window are never loaded (their blocks may be freed and reused). Gemma 2's logit softcap
  ``cap * tanh(s / cap)`` applies to the scaled scores before the softmax.

Untested on a GPU so far: the tests run these kernels under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch
import triton
import triton.language as tl

from pagedserve.model.attn_metadata import AttentionMetadata, FlatAttentionInputs
from pagedserve.model.backends.torch_backend import TorchBackend

TILE = 32  # key positions per inner-loop step
MIN_BLOCK_M = 16  # tl.dot needs M >= 16
MAX_SPLITS = 16
SPLIT_MIN_TILES = 4  # a split-KV share has at least this many key tiles
MAX_HEAD_DIM = 256
MAX_QUERIES_PER_KV = 64


@triton.jit
def _find_seq(query_start_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile ``q_tile``: the last ``i`` with
    ``query_start[i] // BLOCK_Q + i <= q_tile`` (binary search over ``[0, num_seqs)``)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])  # one compiled variant for any batch
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]; unused with NUM_SPLITS > 1
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [2, num_blocks, Hkv, block_size, D], or the int8 cells [2, num_blocks, Hkv, cell_bytes]
    scale_ptr,  # the int8 cache viewed as float32 (scales); any pointer otherwise
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32: cached context + new tokens
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D_PAD] float32 (NUM_SPLITS > 1)
    part_max_ptr,  # [T, Hq, NUM_SPLITS] float32
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] float32
    qk_scale,  # softmax scale * log2(e)
    softcap,  # Gemma 2's attention-logit cap (SOFTCAP)
    window,  # sliding window in tokens; 0: none
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kv,  # cache strides in its own elements (bytes for int8)
    stride_blk,
    stride_head,
    stride_tok,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    KV_INT8: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local = q_tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_t = tl.arange(0, TILE)
    q_pos = local * BLOCK_Q + offs_m // QUERIES_PER_KV  # token within the chunk
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_pos < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_pos).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_abs = ctx_len + q_pos  # each row's position in its sequence

    # keys up to the last row's position, from the first row's first key under a window; with
    # splits, this program's share of those key tiles
    kv_end = ctx_len + tl.minimum((local + 1) * BLOCK_Q, q_len)
    kv_start = tl.where(window > 0, tl.maximum(ctx_len + local * BLOCK_Q - window + 1, 0), 0)
    first_tile = kv_start // TILE
    num_tiles = tl.cdiv(kv_end, TILE)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    t_lo = first_tile + split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_head
    for j in range(t_lo, t_hi):
        pos = j * TILE + offs_t
        pos_ok = (pos < kv_end) & (pos >= kv_start)  # keys before the window: never loaded
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        cell = blk * stride_blk + head_off  # [TILE] offsets of each key's (block, head) cell
        base = cell + slot * stride_tok
        k = tl.load(kv_ptr + base[None, :] + offs_d[:, None], mask=d_ok[:, None] & pos_ok[None, :], other=0.0)  # [D, TILE]
        v = tl.load(kv_ptr + stride_kv + base[:, None] + offs_d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)  # [BLOCK_M, TILE]
        if KV_INT8:
            # float32 scales after the cell's int8 values (cell offsets are multiples of 4 bytes)
            sc = (cell + BLOCK_SIZE * HEAD_DIM) // 4 + slot
            k_scale = tl.load(scale_ptr + sc, mask=pos_ok, other=0.0)
            v_scale = tl.load(scale_ptr + stride_kv // 4 + sc, mask=pos_ok, other=0.0)
        if SOFTCAP:  # cap * tanh(x / cap) of the scaled score x, tanh(y) = 1 - 2 / (exp(2y) + 1)
            if KV_INT8:
                s = s * k_scale[None, :]
            s = s * (qk_scale / 1.4426950408889634) / softcap
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * 1.4426950408889634
        elif KV_INT8:
            s = s * (k_scale * qk_scale)[None, :]
        else:
            s = s * qk_scale
        allowed = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_abs[:, None])
        allowed = allowed & ((pos[None, :] > q_abs[:, None] - window) | (window == 0))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: m stays -inf
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if KV_INT8:
            p = p * v_scale[None, :]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (tok * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One (token, head) of a split-KV launch: ``sum_s w_s acc_s / sum_s w_s l_s`` with
    ``w_s = exp2(m_s - max_s m_s)``; empty shares (``m = -inf``, ``l = 0``: no key of the row,
    e.g. all before its window) weigh 0."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = (tok * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_max_ptr + part)
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(tl.load(part_sum_ptr + part) * w, 0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether :func:`triton_paged_attention` takes a model of these heads and dtype."""
    return (
        dtype in (torch.float16, torch.bfloat16, torch.float32)
        and num_heads % num_kv_heads == 0
        and head_dim <= MAX_HEAD_DIM
        and num_heads // num_kv_heads <= MAX_QUERIES_PER_KV
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, sm_count: int) -> int:
    """Split-KV shares for a launch: more than 1 only for a decode-only batch whose
    ``num_seqs * num_kv_heads`` programs fill less than half of ``sm_count`` multiprocessors and
    whose longest sequence gives every share at least :data:`SPLIT_MIN_TILES` key tiles: about
    one wave of programs, a power of 2, at most :data:`MAX_SPLITS`. (A guess until measured on a
    GPU.) A CUDA graph needs a grid that does not change between replays: pass a fixed
    ``num_splits`` there (shares past a short sequence's end are empty and cheap)."""
    programs = num_seqs * num_kv_heads
    if max_query_len > 1 or sm_count <= 0 or 2 * programs >= sm_count:
        return 1
    by_len = max_seq_len // (SPLIT_MIN_TILES * TILE)
    n = min(MAX_SPLITS, sm_count // programs, by_len)
    return 1 << (n.bit_length() - 1) if n >= 2 else 1  # rounded down to a power of 2: about one wave


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def triton_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_seq_len: int = 0,
    num_splits: Optional[int] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of every query token of a flat batch to its own sequence's cached K/V up to its
    position, in one launch (two with split-KV). Returns ``out``.

    Args:
        query: ``[T, Hq, D]`` float16 / bfloat16 / float32, last dim contiguous; sequence ``i``'s
            tokens are ``[query_start_loc[i], query_start_loc[i + 1])``.
        kv_cache: one layer's cache, ``[2, num_blocks, Hkv, block_size, D]`` in the query's dtype,
            or int8 ``[2, num_blocks, Hkv, cell_bytes]`` (:mod:`pagedserve.ops.kv_int8`);
            this step's K/V already written.
        block_tables: ``[B, max_blocks]`` int32; row ``i`` covers ``seq_lens[i]`` tokens.
        query_start_loc: ``[B + 1]`` int32 cumulative new-token counts (starts at 0).
        seq_lens: ``[B]`` int32 cached context + new tokens.
        scale: softmax scale. out: ``[T, Hq, D]``, written.
        block_size: tokens per cache block.
        max_query_len, max_seq_len: host-side maxima (choose the tile shape and the splits).
        num_splits: split-KV shares (a power of 2); None chooses (:func:`choose_num_splits`).
        window: sliding window in tokens (None: full attention): the token at position ``p``
            reads keys ``(p - window, p]`` only, never loading older ones.
        softcap: Gemma 2's attention-logit cap (None: none): scores ``cap * tanh(s / cap)``.
    """
    T, num_heads, head_dim = query.shape
    kv_int8 = kv_cache.dtype == torch.int8
    num_kv_heads = kv_cache.shape[2]
    num_seqs = block_tables.shape[0]
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not (kv_int8 or kv_cache.dtype == query.dtype):
        raise ValueError(f"query {query.dtype} with a {kv_cache.dtype} cache is not supported")
    if out.shape != query.shape or query.stride(-1) != 1 or out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and out must be [T, Hq, D] alike with a contiguous last dim, and the cache contiguous in its last dim")
    if not supports(num_heads, num_kv_heads, head_dim, query.dtype):
        raise ValueError(f"unsupported heads: {num_heads} query heads, {num_kv_heads} KV heads, head_dim {head_dim}")
    for name, t, n in (("block_tables", block_tables, 2), ("query_start_loc", query_start_loc, 1), ("seq_lens", seq_lens, 1)):
        if t.dtype != torch.int32 or t.dim() != n or t.stride(-1) != 1:
            raise ValueError(f"{name} must be int32, {n}-D, contiguous in its last dim")
    if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
        raise ValueError(f"window must be >= 1 and softcap > 0, got {window} and {softcap}")
    if T == 0 or num_seqs == 0:
        return out
    if kv_int8:
        if (block_size * head_dim) % 4 or any(s % 4 for s in kv_cache.stride()[:3]):
            raise ValueError("the int8 cache's cells must be 4-byte aligned")
        stride_tok = head_dim
        scale_view = kv_cache.view(torch.float32)  # the same memory; the kernel reads the scales through it
    else:
        stride_tok, scale_view = kv_cache.stride(3), kv_cache
    qpk = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(qpk))
    block_q = block_m // qpk
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, _sm_count(query.device))
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of 2, got {num_splits}")
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty((T, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=query.device)
        part_max = torch.empty((T, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused
    grid = (T // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out,
        query,
        kv_cache,
        scale_view,
        block_tables,
        query_start_loc,
        seq_lens,
        part_out,
        part_max,
        part_sum,
        scale * 1.4426950408889634,
        float(softcap or 1.0),
        int(window or 0),
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        stride_tok,
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=qpk,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        TILE=TILE,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        KV_INT8=kv_int8,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,  # float32: no TF32
        SOFTCAP=softcap is not None,
    )
    if num_splits > 1:
        _combine_splits_kernel[(T, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
        )
    return out


def flat_attention_inputs(metadata: AttentionMetadata, num_tokens: int, device: torch.device) -> FlatAttentionInputs:
    """Join ``metadata.groups`` (decodes, then prefill chunks, in the flat batch's order)."""
    width = max(g.block_tables.shape[1] for g in metadata.groups)
    tables, lens, qlens, seqs, first = [], [], [], [], 0
    for g in metadata.groups:
        if g.token_start != first:
            raise ValueError(f"attention groups are not contiguous: a group starts at token {g.token_start}, expected {first}")
        bt = g.block_tables
        tables.append(bt if bt.shape[1] == width else torch.nn.functional.pad(bt, (0, width - bt.shape[1])))
        lens.append(g.seq_lens)
        qlens += g.query_lens
        seqs += [q + c for q, c in zip(g.query_lens, g.context_lens)]
        first = g.token_end
    if first != num_tokens:
        raise ValueError(f"the attention groups cover {first} tokens, the step has {num_tokens}")
    starts = np.zeros(len(qlens) + 1, dtype=np.int32)
    np.cumsum(qlens, out=starts[1:])
    return FlatAttentionInputs(
        block_tables=torch.cat(tables).to(device=device, dtype=torch.int32),
        query_start_loc=torch.from_numpy(starts).to(device),
        seq_lens=torch.cat(lens).to(device=device, dtype=torch.int32),
        max_query_len=max(qlens),
        max_seq_len=max(seqs),
    )


class TritonBackend(TorchBackend):
    """The PyTorch backend with attention in :func:`triton_paged_attention` (one launch per
    layer for the whole step). The K/V write stays PyTorch's ``write_kv_cache``."""

    name = "triton"

    def __init__(self) -> None:
        self._flat: Optional[tuple[AttentionMetadata, FlatAttentionInputs]] = None

    def begin_forward(self, model: Any, positions: torch.Tensor, metadata: AttentionMetadata, kv_caches: list, dtype: torch.dtype) -> Any:
        self._flat = None
        return super().begin_forward(model, positions, metadata, kv_caches, dtype)

    def attention(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """Every query token ``[T, num_heads, head_dim]`` attends to its own request's cached
        K/V up to its position (causal); ``key``/``value`` are unused (already in the cache).
        ``window``/``softcap``: as :meth:`TorchBackend.attention`, in the kernel."""
        out = torch.empty_like(query)
        f = metadata.flat  # staged by the CUDA step loop
        if f is None:
            if not metadata.groups:
                return out
            if self._flat is None or self._flat[0] is not metadata:  # built once per step, shared by the layers
                self._flat = (metadata, flat_attention_inputs(metadata, query.shape[0], query.device))
            f = self._flat[1]
        return triton_paged_attention(
            query,
            kv_cache,
            f.block_tables,
            f.query_start_loc,
            f.seq_lens,
            scale,
            out,
            metadata.block_size,
            f.max_query_len,
            f.max_seq_len,
            f.num_splits,
            window,
            softcap,
        )
