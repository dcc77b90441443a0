"""Shard a Llama-family or Gemma model (the same module names) for rank ``r`` of ``N``
tensor-parallel ranks (Megatron-LM's layout, Shoeybi et al. 2019; the size of gpt-fast's
``tp.py``, applied while loading so that no rank ever holds the whole model):

- column-parallel: the fused ``qkv_proj`` keeps this rank's query heads and KV heads (and their
  bias rows), ``gate_up_proj`` this rank's share of the gate rows and of the up rows;
- row-parallel: ``o_proj`` and ``down_proj`` keep the matching input columns, their bias stays on
  rank 0 only, and a forward hook sums the partial outputs (one all-reduce after attention and
  one after the MLP);
- vocab-parallel embedding and LM head: each rank holds ``ceil(V / N)`` rows of the (tied or
  untied) vocabulary matrix, zero-padded at the end; a lookup is the local rows' embedding
  (zero for other ranks' ids) all-reduced; logits are the local columns gathered on rank 0.

Two steps: :func:`shard_shapes` on the model built on the meta device with its group (``tp=``):
per-rank shapes and head counts, so the KV cache each rank allocates holds its own KV heads only;
then :func:`shard_checkpoint` slices each checkpoint tensor as it streams into ``load_weights``.
Packing for oneDNN (``pack_for_cpu``) comes after, on the sharded weights.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import TPGroup
from pagedserve.ops.quantized import QuantizedWeight


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
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # MoE experts (moe.py)
        width = getattr(hf_config, field, None)
        if width and width % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's {field} ({width})")


def _resize(linear: nn.Linear, out_features: Optional[int] = None, in_features: Optional[int] = None, keep_bias: bool = True) -> None:
    """Give ``linear`` (on the meta device) a weight ``[out, in]`` and a bias only if ``keep_bias``."""
    out_features = out_features or linear.out_features
    in_features = in_features or linear.in_features
    w = linear.weight
    linear.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=w.dtype, device=w.device), requires_grad=False)
    b = linear.bias
    linear.bias = (
        nn.Parameter(torch.empty(out_features, dtype=b.dtype, device=b.device), requires_grad=False) if b is not None and keep_bias else None
    )
    linear.out_features, linear.in_features = out_features, in_features


def _all_reduce_hook(group: TPGroup):
    def hook(_module, _inputs, output):
        group.all_reduce(output)

    return hook


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * shard, (rank + 1) * shard)`` of a ``[vocab, hidden]`` embedding (zero rows
    past ``vocab``), ``shard = ceil(vocab / N)``. ``forward(ids [T]) -> [T, hidden]`` (all-reduced)."""

    def __init__(self, vocab: int, hidden: int, group: TPGroup) -> None:
        super().__init__()
        self.shard = -(-vocab // group.world_size)
        self.start = group.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)


def shard_shapes(model: nn.Module) -> None:
    """Give ``model`` (a :class:`pagedserve.model.llama.LlamaForCausalLM` just built on the meta
    device with ``tp=group``) rank ``group.rank``'s parameter shapes and head counts and the
    all-reduce hooks. Load it with :func:`shard_checkpoint`'s tensors.

    Raises:
        ValueError: the model was built without a group, or the head counts or MLP width do not
            divide by the group size.
    """
    group: Optional[TPGroup] = model.tp
    if group is None:
        raise ValueError("shard_shapes needs a model built with its tensor-parallel group (tp=...)")
    n, keep_row_bias = group.world_size, group.rank == 0
    verify_tp_size(model.config, n)
    for layer in model.layers:
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = attn.num_heads // n, attn.num_kv_heads // n
        attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        _resize(attn.qkv_proj, out_features=attn.q_size + 2 * attn.kv_size)
        _resize(attn.o_proj, in_features=attn.q_size, keep_bias=keep_row_bias)
        attn.register_forward_hook(_all_reduce_hook(group))
        mlp = layer.mlp
        # An MoE block (moe.py): each expert (and the shared expert) split like an MLP, the
        # router replicated, one all-reduce after the block.
        mlps = [mlp]
        if hasattr(mlp, "experts"):
            mlps = list(mlp.experts) + ([mlp.shared_expert] if mlp.shared_expert is not None else [])
        for part in mlps:
            part.intermediate_size //= n
            _resize(part.gate_up_proj, out_features=2 * part.intermediate_size)
            _resize(part.down_proj, in_features=part.intermediate_size, keep_bias=keep_row_bias)
        mlp.register_forward_hook(_all_reduce_hook(group))
    vocab, hidden = model.embed_tokens.weight.shape
    model.embed_tokens = VocabParallelEmbedding(vocab, hidden, group)
    if not model.tie_word_embeddings:
        _resize(model.lm_head, out_features=model.embed_tokens.shard)


