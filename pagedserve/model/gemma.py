"""Gemma 2 and Gemma 3 (text): the decoder of HF transformers' ``modeling_gemma2`` /
``modeling_gemma3`` over pagedserve's flat batch and paged KV cache.

What differs from the Llama family (:mod:`pagedserve.model.llama`), each as HF computes it:

- RMSNorm scales by ``1 + weight``, in float32, and casts after the scale
  (:class:`GemmaRMSNorm`); four norms per layer: before and after attention, before and after
  the MLP, each "after" norm applied to the branch before the residual add;
- GeGLU MLP: ``gelu_pytorch_tanh(gate) * up``;
- the embedding is multiplied by ``sqrt(hidden_size)`` (a tensor cast to the hidden dtype);
- attention scale ``query_pre_attn_scalar ** -0.5``; ``head_dim`` independent of hidden/heads;
- Gemma 2: attention-logit softcapping (``attn_logit_softcapping``, through the backend's
  ``softcap``) and final-logit softcapping (``final_logit_softcapping``, in
  :meth:`GemmaForCausalLM.compute_logits`);
- Gemma 3: Gemma RMSNorm on q and k (over ``head_dim``) before RoPE, and two RoPE tables: one
  for sliding (local) layers, one for full (global) layers (``rope_parameters`` per layer type,
  the global one possibly scaled);
- local/global layers: each layer's window from :func:`pagedserve.model.registry.layer_windows`.

Projections are fused as in Llama (qkv, gate/up) under Llama's module names, so the weight
loader, the CPU packing and the tensor-parallel sharding are Llama's. The CPU backend's fused C
ops assume Llama's norm and activation: this model calls only the backend's RoPE + KV write
(each layer with its own table) and attention, never its ``add_rms_norm`` / ``silu_and_mul``
nor its one-call C step (``c_step_ok = False``). LoRA is refused (``supports_lora = False``).
A multimodal ``gemma3`` checkpoint is served as its text model (``files.load_config`` returns
its ``text_config``; :meth:`GemmaForCausalLM.text_name` renames the weights).
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.attn_metadata import AttentionMetadata
from pagedserve.model.backends import TorchBackend
from pagedserve.model.layers import RotaryEmbedding
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.registry import layer_windows

logger = logging.getLogger(__name__)

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# Prefixes of a multimodal ``gemma3`` checkpoint's text weights (hub files, then what
# transformers 5 writes), mapped to the text model's names.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (HF ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``): ``x / rms(x) * (1 + w)``,
    all in float32, cast back to ``x``'s dtype last. ``x [..., dim]``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.qk_norm = config.model_type == "gemma3_text"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        # Gemma 3's attention ignores attn_logit_softcapping (HF never passes it on).
        softcap = getattr(config, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None
        self.softcap = float(softcap) if softcap else None
        self.layer_idx = layer_idx
        self.sliding_window = layer_windows(config)[layer_idx]  # tokens, None: full attention
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"

    def forward(
        self, hidden, positions, state, rope: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata, backend: TorchBackend
    ) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> ``[T, hidden_size]``; writes this step's K/V."""
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_end = self.q_size + self.kv_size
        qk = qkv[:, :qk_end]
        if self.qk_norm:
            q, k = qk.reshape(T, self.num_heads + self.num_kv_heads, self.head_dim).split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1).view(T, qk_end)
        q, k, v = backend.rope_and_write_kv(
            qk, qkv[:, qk_end:], positions, state, rope, kv_cache, meta, self.num_heads, self.num_kv_heads, self.head_dim
        )
        o = backend.attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(o.view(T, self.q_size))


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``, gate and up as one matmul."""

    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, hidden, positions, state, rope, kv_cache, meta, backend: TorchBackend) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> the layer's output (HF's op order)."""
        h = self.self_attn(self.input_layernorm(hidden), positions, state, rope, kv_cache, meta, backend)
        hidden = hidden + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(h)


