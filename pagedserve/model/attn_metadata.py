"""What attention needs to know of one step, built by the worker and shared by all layers:
the flat ``slot_mapping`` of the new tokens and, per group of requests (decodes, then prefill
chunks), their block tables and lengths.

Algorithm: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023): token ``p`` of a request lives in slot
``block_table[p // B] * B + p % B`` of a pool of fixed-size blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


@dataclass
class AttentionGroup:
    """Requests of one step with the same kind of query (decode or prefill chunk).

    Attributes:
        token_start, token_end: the group's tokens are ``[token_start, token_end)`` of the flat batch.
        block_tables: ``[num_seqs, max_blocks]`` int64; entries past a sequence's last block
            are valid but unused block ids.
        seq_lens: ``[num_seqs]`` int64 tokens each sequence attends to (context + its chunk).
        query_lens, context_lens: per sequence, new tokens and already-cached tokens (Python ints).
        is_decode: every sequence has exactly one query token.
        token_seq, token_lens: ``[num_tokens]`` int64, per query token of a prefill group: its
            sequence's row in ``block_tables`` and how many tokens it attends to (its position
            + 1). None for a decode group (``seq_lens`` says it).
    """

    token_start: int
    token_end: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    is_decode: bool
    token_seq: Optional[torch.Tensor] = None
    token_lens: Optional[torch.Tensor] = None
    _decode_mask: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def decode_mask(self, block_size: int) -> torch.Tensor:
        """``[num_seqs, 1, 1, max_blocks * block_size]`` bool, for the PyTorch decode path."""
        if self._decode_mask is None:
            key_pos = torch.arange(self.block_tables.shape[1] * block_size, device=self.seq_lens.device)
            self._decode_mask = (key_pos[None, :] < self.seq_lens[:, None])[:, None, None, :]
        return self._decode_mask


@dataclass
class FlatAttentionInputs:
    """A step's requests as one flat batch for the Triton paged-attention kernel
    (``pagedserve.model.backends.triton_attention``).

    Attributes:
        block_tables: ``[B, max_blocks]`` int32 (narrower group tables padded with block 0).
        query_start_loc: ``[B + 1]`` int32. seq_lens: ``[B]`` int32.
        max_query_len, max_seq_len: host ints.
        num_splits: split-KV shares, fixed (a CUDA graph needs a grid that does not change
            between replays); None = chosen per launch.
    """

    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_splits: Optional[int] = None


@dataclass
class AttentionMetadata:
    """What attention needs for one step, shared by all layers.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of each new token.
        groups: decode group and/or prefill group (order matches the flat batch).
        block_size: tokens per block.
        flat: the same step as one flat batch, already on the device (the CUDA step loop
            stages it, ``pagedserve.worker.step_buffers``); None = backends build what they
            need from ``groups``. With ``flat`` set ``groups`` may be empty (Triton backend only).
    """

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    block_size: int = 16
    flat: Optional[FlatAttentionInputs] = None

    _slot_split: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    def slot_block_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot_mapping // block_size, slot_mapping % block_size)``, computed on first use
        (only the PyTorch cache write needs them; the C ops take the flat slots)."""
        if self._slot_split is None:
            blk = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
            self._slot_split = (blk, self.slot_mapping - blk * self.block_size)
        return self._slot_split


def build_attention_group(
    token_start: int,
    query_lens,
    context_lens,
    block_table,
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    """Metadata for ``n`` requests whose queries are ``query_lens`` tokens following
    ``context_lens`` already-cached tokens (``[n]`` ints each, tokens).

    ``block_table``: ``[n, >= max blocks]`` int64 NumPy array whose row i starts with request
    i's block ids (what follows must be valid block ids), or a list of block-id lists.
    """
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(context_lens, dtype=np.int64)
    seq_lens = c + q
    max_blocks = -(-int(seq_lens.max()) // block_size)
    if not isinstance(block_table, np.ndarray):
        rows = [list(r)[:max_blocks] for r in block_table]
        block_table = np.array([r + [0] * (max_blocks - len(r)) for r in rows], dtype=np.int64)
    table = np.ascontiguousarray(block_table[:, :max_blocks])
    is_decode = int(q.max()) == 1
    token_seq = token_lens = None
    if not is_decode:
        total = int(q.sum())
        starts = np.cumsum(q) - q
        token_seq = torch.from_numpy(np.repeat(np.arange(len(q), dtype=np.int64), q)).to(device)
        token_lens = torch.from_numpy(np.repeat(c - starts + 1, q) + np.arange(total, dtype=np.int64)).to(device)
    return AttentionGroup(
        token_start=token_start,
        token_end=token_start + int(q.sum()),
        block_tables=torch.from_numpy(table).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        query_lens=q.tolist(),
        context_lens=c.tolist(),
        is_decode=is_decode,
        token_seq=token_seq,
        token_lens=token_lens,
    )