def _shard_quantized(name: str, t: QuantizedWeight, module: str, r: int, rows: dict, cols: dict, shard: int) -> QuantizedWeight:
    """Rank ``r``'s slice of a quantized weight, cut before it is used (the quantization groups
    run along the inputs, so a column cut must fall on a group boundary).

    Raises:
        ValueError: a column cut inside a quantization group.
    """
    if module in rows:
        return t.rows(r * rows[module], (r + 1) * rows[module])
    if module in cols:
        try:
            return t.cols(r * cols[module], (r + 1) * cols[module])
        except ValueError as e:
            raise ValueError(f"{name}: this tensor-parallel size splits a quantization group ({e})") from None
    if module in ("embed_tokens", "lm_head"):
        return t.rows(r * shard, min((r + 1) * shard, t.out_features)).padded_rows(shard)
    return t


def shard_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], hf_config, group: TPGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``group.rank``'s slice of each ``(HF name, tensor)`` of a checkpoint, for a model
    shaped by :func:`shard_shapes`: q/k/v and gate/up rows, o/down columns (their bias on rank 0
    only), embedding / LM head rows zero-padded to the shard size; other tensors whole."""
    n, r = group.world_size, group.rank
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    q_rows, kv_rows, part = heads * head_dim // n, kv_heads * head_dim // n, hf_config.intermediate_size // n
    shard = -(-hf_config.vocab_size // n)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": part, "up_proj": part}
    cols = {"o_proj": q_rows, "down_proj": part}
    if hf_config.model_type == "phi3":  # fused qkv / gate_up tensors: shard each part
        from pagedserve.model.phi3 import split_fused

        weights = split_fused(weights, hf_config)
    moe_rules = _moe_rules(hf_config, n)
    if moe_rules:  # every expert under its own name (Mixtral's w1/w3/w2, 3-D and GGUF stacks split)
        from pagedserve.model.moe import canonical_weights, num_experts

        weights = canonical_weights(weights, num_experts(hf_config))
    for name, t in weights:
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        moe = next((rule for key, rule in moe_rules.items() if key in parts), None)
        t_rows, t_cols = moe if moe is not None else (rows, cols)
        if isinstance(t, QuantizedWeight):
            yield name, _shard_quantized(name, t, module, r, t_rows, t_cols, shard)
            continue
        if module in t_rows:
            t = t[r * t_rows[module] : (r + 1) * t_rows[module]]
        elif module in t_cols:
            if kind == "bias":
                if r != 0:
                    continue
            else:
                t = t[:, r * t_cols[module] : (r + 1) * t_cols[module]]
        elif module in ("embed_tokens", "lm_head"):
            local = t[r * shard : (r + 1) * shard]
            t = torch.zeros(shard, t.shape[1], dtype=t.dtype)
            t[: local.shape[0]] = local
        yield name, t


def _moe_rules(hf_config, n: int) -> dict[str, tuple[dict, dict]]:
    """Name part -> (row rules, column rules) for an MoE checkpoint's experts and Qwen2-MoE's
    shared expert (their own widths: ``moe_intermediate_size``, Mixtral's ``intermediate_size``,
    ``shared_expert_intermediate_size``); empty for other models."""
    if hf_config.model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    widths = {"experts": hf_config.intermediate_size if hf_config.model_type == "mixtral" else hf_config.moe_intermediate_size}
    if getattr(hf_config, "shared_expert_intermediate_size", None):
        widths["shared_expert"] = hf_config.shared_expert_intermediate_size
    return {key: ({"gate_proj": w // n, "up_proj": w // n}, {"down_proj": w // n}) for key, w in widths.items()}