class GemmaRotaryEmbedding(RotaryEmbedding):
    """The global (full-attention) layers' RoPE table, with the local (sliding) layers' one
    beside it as ``local`` (Gemma 3: ``rope_parameters`` per layer type, the global one possibly
    scaled); Gemma 2 has one table, ``local`` None. :meth:`for_local` is the local layers' table
    either way. The worker rebuilds it after the meta-device load (the class's
    ``rotary_embedding``)."""

    def __init__(self, config, max_positions: int) -> None:
        two = "full_attention" in (getattr(config, "rope_parameters", None) or {})
        super().__init__(config, max_positions, "full_attention" if two else None)
        self.local: Optional[RotaryEmbedding] = RotaryEmbedding(config, max_positions, "sliding_attention") if two else None

    def for_local(self) -> RotaryEmbedding:
        return self if self.local is None else self.local


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text causal LM over a flat token batch (the surface of
    :mod:`pagedserve.model.registry`).

    Args:
        config: a transformers ``Gemma2Config`` or ``Gemma3TextConfig``.
        max_positions: size of the RoPE tables (tokens), at least max_model_len.
        tp: this rank's tensor-parallel group, else None: the model is then shaped for its
            rank by ``pagedserve.distributed.tensor_parallel.shard_shapes`` as Llama is (the
            all-reduce hooks sit on ``self_attn`` and ``mlp``, before Gemma's post-norms; the
            norms, q/k norms included, are replicated).
    Attributes:
        rotary_emb: a :class:`GemmaRotaryEmbedding` (global table, local one beside it).
    Raises:
        ValueError: an unsupported model_type, bidirectional attention.
    """

    c_step_ok = False  # the CPU backend's one-call step runs Llama's layer only
    rotary_embedding = GemmaRotaryEmbedding  # the RoPE tables' class (the worker rebuilds them with it)
    supports_lora = False  # the worker refuses enable_lora at load

    def __init__(self, config, max_positions: int, tp=None) -> None:
        super().__init__()
        if config.model_type not in GEMMA_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not a Gemma 2/3 text config")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported")
        if "sliding_attention" in config.layer_types and not getattr(config, "sliding_window", None):
            raise ValueError(f"sliding_window={getattr(config, 'sliding_window', None)!r}: Gemma's local layers need a window of at least 1 token")
        self.config = config
        self.tp = tp
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self._sliding = [t == "sliding_attention" for t in config.layer_types]  # which RoPE table each layer reads
        self.rotary_emb = self.rotary_embedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        softcap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(softcap) if softcap else None
        self._logits_linear: Optional[nn.Module] = None  # set by pack_for_cpu, or by load_weights (quantized)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.backend: TorchBackend = TorchBackend()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        lora=None,
    ) -> torch.Tensor:
        """Final normed hidden states ``[num_tokens, hidden_size]`` of ``input_ids
        [num_tokens]`` at ``positions [num_tokens]``; writes their K/V into ``kv_caches``.

        Raises:
            ValueError: ``lora`` given (LoRA is not supported for Gemma).
        """
        if lora is not None:
            raise ValueError("LoRA adapters are not supported for Gemma models")
        backend = self.backend
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5).to(hidden.dtype)
        # The CPU backend's fused RoPE reads each layer's table itself (state None).
        state = backend.begin_forward(self, positions, attn_metadata, kv_caches, hidden.dtype)
        local_rope = self.rotary_emb.for_local()
        local_state = state
        if state is not None and local_rope is not self.rotary_emb:
            local_state = local_rope(positions, hidden.dtype)
        for layer, kv_cache, sliding in zip(self.layers, kv_caches, self._sliding):
            if sliding:
                hidden = layer(hidden, positions, local_state, local_rope, kv_cache, attn_metadata, backend)
            else:
                hidden = layer(hidden, positions, state, self.rotary_emb, kv_cache, attn_metadata, backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits ``[n, vocab_size]`` of hidden states ``[n, hidden_size]``, capped at
        ``final_logit_softcapping`` (Gemma 2: ``c * tanh(logits / c)``, HF's op order)."""
        logits = LlamaForCausalLM.compute_logits(self, hidden)  # type: ignore[arg-type]
        if logits is not None and self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits

    pack_for_cpu = LlamaForCausalLM.pack_for_cpu
    pack_logits = LlamaForCausalLM.pack_logits

    # -- weights ---------------------------------------------------------------------------
    _FUSED = LlamaForCausalLM._FUSED

    @staticmethod
    def text_name(name: str) -> Optional[str]:
        """A checkpoint name as the text model's (``model.layers.0...``): a multimodal
        ``gemma3`` checkpoint's text weights renamed, its vision weights None."""
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, to in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return to + name[len(prefix) :]
        return name

    @classmethod
    def module_of(cls, name: str) -> str:
        """The module path that holds HF weight ``name`` (see ``LlamaForCausalLM.module_of``)."""
        return LlamaForCausalLM.module_of.__func__(cls, cls.text_name(name) or name)  # type: ignore[attr-defined]

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Load ``(name, tensor)`` pairs named as in the HF checkpoint: Llama's loader (fused
        q/k/v and gate/up) after the multimodal renaming of :meth:`text_name`; vision weights
        are skipped (logged once).

        Raises:
            ValueError: an unknown name, a shape mismatch, a weight left unloaded.
        """
        LlamaForCausalLM.load_weights(self, self._text_weights(weights))  # type: ignore[arg-type]

    def _text_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        skipped = 0
        for name, tensor in weights:
            text = self.text_name(name)
            if text is None:
                skipped += 1
                continue
            yield text, tensor
        if skipped:
            logger.info("gemma3: skipped %d vision-tower / projector weights (text only is served)", skipped)
