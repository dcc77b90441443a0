"""Building blocks of the Llama family shared by the model and its backends: RMSNorm and RoPE,
computed as HF transformers computes them."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) computed in float32 like HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., RoFormer 2021), NeoX-style halves as in HF. ``inv_freq`` and the
    attention scaling come from transformers' ``ROPE_INIT_FUNCTIONS`` for the config's
    ``rope_type`` (default, linear, llama3, yarn, ...), so scaled checkpoints match HF.
    ``layer_type``: the table of one kind of layer where the config's ``rope_parameters`` are
    per layer type (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``)."""

    def __init__(self, config, max_positions: int, layer_type: Optional[str] = None) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_params = getattr(config, "rope_parameters", None) or {}
        if layer_type is not None:
            rope_params = rope_params[layer_type]
        rope_type = rope_params.get("rope_type", "default")
        # Tables are computed on the CPU even when the model is built under
        # ``torch.device("meta")``: transformers' init functions for scaled RoPE (llama3, yarn,
        # ...) copy an arange to "cpu", which fails on meta tensors.
        with torch.device("cpu"):
            if rope_type == "default":
                head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                base = rope_params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
                inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
                scaling = 1.0
            else:
                kw = {} if layer_type is None else {"layer_type": layer_type}
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kw)
            t = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = torch.outer(t, inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions [num_tokens]``: each ``[num_tokens, 1, head_dim]``."""
        return self.cos_cache[positions].to(dtype)[:, None, :], self.sin_cache[positions].to(dtype)[:, None, :]
