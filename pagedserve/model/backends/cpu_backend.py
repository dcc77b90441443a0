"""The CPU-kernel backend: the PyTorch backend's ops replaced by the C kernels of
:mod:`pagedserve.ops.cpu` where they are faster, with the same results a row at a time.

- residual add + RMSNorm and SiLU-and-mul: fused C ops (HF's rounding order);
- decode attention: the paged C kernel, which reads K/V in place through the block tables, one
  query token at a time, so a row's result does not depend on what else is in the batch (from
  a bf16/float32 cache or the int8 one of :mod:`pagedserve.ops.kv_int8`);
- on the kernel's vectorised bf16 path (``prefill_kernel_preferred``) also RoPE + the KV-cache
  write in one C pass and prefill attention in the kernel (every K/V read from the cache);
  elsewhere (float32, other shapes) PyTorch RoPE and SDPA prefill, which are faster there;
- every step in bf16 (decodes, prefill chunks or both) when every projection has the AMX or
  the AVX2 matmul or a small-M plan: the whole model in one C call
  (``csrc/step/decode_step.c``, the same ops in the same order, bit-identical to the
  layer-by-layer path);
- greedy sampling's argmax over bf16 logits in C.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedserve import platform
from pagedserve.model.attn_metadata import AttentionMetadata
from pagedserve.model.backends.torch_backend import TorchBackend, sdpa_attention
from pagedserve.model.layers import RMSNorm, RotaryEmbedding
from pagedserve.model.packed_linear import PackedLinear
from pagedserve.model.sampler import torch_argmax
from pagedserve.ops.cpu import kernels, matmul
from pagedserve.ops.cpu.build import get_decode_lib, get_fused_lib, get_lib


def _check_range(name: str, values: torch.Tensor, limit: int) -> None:
    """Raise IndexError unless every value is in ``[0, limit)`` (the C ops index unchecked)."""
    if values.numel():
        lo, hi = torch.aminmax(values)
        if int(lo) < 0 or int(hi) >= limit:
            raise IndexError(f"{name} out of range [0, {limit}): min {int(lo)}, max {int(hi)}")


def cpu_kernels_usable(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the C kernels handle this model: compiled libraries (``PAGEDSERVE_CPU_KERNELS``
    not 0), float32 or bfloat16, hidden size and head_dim within the kernels' bounds, GQA group
    of at most 16."""
    return (
        platform.switch_on("PAGEDSERVE_CPU_KERNELS")
        and dtype in (torch.float32, torch.bfloat16)
        and hidden_size <= 16384
        and head_dim <= 256
        and head_dim % 2 == 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 16
        and get_fused_lib() is not None
        and get_lib() is not None
    )


# Steps with prefill tokens take the one-call C step up to this many tokens. Measured on a Zen 4
# (AVX512-BF16, small-M kernel; `pagedserve bench kernels --op step`), SmolLM2-135M, C step against the
# layer-by-layer path: 1.25x at 64 + 8 decodes, 1.11x at 232 + 24, 1.07x at 512, 0.98x at 1,024
# and 0.92x at 2,048 prompt tokens.
C_STEP_MAX_PREFILL_ROWS = 512
# ... and only where no small-M projection is wider than this (inputs): the 1.1B model's down
# projection (K = 8,192; 64 rows of it fill a 1 MiB L2) ran 0.97-0.98x at 256-512 tokens.
C_STEP_SMALL_GEMM_MAX_K = 4096
# Wider models still take it up to this many tokens: the 1.1B model 1.03-1.06x at 48 + 8 and
# 96 + 16 decodes (the chunks ``--max-step-ms`` gives it), 0.95-0.98x at 160-240 + 16.
C_STEP_WIDE_MAX_PREFILL_ROWS = 128


