"""Shard a loaded Llama-family model for rank ``r`` of ``N`` tensor-parallel ranks (Megatron-LM's
layout, Shoeybi et al. 2019; the after-loading shape of gpt-fast's ``tp.py``).

- column-parallel: the fused ``qkv_proj`` keeps this rank's query heads and KV heads (and their
  bias rows), ``gate_up_proj`` this rank's share of the gate rows and of the up rows;
- row-parallel: ``o_proj`` and ``down_proj`` keep the matching input columns, their bias stays on
  rank 0 only, and a forward hook sums the partial outputs (one all-reduce after attention and
  one after the MLP);
- vocab-parallel embedding and LM head: each rank holds ``ceil(V / N)`` rows of the (tied or
  untied) vocabulary matrix, zero-padded at the end; a lookup is the local rows' embedding
  (zero for other ranks' ids) all-reduced; logits are the local columns gathered on rank 0.

The attention modules' head counts become the per-rank counts, so the KV cache each rank
allocates holds its own KV heads only. Call it after ``load_weights`` and the dtype cast and
before ``pack_for_cpu`` (packing reads the sharded weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import TPGroup


def verify_tp_size(hf_config, tp_size: int) -> None:
    """Raises ValueError unless ``tp_size`` divides the model's query heads, KV heads and MLP
    width (KV heads are sharded, never replicated)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size!r}")
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's {heads} query heads and {kv_heads} KV heads "
            f"(possible sizes: {[n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0 and inter % n == 0]})"
        )
    if inter % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's intermediate_size ({inter})")


def _rows(w: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([w[a:b] for a, b in spans], dim=0).contiguous()


def _set(linear: nn.Linear, weight: torch.Tensor, bias) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.bias = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape


def _all_reduce_hook(group: TPGroup):
    def hook(_module, _inputs, output):
        group.all_reduce(output)

    return hook


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * shard, (rank + 1) * shard)`` of a ``[vocab, hidden]`` embedding, zero-padded
    to ``shard = ceil(vocab / N)`` rows. ``forward(ids [T]) -> [T, hidden]`` (all-reduced)."""

    def __init__(self, full_weight: torch.Tensor, group: TPGroup) -> None:
        super().__init__()
        vocab, hidden = full_weight.shape
        n, r = group.world_size, group.rank
        self.shard = -(-vocab // n)
        self.start = r * self.shard
        local = full_weight[self.start : min(vocab, self.start + self.shard)]
        weight = torch.zeros(self.shard, hidden, dtype=full_weight.dtype, device=full_weight.device)
        weight[: local.shape[0]] = local
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)


def shard_model(model: nn.Module, group: TPGroup) -> None:
    """Shard ``model`` (a loaded :class:`pagedserve.model.llama.LlamaForCausalLM`) in place for
    ``group.rank`` of ``group.world_size``; sets ``model.tp = group``.

    Raises:
        ValueError: the head counts or MLP width do not divide by the group size.
    """
    n, r = group.world_size, group.rank
    verify_tp_size(model.config, n)
    for layer in model.layers:
        attn = layer.self_attn
        hd = attn.head_dim
        qs, ks = attn.q_size // n, attn.kv_size // n
        spans = [(r * qs, (r + 1) * qs), (attn.q_size + r * ks, attn.q_size + (r + 1) * ks),
                 (attn.q_size + attn.kv_size + r * ks, attn.q_size + attn.kv_size + (r + 1) * ks)]
        qkv = attn.qkv_proj
        _set(qkv, _rows(qkv.weight.data, spans), None if qkv.bias is None else _rows(qkv.bias.data, spans))
        o = attn.o_proj
        _set(o, o.weight.data[:, r * qs : (r + 1) * qs].contiguous(), o.bias.data if o.bias is not None and r == 0 else None)
        attn.num_heads, attn.num_kv_heads = attn.num_heads // n, attn.num_kv_heads // n
        attn.q_size, attn.kv_size = attn.num_heads * hd, attn.num_kv_heads * hd
        attn.register_forward_hook(_all_reduce_hook(group))

        mlp = layer.mlp
        inter, part = mlp.intermediate_size, mlp.intermediate_size // n
        spans = [(r * part, (r + 1) * part), (inter + r * part, inter + (r + 1) * part)]
        gu = mlp.gate_up_proj
        _set(gu, _rows(gu.weight.data, spans), None if gu.bias is None else _rows(gu.bias.data, spans))
        down = mlp.down_proj
        _set(down, down.weight.data[:, r * part : (r + 1) * part].contiguous(),
             down.bias.data if down.bias is not None and r == 0 else None)
        mlp.intermediate_size = part
        mlp.register_forward_hook(_all_reduce_hook(group))

    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight.data, group)
    if not model.tie_word_embeddings:
        head = VocabParallelEmbedding(model.lm_head.weight.data, group)  # only its rows are used
        _set(model.lm_head, head.weight.data, None)
    model.tp = group
