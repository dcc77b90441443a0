"""One decoder implementation for the Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3
(q/k RMSNorm), tied or untied embeddings, GQA, RoPE with the checkpoint's theta and scaling.

The math follows HF transformers' ``modeling_llama`` / ``modeling_qwen2`` / ``modeling_qwen3``
(same op order and dtypes, so float32 greedy output matches token for token). Differences are
in layout only: the batch is flat (``[num_tokens, hidden]``, no padding between requests), Q/K/V
and gate/up projections are fused into one matmul each, attention is paged, and the residual is
carried between layers beside the hidden states (vLLM's layout: each layer starts with
"residual add + RMSNorm"). Every op that is not a projection goes through the model's backend
(``pagedserve.model.backends``), chosen once at load time: PyTorch or the CPU C kernels.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.attn_metadata import AttentionMetadata
from pagedserve.model.backends import TorchBackend
from pagedserve.model.layers import RMSNorm, RotaryEmbedding
from pagedserve.model.packed_linear import PackedLinear, attach_small_gemm, pack_linears
from pagedserve.model.quant_linear import QuantEmbedding, QuantLinear
from pagedserve.model.registry import layer_windows
from pagedserve.model.validation import SUPPORTED_MODEL_TYPES
from pagedserve.ops.quantized import QuantizedWeight, cat_rows


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2" or bool(getattr(config, "qkv_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)))
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.sliding_window = layer_windows(config)[layer_idx]  # tokens, None: full attention

    def forward(
        self, hidden, positions, state, rope: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata, backend: TorchBackend, lora=None
    ) -> torch.Tensor:
        """``hidden [T, hidden_size]`` -> ``[T, hidden_size]``; writes this step's K/V. ``lora``:
        the step's LoRA rows (``pagedserve.worker.lora_manager.LoRAStep``) or None."""
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.add(qkv, hidden, self.layer_idx, "qkv")
        qk_end = self.q_size + self.kv_size
        qk = qkv[:, :qk_end]
        if self.qk_norm:
            q, k = qk.reshape(T, self.num_heads + self.num_kv_heads, self.head_dim).split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1).view(T, qk_end)
        q, k, v = backend.rope_and_write_kv(
            qk, qkv[:, qk_end:], positions, state, rope, kv_cache, meta, self.num_heads, self.num_kv_heads, self.head_dim
        )
        o = backend.attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window).view(T, self.q_size)
        out = self.o_proj(o)
        if lora is not None:
            lora.add(out, o, self.layer_idx, "o")
        return out


