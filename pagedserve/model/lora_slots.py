"""The resident adapters' stacked weights and the batched LoRA delta (S-LoRA / Punica style).

:class:`LoRASlots` holds ``max_loras`` slots; each resident adapter
(:class:`~pagedserve.model.lora.LoRAAdapter`) is copied into one. Per layer and fused projection
(``qkv``, ``o``, ``gate_up``, ``down``; :data:`~pagedserve.model.lora.PROJ_WIDTH` gives its width
``w``) the slots stack, zero-padded, both factors transposed (the delta is ``(x @ AT) @ BT``; the
C kernel's loops then read contiguous rows, see :mod:`pagedserve.ops.cpu.lora_ops`), in float32,
or in bfloat16 for a bfloat16 model (``dtype``; half the bytes a step reads):

- ``AT[(layer, proj)]``: ``[max_loras, in_features, R]``, A transposed;
- ``BT[(layer, proj)]``: ``[max_loras, R, out_features]``, B transposed (scaling folded in);

with ``R = w * max_rank`` rounded up to a multiple of 16 (the kernel's chunk of rank columns);
and each slot's rank in use there (``ranks``; 0 for an empty slot or a projection the adapter does
not target: its rows get no delta). :meth:`LoRASlots.add_delta` adds, to the rows of a
projection's output that belong to an adapter, ``B[s] @ (A[s] @ x)``: on the CPU the C kernel
(:func:`pagedserve.ops.cpu.lora_ops.add_lora_delta`), elsewhere (or without the kernels)
PyTorch, rows grouped by slot (``index_select``, two float32 matmuls, ``index_copy_``).

bfloat16 slots: :meth:`LoRASlots.set_slot` rounds each float32 factor (B with the scaling folded
in) once to bfloat16 (nearest even); the kernel widens them exactly and sums in float32 as for
float32 slots, so the delta is that of float32 slots holding the rounded factors, bit for bit
(the PyTorch path computes in float32 copies). The rounding moves each factor by up to 2^-9 of
itself, so the delta's error is at most about 2^-8 of the sum of its terms' magnitudes (typically
far less: the roundings do not line up), next to the bf16 roundings of the base output and of the
result that a bfloat16 model has anyway.

Batch invariance: the C kernel computes each row alone in a fixed order (a row's bits never
depend on the batch). The PyTorch path's matmuls are torch's (oneDNN / cuBLAS pick their
blocking by the number of rows), so there a row's last bits may depend on how many rows share
its adapter.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from pagedserve.model.lora import PROJ_WIDTH, LoRAAdapter, LoRAError, LoRAModelSpec
from pagedserve.ops.cpu.lora_ops import add_lora_delta, lora_kernel_available

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float16 through float32 copies


class LoRASlots:
    """Resident adapters' stacked weights, one slot per resident adapter (see the module)."""

    def __init__(self, spec: LoRAModelSpec, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        """Zeroed slots on ``device`` (all empty).

        Args:
            dtype: the model's activation dtype: bfloat16 stores the factors in bfloat16, any
                other float32 (float16's range is too narrow for factors with the scaling folded
                in); :attr:`dtype` is the one stored.

        Raises:
            ValueError: ``max_loras`` or ``max_rank`` below 1, ``dtype`` not a floating point dtype.
        """
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras} and {max_rank}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point torch dtype, got {dtype}")
        self.spec, self.max_loras, self.max_rank, self.device = spec, max_loras, max_rank, torch.device(device)
        self.dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.AT: dict[tuple[int, str], torch.Tensor] = {}
        self.BT: dict[tuple[int, str], torch.Tensor] = {}
        # The rank columns in use per slot: a CPU int32 tensor (the C kernel's) and the same as a list.
        self.ranks: dict[tuple[int, str], torch.Tensor] = {}
        self._ranks_list: dict[tuple[int, str], list[int]] = {}
        for layer in range(spec.num_layers):
            for proj, w in PROJ_WIDTH.items():
                out_f, in_f = spec.proj_shape(proj)
                key = (layer, proj)
                width = -(-w * max_rank // 16) * 16
                self.AT[key] = torch.zeros(max_loras, in_f, width, device=self.device, dtype=self.dtype)
                self.BT[key] = torch.zeros(max_loras, width, out_f, device=self.device, dtype=self.dtype)
                self.ranks[key] = torch.zeros(max_loras, dtype=torch.int32)
                self._ranks_list[key] = [0] * max_loras
        self.slot_paths: list[Optional[str]] = [None] * max_loras
        self._groups_of: Optional[tuple[weakref.ref, int, list[tuple[int, torch.Tensor]]]] = None

    def num_bytes(self) -> int:
        """Bytes of the stacked weights (all slots)."""
        return sum(t.numel() * t.element_size() for d in (self.AT, self.BT) for t in d.values())

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} outside [0, {self.max_loras})")

    def set_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (its ranks zero-padded to the slot's width; projections it
        does not target zeroed), replacing what the slot held; bfloat16 slots round each float32
        factor once (nearest even). Nothing is changed when it raises.

        Raises:
            ValueError: ``slot`` outside ``[0, max_loras)``.
            LoRAError: the adapter does not fit (a rank above ``max_rank``, weights not of this
                model's shapes: read with another max_rank or model).
        """
        self._check_slot(slot)
        for (layer, proj), (a, b) in adapter.weights.items():
            out_f, in_f = self.spec.proj_shape(proj) if proj in PROJ_WIDTH else (-1, -1)
            width = PROJ_WIDTH.get(proj, 0) * self.max_rank
            if (
                not 0 <= layer < self.spec.num_layers
                or a.dim() != 2
                or b.dim() != 2
                or tuple(a.shape[1:]) != (in_f,)
                or b.shape[0] != out_f
                or a.shape[0] != b.shape[1]
                or a.shape[0] > width
                or adapter.rank > self.max_rank
            ):
                raise LoRAError(
                    f"LoRA adapter {adapter.path}: layer {layer} {proj}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                    f"the slots (model {self.spec}, max rank {self.max_rank})"
                )
        self.clear_slot(slot)
        for (layer, proj), (a, b) in adapter.weights.items():
            key, r = (layer, proj), a.shape[0]
            self.AT[key][slot, :, :r].copy_(a.T)
            self.BT[key][slot, :r].copy_(b.T)
            self.ranks[key][slot] = r
            self._ranks_list[key][slot] = r
        self.slot_paths[slot] = adapter.path

    def clear_slot(self, slot: int) -> None:
        """Zero ``slot``: its rows get no delta until :meth:`set_slot`.

        Raises:
            ValueError: ``slot`` outside ``[0, max_loras)``.
        """
        self._check_slot(slot)
        for key in self.AT:
            if self._ranks_list[key][slot]:
                self.AT[key][slot].zero_()
                self.BT[key][slot].zero_()
                self.ranks[key][slot] = 0
                self._ranks_list[key][slot] = 0
        self.slot_paths[slot] = None

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str, row_slots: torch.Tensor) -> None:
        """``out[t] += B[s] @ (A[s] @ x[t])`` in place for each row ``t`` with ``s = row_slots[t] >= 0``
        (layer ``layer``'s fused projection ``proj``), summed in float32 and rounded once into
        out's dtype (bfloat16 slots: their factors widened exactly); rows with -1 (or an empty
        slot) are left as they are, bit for bit.

        Args:
            out: ``[T, out_features]`` float32, bfloat16 or float16, on the slots' device.
            x: ``[T, in_features]``, out's dtype and device: the projection's input.
            layer: the decoder layer, ``[0, num_layers)``.
            proj: ``"qkv"``, ``"o"``, ``"gate_up"`` or ``"down"``.
            row_slots: ``[T]`` int32, each in ``[-1, max_loras)``; the same tensor for every call
                of a step lets the PyTorch path group its rows once.

        Raises:
            ValueError: an unknown layer or projection, tensors of the wrong shape, dtype or device,
                a slot outside ``[-1, max_loras)`` (on the CPU kernel; nothing is written).
        """
        key = (layer, proj)
        if key not in self.AT:
            raise ValueError(f"no LoRA projection {proj!r} in layer {layer} (projections {list(PROJ_WIDTH)}, {self.spec.num_layers} layers)")
        at, bt = self.AT[key], self.BT[key]
        out_f, in_f = self.spec.proj_shape(proj)
        if out.dim() != 2 or x.dim() != 2 or tuple(out.shape) != (x.shape[0], out_f) or x.shape[1] != in_f or out.dtype != x.dtype:
            raise ValueError(
                f"add_delta({proj}): out {tuple(out.shape)} {out.dtype} and x {tuple(x.shape)} {x.dtype}, expected [T, {out_f}] and [T, {in_f}] of one dtype"
            )
        if row_slots.dtype != torch.int32 or tuple(row_slots.shape) != (x.shape[0],):
            raise ValueError(f"row_slots must be int32 of shape ({x.shape[0]},), got {row_slots.dtype} {tuple(row_slots.shape)}")
        if not out.is_floating_point():
            raise ValueError(f"out must be floating point, got {out.dtype}")
        if x.shape[0] == 0 or not any(self._ranks_list[key]):
            return
        if out.device != at.device or x.device != at.device:
            raise ValueError(f"out and x must be on the slots' device {at.device}, got {out.device} and {x.device}")
        if at.device.type == "cpu" and out.dtype in _KERNEL_DTYPES and lora_kernel_available():
            add_lora_delta(out, x, at, bt, self.ranks[key], row_slots.cpu(), checked=True)
            return
        add_delta_torch(out, x, at, bt, self._ranks_list[key], self._groups(row_slots))

    def _groups(self, row_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``[(slot, row indices)]`` of the rows of each slot; computed once per ``row_slots``
        tensor (kept while it lives and is not modified in place: its version counter)."""
        cached = self._groups_of
        if cached is not None and cached[0]() is row_slots and cached[1] == row_slots._version:
            return cached[2]
        groups = group_rows(row_slots.to(self.device), self.max_loras)
        self._groups_of = (weakref.ref(row_slots), row_slots._version, groups)
        return groups


def group_rows(row_slots: torch.Tensor, num_slots: int) -> list[tuple[int, torch.Tensor]]:
    """``[(slot, idx)]``: for each slot with rows, their indices (int64, in order, on
    row_slots' device). One device-to-host copy (the counts).

    Raises:
        ValueError: a slot outside ``[-1, num_slots)``.
    """
    rs = row_slots.long()
    if rs.numel() == 0:
        return []
    lo, hi = torch.aminmax(rs)
    if int(lo) < -1 or int(hi) >= num_slots:
        raise ValueError(f"row_slots has a slot outside [-1, {num_slots}): {int(lo)} .. {int(hi)}")
    counts = torch.bincount(rs + 1, minlength=num_slots + 1).tolist()
    order = torch.argsort(rs, stable=True)
    groups, start = [], counts[0]
    for s in range(num_slots):
        n = counts[s + 1]
        if n:
            groups.append((s, order[start : start + n]))
        start += n
    return groups


def add_delta_torch(
    out: torch.Tensor, x: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, ranks: list[int], groups: list[tuple[int, torch.Tensor]]
) -> None:
    """The PyTorch delta: for each ``(slot, idx)`` of ``groups`` (:func:`group_rows`) with a
    nonzero rank r, ``out[idx] = out[idx] + (x[idx] @ at[slot, :, :r]) @ bt[slot, :r]`` in float32,
    rounded once into out's dtype. at ``[S, K, R]``, bt ``[S, R, N]`` float32 or bfloat16 (widened
    to float32 copies of the slot's columns in use); out ``[T, N]``, x ``[T, K]`` of any float
    dtype, all on one device."""
    for slot, idx in groups:
        r = ranks[slot]
        if r == 0:
            continue
        xs = x.index_select(0, idx).float()
        delta = (xs @ at[slot, :, :r].float()) @ bt[slot, :r].float()
        if out.dtype == torch.float32:
            out.index_add_(0, idx, delta)
        else:
            out.index_copy_(0, idx, (out.index_select(0, idx).float() + delta).to(out.dtype))
