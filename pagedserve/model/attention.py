"""PagedAttention over a flat, unpadded token batch (pure PyTorch, CPU or CUDA).

Algorithm: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023). Each layer owns a cache of shape
``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (K then V; head-major inside a block so
one head's tokens of a block are contiguous). A step first writes every new token's K/V through
the flat ``slot_mapping`` (slot = block_id * block_size + offset), then each request's queries
attend to its own cached K/V up to their positions.

To keep the number of Python-level ops per layer independent of the number of requests, the
requests of a step are split into at most two groups, decodes (one query token each) and
prefill chunks (several), and each group runs one gather through its padded block table and one
``scaled_dot_product_attention`` call with a boolean mask built once per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pagedserve.model.cpu_kernels import paged_decode_attention


@dataclass
class AttentionGroup:
    """Requests of one step that share a query padding.

    Attributes:
        token_start, token_end: the group's tokens are ``[token_start, token_end)`` of the flat batch.
        block_tables: ``[num_seqs, max_blocks]`` int64, padded with block 0.
        query_pad_index: ``[num_tokens_in_group]`` int64 row of each token in the padded
            ``[num_seqs * max_query_len]`` query layout, or None when max_query_len == 1.
        max_query_len: longest query chunk in the group (tokens).
        attn_mask: ``[num_seqs, 1, max_query_len, max_blocks * block_size]`` bool (True = attend);
            None for a decode group, which the CPU kernel serves from ``seq_lens`` instead.
        seq_lens: ``[num_seqs]`` int64 tokens each query attends to (context + its chunk).
    """

    token_start: int
    token_end: int
    block_tables: torch.Tensor
    query_pad_index: Optional[torch.Tensor]
    max_query_len: int
    attn_mask: Optional[torch.Tensor]
    seq_lens: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class AttentionMetadata:
    """What attention needs for one step, shared by all layers.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of each new token.
        groups: decode group and/or prefill group (order matches the flat batch).
    """

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    block_size: int = 16

    def __post_init__(self) -> None:
        self.slot_block = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        self.slot_offset = self.slot_mapping - self.slot_block * self.block_size


def build_attention_group(
    token_start: int,
    query_lens: list[int],
    context_lens: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    """Metadata for requests whose queries are ``query_lens`` tokens following
    ``context_lens`` already-cached tokens (both in tokens)."""
    n = len(query_lens)
    max_q = max(query_lens)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    max_blocks = -(-max(seq_lens) // block_size)
    table = torch.zeros((n, max_blocks), dtype=torch.int64)
    for i, ids in enumerate(block_ids):
        nb = -(-seq_lens[i] // block_size)
        table[i, :nb] = torch.tensor(ids[:nb], dtype=torch.int64)
    S = max_blocks * block_size
    key_pos = torch.arange(S)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    qlen = torch.tensor(query_lens, dtype=torch.int64)
    if max_q == 1:
        mask = key_pos[None, :] < (ctx + 1)[:, None]  # [n, S]
        mask = mask[:, None, None, :]
        pad_index = None
    else:
        j = torch.arange(max_q)
        q_pos = ctx[:, None] + j[None, :]  # [n, max_q] absolute position of each query
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # causal, also bounds by seq len
        valid_q = j[None, :] < qlen[:, None]
        # padded query rows attend to key 0 only (their output is discarded) to avoid NaN
        mask = torch.where(valid_q[:, :, None], mask, key_pos[None, None, :] == 0)
        mask = mask[:, None, :, :]
        rows = torch.arange(n)[:, None] * max_q + j[None, :]
        pad_index = rows[valid_q]
    token_end = token_start + sum(query_lens)
    return AttentionGroup(
        token_start,
        token_end,
        table.to(device),
        None if pad_index is None else pad_index.to(device),
        max_q,
        mask.to(device),
        torch.tensor(seq_lens, dtype=torch.int64, device=device),
    )


def write_kv_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: "AttentionMetadata") -> None:
    """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` at their slots in
    ``kv_cache [2, num_blocks, num_kv_heads, block_size, head_dim]``."""
    blk, off = metadata.slot_block, metadata.slot_offset
    kv_cache[0][blk, :, off] = key.to(kv_cache.dtype)
    kv_cache[1][blk, :, off] = value.to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    use_cpu_kernel: bool = True,
) -> torch.Tensor:
    """Attention of every query token to its own request's cached K/V (causal).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` with this step's K/V
            already written.
    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(query)
    num_heads, hd = query.shape[1], query.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    nkv = k_cache.shape[1]
    for g in metadata.groups:
        n = g.num_seqs
        if g.max_query_len == 1 and use_cpu_kernel and paged_decode_attention(
            query[g.token_start : g.token_end], kv_cache, g.block_tables, g.seq_lens, scale, out[g.token_start : g.token_end]
        ):
            continue
        # [n, max_blocks, nkv, block_size, hd] -> [n, nkv, S, hd]
        k = k_cache[g.block_tables].transpose(1, 2).reshape(n, nkv, -1, hd)
        v = v_cache[g.block_tables].transpose(1, 2).reshape(n, nkv, -1, hd)
        q = query[g.token_start : g.token_end]
        if g.query_pad_index is None:
            qp = q.view(n, 1, num_heads, hd)
        else:
            qp = q.new_zeros((n * g.max_query_len, num_heads, hd))
            qp.index_copy_(0, g.query_pad_index, q)
            qp = qp.view(n, g.max_query_len, num_heads, hd)
        o = F.scaled_dot_product_attention(
            qp.transpose(1, 2), k, v, attn_mask=g.attn_mask, scale=scale, enable_gqa=(nkv != num_heads)
        )  # [n, H, max_q, hd]
        o = o.transpose(1, 2).reshape(n * g.max_query_len, num_heads, hd)
        if g.query_pad_index is not None:
            o = o.index_select(0, g.query_pad_index)
        out[g.token_start : g.token_end] = o
    return out