class MLP(nn.Module):
    def __init__(self, config, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, backend: TorchBackend, lora=None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(backend.silu_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        lora.add(gate_up, x, self.layer_idx, "gate_up")
        act = backend.silu_and_mul(gate_up)
        out = self.down_proj(act)
        lora.add(out, act, self.layer_idx, "down")
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, positions, state, rope, kv_cache, meta, backend: TorchBackend, lora=None):
        """Returns (mlp output, residual), whose sum is the layer's output as HF computes it;
        ``residual`` is None before the first layer."""
        h, residual = backend.add_rms_norm(hidden, residual, self.input_layernorm)
        h = self.self_attn(h, positions, state, rope, kv_cache, meta, backend, lora)
        h, residual = backend.add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h, backend, lora), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flat token batch.

    Args:
        config: a transformers ``PretrainedConfig`` of a supported ``model_type``.
        max_positions: size of the RoPE table (tokens), at least max_model_len.
        tp: this rank's tensor-parallel group (a ``pagedserve.distributed.parallel_state.TPGroup``)
            when the weights are sharded, else None. A model built with a group is then shaped
            for its rank by ``pagedserve.distributed.tensor_parallel.shard_shapes``.
    Attributes:
        backend: the ops backend, PyTorch until the loader sets another (``select_backend``).
        tp: the ``tp`` argument.
    Raises:
        ValueError: for an unsupported model_type.
    """

    rotary_embedding: Callable[..., RotaryEmbedding] = RotaryEmbedding  # the RoPE tables' class (the worker rebuilds them with it after loading)
    layer_class: type = DecoderLayer  # a family's decoder layer (``moe.py``: MoE blocks in place of the MLP)

    def __init__(self, config, max_positions: int, tp=None) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        self.config = config
        self.tp = tp
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([self.layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = self.rotary_embedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
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
        """Hidden states ``[num_tokens, hidden_size]`` of the flat batch ``input_ids [num_tokens]``
        at ``positions [num_tokens]``; writes their K/V into ``kv_caches`` (one per layer).
        ``lora``: the step's LoRA rows (``pagedserve.worker.lora_manager.LoRAStep``), each
        projection's delta added beside it; None when no row uses an adapter."""
        backend = self.backend
        hidden = self.embed_tokens(input_ids)
        if lora is None and backend.decode_step(self, hidden, positions, kv_caches, attn_metadata):
            return hidden
        state = backend.begin_forward(self, positions, attn_metadata, kv_caches, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, state, self.rotary_emb, kv_cache, attn_metadata, backend, lora)
        return backend.add_rms_norm(hidden, residual, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits ``[n, vocab_size]`` for the selected hidden states ``[n, hidden_size]``. Under
        tensor parallelism (``tp`` given to the constructor) every rank
        must call it; rank 0 gets the logits, the other ranks None."""
        if self._logits_linear is not None:
            logits = self._logits_linear(hidden)
        else:
            weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
            logits = F.linear(hidden, weight)
        if self.tp is None:
            return logits
        full = self.tp.gather_last_dim(logits)  # vocab shards are zero-padded: drop the padding
        return None if full is None else full[:, : self.config.vocab_size]

    def pack_for_cpu(self) -> None:
        """Pre-pack every projection (and the logits weight) for the CPU matmuls (bf16 or float32
        on CPU), after the weights are loaded. See :mod:`pagedserve.model.packed_linear`.
        An untied ``lm_head`` is dropped once packed (its packed copy replaces it)."""
        plans = self.pack_logits()
        pack_linears(self.layers, plans)

    def pack_logits(self) -> dict:
        """Pre-pack the logits weight (unless it is quantized); returns the small-M plans made
        so far, for the layers' packing to share."""
        plans: dict = {}
        if not isinstance(self._logits_linear, QuantLinear):
            logits_weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
            packed = PackedLinear(logits_weight)
            attach_small_gemm(packed, plans)
            self._logits_linear = packed
            if not self.tie_word_embeddings:
                self.lm_head = None  # the [vocab, hidden] matrix would otherwise be held twice
        return plans

    # -- weights ---------------------------------------------------------------------------
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def module_of(cls, name: str) -> str:
        """The module path that holds HF weight ``name``: ``model.layers.0.self_attn.q_proj.weight``
        -> ``layers.0.self_attn.qkv_proj``, ``model.embed_tokens.weight`` -> ``embed_tokens``."""
        if name.startswith("model."):
            name = name[len("model.") :]
        parts = name.split(".")[:-1]
        return ".".join(cls._FUSED[p][0] if p in cls._FUSED else p for p in parts)

    def load_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs named as in the HF checkpoint (``model.layers.0...``).

        q/k/v and gate/up are copied into their fused matrices. A
        :class:`~pagedserve.ops.quantized.QuantizedWeight` goes to the quantized module that
        :func:`pagedserve.model.quant_linear.quantize_modules` put in its place (fused parts
        concatenated by rows, exactly).

        Raises:
            ValueError: on an unknown name, a shape mismatch, a quantized weight for a float
                module (or the reverse), or a weight left unloaded.
        """
        params = dict(self.named_parameters())
        quant_modules = {n: m for n, m in self.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
        pending: dict[str, dict[int, QuantizedWeight]] = {}
        loaded: set[str] = set()

        def mark(key: str, name: str) -> None:
            if key in loaded:  # e.g. an expert both per-expert and in a fused stack
                raise ValueError(f"weight {name!r} is given twice in the checkpoint")
            loaded.add(key)

        attn0 = self.layers[0].self_attn
        q, kv = attn0.q_size, attn0.kv_size
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = None
            for i, p in enumerate(parts):
                if p in self._FUSED:
                    target, shard = self._FUSED[p]
                    fused = (".".join(parts[:i] + [target] + parts[i + 1 :]), shard, target)
                    break
            module_path = name.rsplit(".", 1)[0] if fused is None else fused[0].rsplit(".", 1)[0]
            if module_path in quant_modules and name.endswith(".weight"):
                if not isinstance(tensor, QuantizedWeight):
                    raise ValueError(f"weight {name!r} is not quantized but {module_path} was built quantized")
                if fused is None:
                    quant_modules[module_path].set_weight(tensor)
                    mark(name, name)
                else:
                    pending.setdefault(module_path, {})[fused[1]] = tensor
                    mark(f"{fused[0]}#{fused[1]}", name)
                continue
            if isinstance(tensor, QuantizedWeight):
                raise ValueError(f"weight {name!r} is quantized but {module_path} is not a quantized module")
            if fused is None:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.data.copy_(tensor)
                mark(name, name)
                continue
            pname, shard, target = fused
            if pname not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if target == "qkv_proj":
                offsets = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
            else:  # gate/up halves of this module (this rank's share under tensor parallelism)
                inter = params[pname].shape[0] // 2
                offsets = [(0, inter), (inter, 2 * inter)]
            lo, hi = offsets[shard]
            dst = params[pname].data[lo:hi]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            mark(f"{pname}#{shard}", name)
        for module_path, parts in pending.items():
            quant_modules[module_path].set_weight(cat_rows([parts[i] for i in sorted(parts)]))
        expected = set()
        names = list(params) + [f"{n}.weight" for n in quant_modules]
        for pname in names:
            leaf = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if leaf == "qkv_proj":
                expected.update(f"{pname}#{s}" for s in range(3))
            elif leaf == "gate_up_proj":
                expected.update(f"{pname}#{s}" for s in range(2))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if isinstance(self.embed_tokens, QuantEmbedding) and self.tie_word_embeddings:
            head = QuantLinear(self.config.hidden_size, self.embed_tokens.num_embeddings)
            head.set_weight(self.embed_tokens.qweight)
            self._logits_linear = head
        elif isinstance(getattr(self, "lm_head", None), QuantLinear):
            self._logits_linear = self.lm_head
