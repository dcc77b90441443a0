"""Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini (``model_type`` ``phi3``): the Llama layer
(:mod:`pagedserve.model.llama`) with fused checkpoint tensors, LongRoPE and partial rotary.

HF transformers' ``modeling_phi3`` differs from Llama in three ways, handled here:

* **Fused tensors.** The checkpoint holds ``self_attn.qkv_proj.weight`` (q, k, v rows) and
  ``mlp.gate_up_proj.weight`` (gate, up rows), already the layout of our fused modules. They
  are split into q/k/v and gate/up on the way in (:func:`split_fused`) so that Llama's loader,
  tensor parallelism's row sharding and quantized GGUF weights treat them as Llama's.
* **LongRoPE** (``rope_type`` ``longrope``, Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): HF
  divides each inverse frequency by ``short_factor`` while the sequence is at most
  ``original_max_position_embeddings`` long and by ``long_factor`` beyond it, re-rotating every
  key at the switch; cos/sin are scaled by ``attention_factor`` (default
  ``sqrt(1 + ln(max_pos / original_max) / ln(original_max))``) either way. A paged cache cannot
  re-rotate cached keys, so the factors are chosen once per engine, as llama.cpp does with its
  context size: **long factors for every position when the model is built for more than
  ``original_max_position_embeddings`` tokens** (``max_model_len``, default the config's
  ``max_position_embeddings``), else short ones. With short factors the output equals HF's for
  sequences up to the original length; with long ones it equals HF forced onto its long factors.
* **Partial rotary** (``partial_rotary_factor``, Phi-4-mini 0.75): RoPE on the first
  ``rotary_dim`` dims of each q/k head (NeoX halves within them), the rest passed through. The
  backends rotate whole heads (NeoX halves of ``head_dim``), so at load the q and k rows of each
  head are permuted (:func:`rotary_permutation`) to put HF's rotary pair ``(i, i + R/2)`` at
  ``(i, i + D/2)`` and the pass-through dims in the remaining slots, whose cos/sin are 1/0
  (:class:`Phi3RotaryEmbedding`). Attention scores are dot products over a head, unchanged by a
  permutation shared by q and k; v is not permuted, so the output is HF's. Every backend path
  (the fused C RoPE, the one-call C step) then runs the exact math. The KV cache holds keys in
  the permuted order (only this model reads it).

Also: ``sliding_window`` (Phi-3-mini-4k: 2047) is applied as HF's mask does; a window at least as
long as the model's context changes nothing and is dropped so the C kernels can run. Dropout
fields (``resid_pdrop`` ...) are ignored (inference). Phi-3-small (``phi3small``) and
Phi-3.5-MoE (``phimoe``) are other model types, not served. LoRA adapters are refused (their
targets are the fused modules).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedserve.model.file_headers import GGUFHeader, ModelFileError, _is_int, short
from pagedserve.model.layers import RotaryEmbedding
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.ops.quantized import QuantizedWeight


def rope_parameters(config) -> dict:
    """The config's RoPE parameters (transformers 5 ``rope_parameters``, older ``rope_scaling``
    plus top-level ``rope_theta``/``partial_rotary_factor``) as one dict."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):  # Phi3Config's old names for longrope
        params["rope_type"] = "longrope"
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def head_dims(config) -> tuple[int, int]:
    """``(head_dim, rotary_dim)`` of the config: ``rotary_dim = int(head_dim *
    partial_rotary_factor)`` as HF computes it.

    Raises:
        ValueError: a rotary_dim that is not positive and even or whose pass-through part is odd
            (the permutation needs both halves equal).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = float(rope_parameters(config)["partial_rotary_factor"])
    rotary_dim = int(head_dim * factor)
    if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0 and (head_dim - rotary_dim) % 2 == 0):
        raise ValueError(
            f"partial_rotary_factor={factor} gives rotary_dim={rotary_dim} of head_dim={head_dim}: need an even rotary_dim and an even rest"
        )
    return head_dim, rotary_dim


def rope_inv_freq(config, max_positions: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2] float32, attention_factor)`` for a model built for
    ``max_positions`` tokens: HF's ``_compute_longrope_parameters`` (long factors when
    ``max_positions > original_max_position_embeddings``, see the module docstring) or
    default RoPE over ``rotary_dim``."""
    params = rope_parameters(config)
    head_dim, rotary_dim = head_dims(config)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if params["rope_type"] == "default":
        return 1.0 / (base**exponents), 1.0
    if params["rope_type"] != "longrope":
        raise ValueError(f"phi3 rope_type {params['rope_type']!r} is not supported (default or longrope)")
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    original = int(original or config.max_position_embeddings)
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = params["long_factor"] if max_positions > original else params["short_factor"]
    if len(ext) != rotary_dim // 2:
        raise ValueError(f"phi3 rope factors have {len(ext)} entries, rotary_dim {rotary_dim} needs {rotary_dim // 2}")
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponents), float(attention_factor)


