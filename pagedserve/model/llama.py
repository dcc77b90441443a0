"""One decoder implementation for the Llama family: Llama, Mistral, Qwen2 (qkv bias), Qwen3
(q/k RMSNorm), tied or untied embeddings, GQA, RoPE with the checkpoint's theta and scaling.

The math follows HF transformers' ``modeling_llama`` / ``modeling_qwen2`` / ``modeling_qwen3``
(same op order and dtypes, so float32 greedy output matches token for token). Differences are
in layout only: the batch is flat (``[num_tokens, hidden]``, no padding between requests), Q/K/V
and gate/up projections are fused into one matmul each, and attention is paged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model import cpu_kernels
from pagedserve.model.attention import AttentionMetadata, paged_attention, write_kv_cache
from pagedserve.model.packed_linear import pack_linears, pack_weight, packed_or_small_linear, prepare_small_gemm


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
    ``rope_type`` (default, linear, llama3, yarn, ...), so scaled checkpoints match HF."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_params = getattr(config, "rope_parameters", None) or {}
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
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
            t = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = torch.outer(t, inv_freq.float())
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions [num_tokens]``: each ``[num_tokens, 1, head_dim]``."""
        return self.cos_cache[positions].to(dtype)[:, None, :], self.sin_cache[positions].to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)))
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx

    def forward(self, hidden, cos, sin, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        # Q and K heads side by side: one RoPE pass over [T, num_heads + num_kv_heads, head_dim].
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        q = q.contiguous()
        write_kv_cache(kv_cache, k, v, attn_metadata)
        o = paged_attention(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))

    def forward_fused(self, hidden, positions, rope: "RotaryEmbedding", kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Same as ``forward`` with RoPE and the K/V cache write in one C pass
        (``cpu_kernels.rope_write_kv``); attention reads this step's K/V from the cache."""
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_end = self.q_size + self.kv_size
        qk = qkv[:, :qk_end]
        if self.qk_norm:
            q, k = qk.reshape(T, self.num_heads + self.num_kv_heads, self.head_dim).split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1).view(T, qk_end)
        q = cpu_kernels.rope_write_kv(
            qk, qkv[:, qk_end:], positions, attn_metadata.slot_mapping, rope.cos_cache, rope.sin_cache, kv_cache, self.num_heads
        )
        o = paged_attention(q, None, None, kv_cache, attn_metadata, self.scale)
        return self.o_proj(o.view(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(cpu_kernels.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, kv_cache, attn_metadata):
        residual = hidden
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, attn_metadata)
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden

    def forward_fused(self, hidden, residual, positions, rope, kv_cache, attn_metadata, cos_sin=None):
        """The layer with fused C element-wise ops; ``residual`` is carried between layers
        (None before the first) and updated in place: returns (mlp output, residual), whose sum
        is ``forward``'s output. With ``cos_sin`` given, attention takes the PyTorch RoPE path
        (``Attention.forward``) instead of the fused RoPE + cache write, whose attention reads
        every K/V from the cache and suits only the C kernel's fast path."""
        eps = self.input_layernorm.eps
        h, residual = cpu_kernels.add_rms_norm(hidden, residual, self.input_layernorm.weight, eps)
        if cos_sin is None:
            h = self.self_attn.forward_fused(h, positions, rope, kv_cache, attn_metadata)
        else:
            h = self.self_attn(h, cos_sin[0], cos_sin[1], kv_cache, attn_metadata)
        h, residual = cpu_kernels.add_rms_norm(h, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp.forward_fused(h), residual


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _check_range(name: str, values: torch.Tensor, limit: int) -> None:
    """Raise IndexError unless every value is in ``[0, limit)``."""
    if values.numel():
        lo, hi = torch.aminmax(values)
        if int(lo) < 0 or int(hi) >= limit:
            raise IndexError(f"{name} out of range [0, {limit}): min {int(lo)}, max {int(hi)}")


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flat token batch.

    Args:
        config: a transformers ``PretrainedConfig`` of a supported ``model_type``.
        max_positions: size of the RoPE table (tokens), at least max_model_len.
    Raises:
        ValueError: for an unsupported model_type.
    """

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` of the flat batch ``input_ids [num_tokens]``
        at ``positions [num_tokens]``; writes their K/V into ``kv_caches`` (one per layer)."""
        hidden = self.embed_tokens(input_ids)
        if self._decode_step_c(hidden, positions, kv_caches, attn_metadata):
            return hidden
        if self.use_fused_ops and cpu_kernels.fused_ops_usable(hidden):
            attn = self.layers[0].self_attn
            fused_rope = cpu_kernels.prefill_kernel_preferred(hidden.dtype, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            cos_sin = None if fused_rope else self.rotary_emb(positions, hidden.dtype)
            if fused_rope:  # the C op indexes the RoPE table and the cache without bounds checks
                _check_range("positions", positions, self.rotary_emb.cos_cache.shape[0])
                _check_range("slot_mapping", attn_metadata.slot_mapping, kv_caches[0][0].numel() // (attn.num_kv_heads * attn.head_dim))
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer.forward_fused(hidden, residual, positions, self.rotary_emb, kv_cache, attn_metadata, cos_sin)
            return cpu_kernels.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden)

    def _decode_step_c(self, hidden, positions, kv_caches, attn_metadata) -> bool:
        """Run every layer of a decode step of 1-16 sequences in one C call
        (``csrc/decode_step.c``: the fused-op path's ops in the same order, bit-identical),
        overwriting ``hidden [M, hidden_size]`` with the final normed states. Returns False,
        having done nothing, when the step or the model does not qualify: CPU bf16 with the fused
        ops and the attention kernel's fast path, no q/k norm, every projection with a small-M
        plan (``pack_for_cpu``), one decode group of at most 16 tokens."""
        groups = attn_metadata.groups
        if (
            hidden.dtype != torch.bfloat16
            or hidden.shape[0] > cpu_kernels.SMALL_GEMM_MAX_ROWS
            or len(groups) != 1
            or not groups[0].is_decode
            or not self.use_fused_ops
            or hidden.device.type != "cpu"
        ):
            return False
        table = self._decode_table(kv_caches)
        if table is None:
            return False
        attn = self.layers[0].self_attn
        g = groups[0]
        _check_range("positions", positions, self.rotary_emb.cos_cache.shape[0])
        _check_range("slot_mapping", attn_metadata.slot_mapping, kv_caches[0][0].numel() // (attn.num_kv_heads * attn.head_dim))
        rc = cpu_kernels.decode_layers(
            table, hidden, self.norm.weight, positions, attn_metadata.slot_mapping, self.rotary_emb.cos_cache,
            self.rotary_emb.sin_cache, g.block_tables, g.seq_lens, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, inter=self.config.intermediate_size,
            block_size=kv_caches[0].shape[3], eps=self.norm.eps, scale=attn.scale,
        )
        if rc != 0:
            raise RuntimeError(f"decode_layers_bf16 failed with code {rc}")
        return True

    def _decode_table(self, kv_caches) -> "torch.Tensor | None":
        """``[num_layers, entries]`` int64 addresses and plans for ``decode_layers`` (built once
        per KV cache), or None when the model does not qualify for the one-call decode step."""
        # The runner passes the same list every step; a new list (or cache) rebuilds the table.
        key = (id(kv_caches), len(kv_caches), kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        cached = self._decode_table_cache
        if cached is not None and cached[0] == key and cached[2] is kv_caches:
            return cached[1]
        table = None
        attn = self.layers[0].self_attn
        eps = self.norm.eps
        ok = (
            self._packed_logits_weight is not None
            and not attn.qk_norm
            and cpu_kernels.get_small_gemm_lib() is not None
            and cpu_kernels.prefill_kernel_preferred(torch.bfloat16, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            and all(kv.is_contiguous() and kv.dtype == torch.bfloat16 for kv in kv_caches)
            and all(l.input_layernorm.eps == eps and l.post_attention_layernorm.eps == eps for l in self.layers)
        )
        rows = []
        for layer, kv in zip(self.layers, kv_caches):
            if not ok:
                break
            entries = []
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                plan = getattr(lin, "small_plan", None)
                if plan is None:
                    ok = False
                    break
                entries += [torch.ops.mkldnn.data_ptr(lin.packed_weight), 0 if lin.bias is None else lin.bias.data_ptr(), *plan]
            if ok:
                entries += [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(), *cpu_kernels._kv_pointers(kv)]
                rows.append(entries)
        if ok and rows and len(rows[0]) == cpu_kernels.decode_layer_entries():
            table = torch.tensor(rows, dtype=torch.int64)
        self._decode_table_cache = (key, table, kv_caches)
        return table

    _decode_table_cache = None

    @property
    def use_fused_ops(self) -> bool:
        """CPU fused element-wise ops (``cpu_kernels``): on unless ``PAGEDSERVE_CPU_KERNELS=0``,
        for shapes the C code handles (hidden size and head_dim bounds, GQA group <= 16)."""
        if self._use_fused_ops is None:
            attn = self.layers[0].self_attn
            self._use_fused_ops = (
                self.config.hidden_size <= 16384
                and attn.head_dim <= 256
                and attn.head_dim % 2 == 0
                and attn.num_heads // attn.num_kv_heads <= 16
                and cpu_kernels.get_fused_lib() is not None
                and cpu_kernels.get_lib() is not None
            )
        return self._use_fused_ops

    _use_fused_ops = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` for the selected hidden states ``[n, hidden_size]``."""
        if self._packed_logits_weight is not None:
            return packed_or_small_linear(hidden, self._packed_logits_weight, None, self.config.vocab_size, self._logits_small_plan)
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight)

    _packed_logits_weight = None
    _logits_small_plan = None

    def pack_for_cpu(self) -> None:
        """Pre-pack every projection (and the logits weight) for oneDNN; bf16 on CPU only, after
        the weights are loaded. See :mod:`pagedserve.model.packed_linear`."""
        logits_weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        self._packed_logits_weight = pack_weight(logits_weight)
        plans: dict = {}
        self._logits_small_plan = prepare_small_gemm(self._packed_logits_weight, logits_weight.shape[0], logits_weight.shape[1], None, plans)
        pack_linears(self.layers, plans)

    # -- weights ---------------------------------------------------------------------------
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs named as in the HF checkpoint (``model.layers.0...``).

        q/k/v and gate/up are copied into their fused matrices.

        Raises:
            ValueError: on an unknown name, a shape mismatch, or a parameter left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        attn0 = self.layers[0].self_attn
        q, kv = attn0.q_size, attn0.kv_size
        inter = self.config.intermediate_size
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
            if fused is None:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
                continue
            pname, shard, target = fused
            if pname not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if target == "qkv_proj":
                offsets = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
            else:
                offsets = [(0, inter), (inter, 2 * inter)]
            lo, hi = offsets[shard]
            dst = params[pname].data[lo:hi]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{pname}#{shard}")
        expected = set()
        for pname in params:
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
