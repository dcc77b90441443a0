"""The worker's LoRA adapters: the registered ones in memory, the resident ones in slots, and
the per-step row mapping the model adds their deltas with (S-LoRA / Punica's scheme: rows of
several adapters and of the base model in one batch, each projection computed once for all rows,
then each row's ``B @ (A @ x)`` added beside it; no merged weights).

Registered adapters (``add``, at most ``max_cpu_loras``, checked by the engine core) are loaded
once from their PEFT folders and kept. ``max_loras`` slots hold the stacked weights the kernel
reads (:class:`pagedserve.model.lora.LoRASlots`); a step's adapters are made resident before it
runs, evicting the least recently used adapter that the step does not need (the scheduler never
puts more than ``max_loras`` adapters in one step).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from pagedserve.lora_request import LoRARequest
from pagedserve.model.lora import LoRAAdapter, LoRAModelSpec, load_peft_adapter
from pagedserve.model.lora_slots import LoRASlots

logger = logging.getLogger(__name__)


class LoRAStep:
    """The adapters of one step: ``row_slots`` int32 ``[num_tokens]`` (the slot of each token's
    adapter, -1 for the base model) over the resident ``slots``."""

    def __init__(self, slots: LoRASlots, row_slots: torch.Tensor) -> None:
        self.slots = slots
        self.row_slots = row_slots

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """``out [T, out_features] += delta`` of projection ``proj`` ("qkv", "o", "gate_up",
        "down") of ``layer`` for ``x [T, in_features]``, row by row."""
        self.slots.add_delta(out, x, layer, proj, self.row_slots)


class LoRAManager:
    """Registered adapters and their slots.

    Args:
        hf_config: the model's config (shapes the adapters must match).
        max_loras: slots (adapters one step may use).
        max_rank: the largest rank accepted (``--max-lora-rank``).
        device: where the slots live.
        model_name: the served model's name or path (an adapter trained on another is logged).
        dtype: the model's activation dtype (bfloat16: the slots hold bfloat16 factors; see
            :class:`LoRASlots`).
    """

    def __init__(
        self, hf_config, max_loras: int, max_rank: int, device: torch.device, model_name: str = "", dtype: torch.dtype = torch.float32
    ) -> None:
        self.spec = LoRAModelSpec.from_hf_config(hf_config)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.model_name = model_name
        self.adapters: dict[int, LoRAAdapter] = {}
        self._slots: Optional[LoRASlots] = None  # made at the first adapter's first step
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident adapter id -> slot, least recently used first

    def add(self, lora: LoRARequest) -> None:
        """Load and check ``lora`` (an id already held is replaced only when not resident).

        Raises:
            ValueError (``LoRAError``): the adapter is refused (files, rank, target modules, shapes).
        """
        adapter = load_peft_adapter(lora.lora_path, self.spec, self.max_rank)
        base = lora.base_model_name or adapter.base_model_name
        if base and self.model_name and base.rstrip("/").split("/")[-1] not in self.model_name:
            logger.info("LoRA adapter %r was trained on %r; its shapes fit the served model %r", lora.lora_name, base, self.model_name)
        self.remove(lora.lora_int_id)
        self.adapters[lora.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d) loaded: rank %d, %s, %.1f MiB", lora.lora_name, lora.lora_int_id, adapter.rank,
                    ",".join(sorted(adapter.target_modules)), adapter.num_bytes() / 2**20)  # fmt: skip

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter and free its slot (no-op for an unknown id)."""
        self.adapters.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None and self._slots is not None:
            self._slots.clear_slot(slot)

    def prepare_step(self, token_lora_ids: np.ndarray) -> Optional[LoRAStep]:
        """The mapping of one step: ``token_lora_ids`` int64 ``[num_tokens]`` (0 = base model).
        Makes the step's adapters resident; None when no token uses an adapter.

        Raises:
            KeyError: an id that is not registered (the core checks ids first).
            RuntimeError: more adapters than slots (the scheduler prevents it).
        """
        ids = np.unique(token_lora_ids)
        ids = ids[ids > 0]
        if ids.size == 0:
            return None
        if ids.size > self.max_loras:
            raise RuntimeError(f"a step uses {ids.size} LoRA adapters, more than max_loras={self.max_loras}")
        if self._slots is None:
            self._slots = LoRASlots(self.spec, self.max_loras, self.max_rank, self.device, self.dtype)
        needed = set(ids.tolist())
        for lid in needed:
            if lid in self.slot_of:
                self.slot_of.move_to_end(lid)
                continue
            adapter = self.adapters[lid]
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # evict the least recently used adapter this step does not need
                victim = next(v for v in self.slot_of if v not in needed)
                slot = self.slot_of.pop(victim)
            self._slots.set_slot(slot, adapter)
            self.slot_of[lid] = slot
        lut = {lid: self.slot_of[lid] for lid in needed}
        row_slots = np.full(token_lora_ids.shape, -1, dtype=np.int32)
        for lid, slot in lut.items():
            row_slots[token_lora_ids == lid] = slot
        return LoRAStep(self._slots, torch.from_numpy(row_slots).to(self.device))