class CpuBackend(TorchBackend):
    """C kernels for one model on the CPU (built after ``cpu_kernels_usable`` said yes)."""

    name = "cpu-kernels"

    def __init__(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.fused_rope = kernels.prefill_kernel_preferred(dtype, num_heads, num_kv_heads, head_dim)
        self._decode_table_cache: Optional[tuple] = None
        self._prefill_max_rows = 0  # steps with prefill tokens take the C step up to this many tokens

    def begin_forward(self, model: Any, positions: torch.Tensor, metadata: AttentionMetadata, kv_caches: list, dtype: torch.dtype) -> Any:
        if not self.fused_rope:
            return super().begin_forward(model, positions, metadata, kv_caches, dtype)
        _check_range("positions", positions, model.rotary_emb.cos_cache.shape[0])
        _check_range("slot_mapping", metadata.slot_mapping, kv_caches[0].shape[1] * metadata.block_size)
        return None

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.add_rms_norm(x, residual, norm.weight, norm.eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_mul(gate_up)

    def rope_and_write_kv(self, qk, v, positions, state, rope: RotaryEmbedding, kv_cache, metadata, num_heads, num_kv_heads, head_dim):
        if not self.fused_rope:
            return super().rope_and_write_kv(qk, v, positions, state, rope, kv_cache, metadata, num_heads, num_kv_heads, head_dim)
        q = kernels.rope_write_kv(qk, v, positions, metadata.slot_mapping, rope.cos_cache, rope.sin_cache, kv_cache, num_heads, metadata.block_size)
        return q, None, None

    def attention(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float, window=None, softcap=None) -> torch.Tensor:
        out = torch.empty_like(query)
        for g in metadata.groups:
            # the kernel takes sliding windows (it reads only the window's keys) and Gemma 2's
            # logit softcap
            if not (g.is_decode or self.fused_rope):
                sdpa_attention(query, key, value, kv_cache, metadata, g, scale, out, window, softcap)
                continue
            s, e = g.token_start, g.token_end
            lens = g.seq_lens if g.is_decode else g.token_lens
            if not kernels.paged_attention_cpu(
                query[s:e], kv_cache, g.block_tables, g.token_seq, lens, scale, out[s:e], metadata.block_size, window or 0, softcap or 0.0
            ):
                raise RuntimeError("the CPU attention kernel refused the tensors of a step it was chosen for")
        return out

    @staticmethod
    def argmax(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1:
            return kernels.argmax_bf16(x)
        return torch_argmax(x)

    # -- the whole step in one C call -------------------------------------------------------
    def decode_step(self, model: Any, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list, metadata: AttentionMetadata) -> bool:
        """Every layer of a step (decodes, prefill chunks or both) in one C call, overwriting
        ``hidden [M, hidden_size]`` with the final normed states. Returns False, having done
        nothing, when the step or the model does not qualify: bf16, the attention kernel's fast
        path, no q/k norm, every projection with the AMX or AVX2 matmul or a small-M plan
        (``pack_for_cpu``); with prefill tokens, at most ``_prefill_max_rows`` tokens
        (:data:`C_STEP_MAX_PREFILL_ROWS`, or 0 where a small-M projection is wider than
        :data:`C_STEP_SMALL_GEMM_MAX_K`)."""
        groups = metadata.groups
        if hidden.dtype != torch.bfloat16 or not groups:
            return False
        table = self._decode_table(model, kv_caches)
        if table is None:
            return False
        decode_only = len(groups) == 1 and groups[0].is_decode
        if not decode_only and hidden.shape[0] > self._prefill_max_rows:
            return False
        attn = model.layers[0].self_attn
        _check_range("positions", positions, model.rotary_emb.cos_cache.shape[0])
        _check_range("slot_mapping", metadata.slot_mapping, kv_caches[0].shape[1] * metadata.block_size)
        if decode_only:
            block_tables, token_seq, token_lens = groups[0].block_tables, None, groups[0].seq_lens
        else:
            block_tables, token_seq, token_lens = _one_group(groups, hidden.shape[0])
        rc = matmul.decode_layers(
            table,
            hidden,
            model.norm.weight,
            positions,
            metadata.slot_mapping,
            model.rotary_emb.cos_cache,
            model.rotary_emb.sin_cache,
            block_tables,
            token_lens,
            token_seq=token_seq,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            inter=model.config.intermediate_size,
            block_size=metadata.block_size,
            eps=model.norm.eps,
            scale=attn.scale,
            kv_int8=kv_caches[0].dtype == torch.int8,
        )
        if rc != 0:
            raise RuntimeError(f"decode_layers_bf16 failed with code {rc}")
        return True

    def _decode_table(self, model: Any, kv_caches: list) -> Optional[torch.Tensor]:
        """``[num_layers, entries]`` int64 addresses and plans for ``decode_layers`` (built once
        per KV cache), or None when the model does not qualify."""
        # The runner passes the same list every step; a new list (or cache) rebuilds the table.
        key = (id(kv_caches), len(kv_caches), kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        cached = self._decode_table_cache
        if cached is not None and cached[0] == key and cached[2] is kv_caches:
            return cached[1]
        table = None
        attn = model.layers[0].self_attn
        eps = model.norm.eps
        ok = (
            self.fused_rope
            and getattr(model, "c_step_ok", True)  # a family whose layer is not Llama's (Gemma) says False
            and model.tp is None  # the C step has no all-reduce between layers
            and getattr(model, "c_step_ok", True)  # exactly the Llama layer (a family says False)
            and model._logits_linear is not None
            and not attn.qk_norm
            and all(layer.self_attn.sliding_window is None for layer in model.layers)
            and platform.switch_on("PAGEDSERVE_CPU_KERNELS")
            and get_decode_lib() is not None
            and all(kv.is_contiguous() and kv.dtype == kv_caches[0].dtype for kv in kv_caches)
            and kv_caches[0].dtype in (torch.bfloat16, torch.int8)
            and all(layer.input_layernorm.eps == eps and layer.post_attention_layernorm.eps == eps for layer in model.layers)
        )
        rows, widest_small = [], 0  # the widest input of a projection on the small-M kernel
        for layer, kv in zip(model.layers, kv_caches):
            if not ok:
                break
            entries = []
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                e = lin.decode_entries() if isinstance(lin, PackedLinear) else None
                if e is None:
                    ok = False
                    break
                entries += e
                if lin.amx_weight is None and lin.avx2_weight is None:
                    widest_small = max(widest_small, lin.in_features)
            if ok:
                entries += [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), *kernels._kv_pointers(kv)]
                rows.append(entries)
        if ok and rows and len(rows[0]) == matmul.decode_layer_entries():
            table = torch.tensor(rows, dtype=torch.int64)
            self._prefill_max_rows = C_STEP_MAX_PREFILL_ROWS if widest_small <= C_STEP_SMALL_GEMM_MAX_K else C_STEP_WIDE_MAX_PREFILL_ROWS
        self._decode_table_cache = (key, table, kv_caches)
        return table


def _one_group(groups: list, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's attention groups with prefill tokens (decodes, then prefill chunks, in the flat
    batch's order) as one: ``(block_tables [num_seqs, max_blocks], token_seq [num_tokens],
    token_lens [num_tokens])``, int64. Narrower tables are padded with block 0 (read by no token)."""
    width = max(g.block_tables.shape[1] for g in groups)
    tables, seqs, lens, first = [], [], [], 0
    for g in groups:
        bt = g.block_tables
        tables.append(bt if bt.shape[1] == width else torch.nn.functional.pad(bt, (0, width - bt.shape[1])))
        seqs.append(torch.arange(first, first + g.num_seqs, dtype=torch.int64) if g.is_decode else g.token_seq + first)
        lens.append(g.seq_lens if g.is_decode else g.token_lens)
        first += g.num_seqs
    token_seq, token_lens = torch.cat(seqs), torch.cat(lens)
    if token_seq.shape[0] != num_tokens:
        raise ValueError(f"the attention groups cover {token_seq.shape[0]} tokens, the step has {num_tokens}")
    return torch.cat(tables), token_seq, token_lens
