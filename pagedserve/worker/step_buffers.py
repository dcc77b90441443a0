"""Persistent per-step input buffers of the CUDA step loop: host buffers (pinned on CUDA)
mirrored by device buffers at fixed addresses, each copied once per step with
``non_blocking=True`` (vLLM v1's ``CpuGpuBuffer``), so a step makes no pageable, blocking
host->device copies and a CUDA graph can be captured over the device buffers.

Two kinds:

- :class:`StepBuffers`: the model's inputs (``input_ids``, ``positions``, ``slot_mapping``) and
  the flat attention batch (``query_start_loc``, ``seq_lens``, ``block_tables``), at fixed
  addresses; a decode step can be padded to a CUDA graph's batch size (padded rows write their
  K/V to a scratch slot and attend to one token of a scratch block).
- :class:`StagingArena`: per-step tensors of varying shapes (the sampling state, the logits
  indices of a step where some requests do not sample): bump-allocated in one pinned buffer,
  sent in one copy by :meth:`StagingArena.flush`.

A host buffer may be rewritten only after the previous step's copies out of it have run: the
caller waits on :class:`HostSync` at the start of a step (a no-op when the step's device->host
copy of the sampled tokens already synchronized).

Nothing here calls CUDA unless the device is CUDA: on CPU (tests) the "host" and "device"
buffers are two CPU tensors and the copies are plain copies. Untested on a GPU: pinning,
``non_blocking`` ordering and the event wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedserve.model.attn_metadata import FlatAttentionInputs


class HostSync:
    """An event recorded after a step's host->device copies; :meth:`wait` blocks until they ran
    (CUDA), so pinned host buffers can be rewritten. A no-op on CPU."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._recorded = False

    def record(self) -> None:
        if self._event is not None:
            self._event.record()
            self._recorded = True

    def wait(self) -> None:
        if self._event is not None and self._recorded:
            self._event.synchronize()


