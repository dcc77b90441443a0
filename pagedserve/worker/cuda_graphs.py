"""CUDA graphs of the model's forward for decode-only steps (vLLM's "piecewise"-free, full
decode graphs): one graph per padded batch size (1, 2, 4, 8, ... up to ``max_num_seqs``),
captured over the fixed device buffers of :class:`~pagedserve.worker.step_buffers.StepBuffers`.
A decode step of ``n`` sequences is padded to the smallest captured size ``N >= n`` and replays
that graph: ~40-50 kernel launches per layer become one launch. Prefill and mixed steps, and
decode batches larger than the largest size, stay eager.

Padded rows read token 0 at position 0, write their K/V to the first slot of a scratch block
(one block past the pool, never handed to the scheduler) and attend to that one slot; their
hidden states are dropped. The attention kernel's split-KV count is fixed per size (a graph's
grid cannot change between replays).

Off by default (``EngineConfig.enforce_eager=True``) until a GPU run shows replay equal to
eager: the capture and replay code here has never run on a GPU. On CPU, ``capture=False`` runs
the same padded forward eagerly over the same buffers (tested), which checks the padding but
not the graphs themselves.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from pagedserve.model.attn_metadata import AttentionMetadata, FlatAttentionInputs
from pagedserve.worker.step_buffers import StagedStep, StepBuffers

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded decode batch sizes captured: powers of 2 below ``max_num_seqs``, then
    ``max_num_seqs`` itself (every decode batch the scheduler can form has a size)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return sizes + [max_num_seqs]


def padded_batch_size(n: int, sizes: list[int]) -> Optional[int]:
    """The smallest of ``sizes`` (ascending) that holds ``n`` sequences; None when none does
    (the step runs eager) or ``n`` is 0."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def _default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    from pagedserve.model.backends import triton_attention as ta  # triton: CUDA (or the interpreter) only

    return ta.choose_num_splits(num_seqs, num_kv_heads, 1, max_seq_len, ta._sm_count(device))


class DecodeGraphs:
    """Decode-step forwards at padded batch sizes, captured as CUDA graphs.

    Args:
        model: the loaded model (its backend must read ``AttentionMetadata.flat``: Triton).
        kv_caches: per-layer caches, including the scratch block.
        buffers: the step buffers the graphs read (fixed addresses).
        block_size: tokens per block. scratch_block: the block padded rows write to.
        max_model_len: the longest sequence (fixes each size's split-KV count).
        sizes: ascending padded batch sizes (:func:`graph_batch_sizes`).
        capture: True on CUDA (capture, then replay); False runs each padded step eagerly over
            the same buffers (CPU tests).
        num_splits: ``(N, num_kv_heads, max_model_len, device) -> shares``; default: the
            kernel's own choice for a decode batch of ``N`` sequences of ``max_model_len``.
    """

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        buffers: StepBuffers,
        block_size: int,
        scratch_block: int,
        max_model_len: int,
        sizes: list[int],
        capture: bool = True,
        num_splits: Callable[[int, int, int, torch.device], int] = _default_num_splits,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = sizes
        self.capture_graphs = capture
        num_kv_heads = kv_caches[0].shape[2]
        self.num_splits = {n: num_splits(n, num_kv_heads, max_model_len, buffers.device) for n in sizes}
        self.max_model_len = max_model_len
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, n: int) -> Optional[int]:
        return padded_batch_size(n, self.sizes)

    def _metadata(self, staged: StagedStep, size: int) -> AttentionMetadata:
        f = staged.flat
        flat = FlatAttentionInputs(f.block_tables, f.query_start_loc, f.seq_lens, 1, self.max_model_len, self.num_splits[size])
        return AttentionMetadata(staged.slot_mapping, [], self.block_size, flat=flat)

    def _stage_padding(self, size: int) -> StagedStep:
        """A step of ``size`` padded rows only (what capture runs on)."""
        empty = np.zeros(0, dtype=np.int64)
        table = np.zeros((1, self.buffers.max_blocks), dtype=np.int64)
        return self.buffers.stage(empty, empty, empty, empty, empty, table, empty, self.block_size, pad_to=size, scratch_block=self.scratch_block)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, in one shared memory pool (CUDA)."""
        if not self.capture_graphs:
            return
        t0 = time.monotonic()
        pool = None
        for size in reversed(self.sizes):
            staged = self._stage_padding(size)
            meta = self._metadata(staged, size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (compiles the kernels) off the capture
                for _ in range(2):
                    self.model(staged.input_ids, staged.positions, self.kv_caches, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(staged.input_ids, staged.positions, self.kv_caches, meta)
            pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize()  # the next size rewrites the pinned buffers this one copied from
        logger.info("pagedserve worker: captured %d decode CUDA graphs (batch sizes %s) in %.1fs", len(self.sizes), self.sizes, time.monotonic() - t0)

    def run(self, staged: StagedStep) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode step staged with ``pad_to`` = one of the
        sizes (``n = staged.num_seqs``): a graph replay, or the eager padded forward."""
        size = int(staged.flat.seq_lens.shape[0])
        n = staged.num_seqs
        if self.capture_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self.model(staged.input_ids, staged.positions, self.kv_caches, self._metadata(staged, size))[:n]