# llama.cpp's LongRoPE factor tensors (long, short): config, not weights (gguf_names.GGUF_CONFIG_TENSORS)
GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3RotaryEmbedding(RotaryEmbedding):
    """RoPE tables ``cos_cache``/``sin_cache [max_positions, head_dim]`` float32 for the
    permuted head layout (module docstring): slots ``[0, R/2)`` and ``[D/2, D/2 + R/2)`` hold
    HF's rotary frequencies (times ``attention_factor``), the rest cos 1 / sin 0 (pass-through)."""

    def __init__(self, config, max_positions: int) -> None:
        nn.Module.__init__(self)
        head_dim, rotary_dim = head_dims(config)
        with torch.device("cpu"):  # real tables even when the model is built on meta
            inv_freq, scaling = rope_inv_freq(config, max_positions)
            t = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = torch.outer(t, inv_freq.float())
            pad = torch.zeros(max_positions, (head_dim - rotary_dim) // 2)
            cos = torch.cat((freqs.cos() * scaling, pad + 1.0), dim=-1)
            sin = torch.cat((freqs.sin() * scaling, pad), dim=-1)
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_cache", torch.cat((sin, sin), dim=-1), persistent=False)


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """``perm [head_dim]`` int64: our slot ``j`` of a q/k head holds HF's dim ``perm[j]``
    (identity for full rotary). HF's first rotary half goes to ``[0, R/2)``, the second to
    ``[D/2, D/2 + R/2)``, the pass-through dims' halves after each."""
    r2, p2 = rotary_dim // 2, (head_dim - rotary_dim) // 2

    def ar(*args: int) -> torch.Tensor:
        return torch.arange(*args, device="cpu")

    return torch.cat((ar(r2), ar(rotary_dim, rotary_dim + p2), ar(r2, rotary_dim), ar(rotary_dim + p2, head_dim)))


def _rows(t: Any, index: Any) -> Any:
    """Rows ``index`` (a slice or an index tensor) of a float tensor or a QuantizedWeight (whose
    rows are quantized independently: blocks run along the input dimension)."""
    if not isinstance(t, QuantizedWeight):
        return t[index]
    mins = None if t.mins is None else t.mins[index].contiguous()
    return QuantizedWeight(t.qdata[index].contiguous(), t.scales[index].contiguous(), mins, t.bits, t.group, t.qtype)


def split_fused(weights: Iterable[tuple[str, Any]], config) -> Iterator[tuple[str, Any]]:
    """The checkpoint's ``qkv_proj`` / ``gate_up_proj`` tensors as Llama's ``q_proj``,
    ``k_proj``, ``v_proj`` / ``gate_proj``, ``up_proj`` (rows in HF's order); other tensors
    unchanged. Used before tensor-parallel sharding and by :meth:`Phi3ForCausalLM.load_weights`.

    Raises:
        ValueError: a fused tensor whose rows differ from the config's.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    q, kv, inter = config.num_attention_heads * head_dim, kv_heads * head_dim, config.intermediate_size
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    for name, t in weights:
        prefix, _, leaf = name.rpartition(".")
        module = prefix.rpartition(".")
        if module[2] == "qkv_proj":
            names, sizes = ("q_proj", "k_proj", "v_proj"), (q, kv, kv)
        elif module[2] == "gate_up_proj":
            names, sizes = ("gate_proj", "up_proj"), (inter, inter)
        else:
            yield name, t
            continue
        rows = t.out_features if isinstance(t, QuantizedWeight) else t.shape[0]
        if rows != sum(sizes):
            raise ValueError(f"weight {name!r} has {rows} rows, expected {sum(sizes)} (config: {' + '.join(map(str, sizes))})")
        lo = 0
        for part, size in zip(names, sizes):
            yield f"{module[0]}.{part}.{leaf}", _rows(t, slice(lo, lo + size))
            lo += size


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 family causal LM: :class:`~pagedserve.model.llama.LlamaForCausalLM` with the
    loading and RoPE of the module docstring. Same arguments and surface.

    Raises:
        ValueError: a config whose RoPE cannot be served (rope_type other than default/longrope,
            factor lists of the wrong length, an odd rotary split).
    """

    supports_lora = False  # the worker refuses enable_lora for this class
    rotary_embedding = Phi3RotaryEmbedding  # built in __init__ and by the worker after loading

    def __init__(self, config, max_positions: int, tp=None) -> None:
        super().__init__(config, max_positions, tp)
        head_dim, rotary_dim = head_dims(config)
        self._perm: Optional[torch.Tensor] = None if rotary_dim == head_dim else rotary_permutation(head_dim, rotary_dim)
        for layer in self.layers:  # a window no sequence can exceed is no window (C kernels stay usable)
            attn: Any = layer.self_attn
            if attn.sliding_window is not None and attn.sliding_window >= max_positions:
                attn.sliding_window = None

    def _permute_heads(self, t: Any) -> Any:
        """q or k rows ``[heads * head_dim, ...]`` with each head's rows in our slot order."""
        if self._perm is None:
            return t
        head_dim = self._perm.numel()
        rows = t.out_features if isinstance(t, QuantizedWeight) else t.shape[0]
        index = (torch.arange(0, rows, head_dim, device="cpu")[:, None] + self._perm[None, :]).reshape(-1)
        return _rows(t, index)

    def load_weights(self, weights) -> None:
        """Load HF-named ``(name, tensor)`` pairs: fused tensors split (:func:`split_fused`), q/k
        rows permuted for partial rotary, then Llama's loader (same errors: unknown names,
        shapes, missing weights raise ValueError)."""

        def stream() -> Iterator[tuple[str, Any]]:
            for name, t in split_fused(weights, self.config):
                if name.rsplit(".", 2)[-2:-1] in (["q_proj"], ["k_proj"]):
                    t = self._permute_heads(t)
                yield name, t

        super().load_weights(stream())


def gguf_config(config, header: GGUFHeader, path: str) -> None:
    """What transformers' GGUF reader leaves out of a phi3 config, as llama.cpp's converter
    (``Phi3MiniModel``) writes it: partial rotary (``phi3.rope.dimension_count`` of the head),
    LongRoPE (the ``rope_factors_long``/``rope_factors_short`` tensors,
    ``phi3.rope.scaling.original_context_length``, ``phi3.rope.scaling.attn_factor`` where it
    is not HF's default), the sliding window (``phi3.attention.sliding_window``, 0: none).

    Raises:
        ModelFileError: a dimension count or factor list that does not fit the heads.
    """
    import gguf
    import numpy as np

    md = header.metadata
    head_dim = config.hidden_size // config.num_attention_heads
    rope_dims: Any = md.get("phi3.rope.dimension_count", head_dim)
    if not (_is_int(rope_dims) and 0 < rope_dims <= head_dim and rope_dims % 2 == 0):
        raise ModelFileError(path, f"GGUF metadata phi3.rope.dimension_count={short(rope_dims)} is not an even number in [2, {head_dim}]")
    old = dict(getattr(config, "rope_parameters", None) or {})
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(old.get("rope_theta", getattr(config, "rope_theta", 10000.0)))}
    params["partial_rotary_factor"] = rope_dims / head_dim
    names = GGUF_ROPE_FACTORS
    factors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1).tolist() for t in gguf.GGUFReader(path).tensors if t.name in names}
    if factors:
        original: Any = md.get("phi3.rope.scaling.original_context_length")
        if not (_is_int(original) and original >= 1) or set(factors) != set(names) or any(len(f) != rope_dims // 2 for f in factors.values()):
            raise ModelFileError(
                path, f"phi3 LongRoPE needs both {' and '.join(names)} of {rope_dims // 2} values and rope.scaling.original_context_length"
            )
        params.update(rope_type="longrope", long_factor=factors[names[0]], short_factor=factors[names[1]], original_max_position_embeddings=original)
        config.original_max_position_embeddings = original = int(original)
        scale = config.max_position_embeddings / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        attn = md.get("phi3.rope.scaling.attn_factor")
        if isinstance(attn, (int, float)) and abs(attn - default) > 1e-6 * default:  # not just the default rounded to float32
            params["attention_factor"] = float(attn)
    config.rope_parameters = params
    window = md.get("phi3.attention.sliding_window")
    config.sliding_window = window if isinstance(window, int) and window > 0 else None