def _pair(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class StagedStep:
    """Device views of one staged step (``T'`` tokens and ``n'`` sequences, padded or not).

    Attributes:
        input_ids, positions, slot_mapping: ``[T']`` int64.
        flat: ``block_tables [n', W]`` int32, ``query_start_loc [n' + 1]`` int32,
            ``seq_lens [n']`` int32 and the host maxima.
        num_tokens, num_seqs: the real (unpadded) counts.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    flat: FlatAttentionInputs
    num_tokens: int
    num_seqs: int


class StepBuffers:
    """The model inputs of one step at fixed device addresses.

    Args:
        max_num_tokens: most tokens in a step (the token budget, at least ``max_num_reqs``).
        max_num_reqs: most sequences in a step.
        max_blocks_per_req: block-table width.
        device: where the model runs.
        pin: pin the host buffers (default: on CUDA).
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device, pin: Optional[bool] = None) -> None:
        pin = device.type == "cuda" if pin is None else pin
        self.device = device
        self.max_blocks = max_blocks_per_req
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.input_ids = _pair((max_num_tokens,), torch.int64, device, pin)
        self.positions = _pair((max_num_tokens,), torch.int64, device, pin)
        self.slot_mapping = _pair((max_num_tokens,), torch.int64, device, pin)
        self.query_start_loc = _pair((max_num_reqs + 1,), torch.int32, device, pin)
        self.seq_lens = _pair((max_num_reqs,), torch.int32, device, pin)
        # Flat: a step's tables are [n, W] contiguous at the start (W = its widest, or the full
        # width for a graph step: a captured kernel keeps its row stride).
        self.block_tables = _pair((max_num_reqs * max_blocks_per_req,), torch.int32, device, pin)

    def stage(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        rows: np.ndarray,
        block_size: int,
        pad_to: Optional[int] = None,
        scratch_block: int = 0,
    ) -> StagedStep:
        """Write a step into the host buffers and copy each used prefix to the device.

        Args:
            input_ids, positions, slot_mapping: ``[T]`` int64, the flat batch.
            query_lens, seq_lens: ``[n]`` int64 per sequence (new tokens; context + new).
            block_table: the input batch's ``[max_num_reqs, max_blocks]`` int64 table, and
                ``rows``: ``[n]`` its rows of the step's sequences, in order.
            pad_to: a decode-only step (``T == n``) padded to ``pad_to`` sequences for a CUDA
                graph: padded rows read token 0 at position 0, write K/V to the first slot of
                ``scratch_block`` and attend to that one slot; the tables get the full width.
        """
        T, n = len(input_ids), len(query_lens)
        if pad_to is not None and (T != n or not n <= pad_to <= self.max_num_reqs):
            raise ValueError(f"padding needs a decode-only step of at most pad_to={pad_to} sequences (got {T} tokens, {n} sequences)")
        Tp, Np = (T, n) if pad_to is None else (pad_to, pad_to)
        ids_h, pos_h, slot_h = (b[0].numpy() for b in (self.input_ids, self.positions, self.slot_mapping))
        ids_h[:T], pos_h[:T], slot_h[:T] = input_ids, positions, slot_mapping
        qsl_h, sl_h = self.query_start_loc[0].numpy(), self.seq_lens[0].numpy()
        qsl_h[0] = 0
        _cumsum(query_lens, qsl_h[1 : n + 1])
        sl_h[:n] = seq_lens
        max_seq = int(seq_lens.max()) if n else 0
        W = self.max_blocks if pad_to is not None else max(1, -(-max_seq // block_size))
        bt_h = self.block_tables[0].numpy()[: Np * W].reshape(Np, W)
        used = max(1, -(-max_seq // block_size))
        bt_h[:n, :used] = block_table[rows, :used]
        if Np > n:  # graph padding: one scratch token per padded row
            ids_h[T:Tp] = 0
            pos_h[T:Tp] = 0
            slot_h[T:Tp] = scratch_block * block_size
            qsl_h[n + 1 : Np + 1] = np.arange(n + 1, Np + 1)
            sl_h[n:Np] = 1
            bt_h[n:Np, 0] = scratch_block
        copy = _copier(self.device)
        return StagedStep(
            input_ids=copy(self.input_ids, Tp),
            positions=copy(self.positions, Tp),
            slot_mapping=copy(self.slot_mapping, Tp),
            flat=FlatAttentionInputs(
                block_tables=copy(self.block_tables, Np * W).view(Np, W),
                query_start_loc=copy(self.query_start_loc, Np + 1),
                seq_lens=copy(self.seq_lens, Np),
                max_query_len=int(query_lens.max()) if n else 0,
                max_seq_len=max_seq,
            ),
            num_tokens=T,
            num_seqs=n,
        )


def _cumsum(x: np.ndarray, out: np.ndarray) -> None:
    np.cumsum(x, out=out, dtype=out.dtype)


def _copier(device: torch.device):
    non_blocking = device.type == "cuda"

    def copy(pair: tuple[torch.Tensor, torch.Tensor], n: int) -> torch.Tensor:
        host, dev = pair
        return dev[:n].copy_(host[:n], non_blocking=non_blocking)

    return copy


class StagingArena:
    """Per-step tensors of any shape in one pinned host buffer and its device mirror:
    :meth:`put` writes an array at the next aligned offset and returns its device view, which
    holds the data once :meth:`flush` has copied ``[0, end)`` (one copy per step). An array
    that does not fit the arena is copied on its own (blocking). Reset per step by
    :meth:`reset` (after :class:`HostSync` says the last flush ran)."""

    ALIGN = 16

    def __init__(self, capacity_bytes: int, device: torch.device, pin: Optional[bool] = None) -> None:
        pin = device.type == "cuda" if pin is None else pin
        self.device = device
        self.host, self.dev = _pair((capacity_bytes,), torch.uint8, device, pin)
        self._host_np = self.host.numpy()
        self.end = 0
        self.flushed = 0

    def reset(self) -> None:
        self.end = self.flushed = 0

    def put(self, values: np.ndarray) -> torch.Tensor:
        """The device tensor of ``values`` (same dtype and shape), valid after :meth:`flush`."""
        values = np.ascontiguousarray(values)
        nbytes = values.nbytes
        off = -(-self.end // self.ALIGN) * self.ALIGN
        if off + nbytes > len(self._host_np):
            return torch.from_numpy(values).to(self.device)
        self._host_np[off : off + nbytes] = values.reshape(-1).view(np.uint8)
        self.end = off + nbytes
        dtype = torch.from_numpy(values[:0]).dtype
        return self.dev[off : off + nbytes].view(dtype).view(values.shape)

    def flush(self) -> None:
        """Copy what was put since the last flush to the device (one ``non_blocking`` copy)."""
        if self.end > self.flushed:
            lo, hi = self.flushed, self.end
            self.dev[lo:hi].copy_(self.host[lo:hi], non_blocking=self.device.type == "cuda")
            self.flushed = self.end
