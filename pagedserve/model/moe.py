"""Mixture-of-experts decoders: Mixtral (``mixtral``), Qwen2-MoE (``qwen2_moe``) and Qwen3-MoE
(``qwen3_moe``). Attention, norms, embedding and logits are the Llama family's
(:mod:`pagedserve.model.llama`); the MLP of a sparse layer is a :class:`SparseMoeBlock`.

Routing follows transformers' ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter`` /
``Qwen3MoeTopKRouter`` exactly: router logits in the model dtype, softmax over all experts in
float32, ``torch.topk``, renormalised over the chosen k (always for Mixtral, iff
``norm_topk_prob`` for Qwen), and the weights cast back to the model dtype for Qwen (Mixtral keeps
them float32). Each token's experts depend only on its own logits: no capacity limit, no padding,
so a row's output does not depend on its batch neighbours.

Execution per step (vLLM's fused-MoE idea without the fused kernel): the flat ``[T * k]`` expert
ids are sorted (stable argsort), so each expert present in the step sees its rows as one
contiguous group and runs them as ONE matmul per projection on its own linear modules (packed for
the CPU, or quantized for GGUF, like any projection); each group's output, times its routing
weights, is added back to its tokens with ``index_add_`` into a float32 accumulator, experts in
ascending order (HF's order too, so float32 results match HF's bit for bit up to the matmuls).

Checkpoints: the hub's per-expert tensors (Mixtral ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen
``mlp.experts.E.{gate,up,down}_proj``), transformers 5's 3-D stacks and llama.cpp's GGUF stacks
all become per-expert names (:func:`canonical_weights`), which tensor parallelism
(``distributed/tensor_parallel.py``: each expert's intermediate dimension split, router
replicated, one all-reduce after the block) and quantized GGUF loading use too.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from pagedserve.model.backends import TorchBackend
from pagedserve.model.layers import RMSNorm
from pagedserve.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from pagedserve.model.packed_linear import PackedLinear, attach_small_gemm
from pagedserve.ops.quantized import QuantizedWeight

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


class FloatLinear(nn.Linear):
    """A small projection that stays a plain float ``nn.Linear`` (the router, Qwen2-MoE's shared
    expert gate): never packed or int8-quantized, so routing is PyTorch's ``F.linear`` exactly as
    in HF and independent of the batch's row count."""


def num_experts(config) -> int:
    """Routed experts per sparse layer (``num_local_experts`` for Mixtral, ``num_experts`` for Qwen)."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0)


def expert_intermediate(config) -> int:
    """One expert's intermediate width: Mixtral's ``intermediate_size``, Qwen's ``moe_intermediate_size``."""
    return int(config.intermediate_size if config.model_type == "mixtral" else config.moe_intermediate_size)


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has an MoE block (HF's rule: Qwen's ``mlp_only_layers`` and
    ``decoder_sparse_step`` make some layers dense; every Mixtral layer is sparse)."""
    if config.model_type == "mixtral":
        return True
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only = getattr(config, "mlp_only_layers", None) or []
    return layer_idx not in only and num_experts(config) > 0 and (layer_idx + 1) % step == 0


class Expert(nn.Module):
    """One SwiGLU expert: ``gate_up_proj`` ``[2 * inter, hidden]`` (gate rows first, as HF's
    fused ``gate_up_proj`` and as :meth:`TorchBackend.silu_and_mul` reads them), ``down_proj``
    ``[hidden, inter]``. Same attribute names as :class:`pagedserve.model.llama.MLP`, so
    tensor-parallel sharding and weight loading treat both alike."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.intermediate_size = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, backend: TorchBackend) -> torch.Tensor:
        return self.down_proj(backend.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's sigmoid-gated shared expert).

    ``forward(x [T, hidden], backend) -> [T, hidden]`` in x's dtype.
    """

    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_experts = num_experts(config)
        self.top_k = int(config.num_experts_per_tok)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts}] (the number of experts)")
        self.renormalize = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
        self.weights_in_model_dtype = config.model_type != "mixtral"  # Qwen casts, Mixtral keeps float32
        self.gate = FloatLinear(hidden, self.num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(hidden, expert_intermediate(config)) for _ in range(self.num_experts)])
        self.shared_expert: Optional[Expert] = None
        self.shared_expert_gate: Optional[FloatLinear] = None
        if config.model_type == "qwen2_moe" and int(getattr(config, "shared_expert_intermediate_size", 0) or 0) > 0:
            self.shared_expert = Expert(hidden, int(config.shared_expert_intermediate_size))
            self.shared_expert_gate = FloatLinear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts and weights from its own router logits: ``(weights [T, k], ids
        [T, k] int64)``, weights float32 (Mixtral) or x's dtype (Qwen), as HF computes them."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor, backend: TorchBackend, lora=None) -> torch.Tensor:
        T = x.shape[0]
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, token order inside a group
        rows = order // self.top_k  # the token of each grouped row
        row_weights = weights.reshape(-1)[order, None]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = rows[start : start + n]
            y = self.experts[e](x[tok], backend) * row_weights[start : start + n]
            out.index_add_(0, tok, y.to(x.dtype).float())  # HF adds expert by expert in x's dtype
            start += n
        result = out.to(x.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            result = result + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, backend)
        return result


class MoeDecoderLayer(DecoderLayer):
    """The Llama decoder layer with an MoE block (or, for Qwen's dense layers, a plain MLP of
    ``intermediate_size``) as its ``mlp``."""

    def __init__(self, config, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = Attention(config, layer_idx)
        self.mlp: nn.Module = SparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else MLP(config, layer_idx)  # type: ignore[assignment]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Checkpoint spellings -> the per-expert HF spelling ``...mlp.experts.E.{gate,up,down}_proj.weight``.
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")  # GGUF's *_exps


def _split_stack(prefix: str, proj: str, t, num_experts: int) -> Iterator[tuple[str, Any]]:
    """Each expert's slice of a GGUF expert stack: a float ``[E, out, in]`` (or ``[E * out, in]``)
    tensor, or a 2-D :class:`~pagedserve.ops.quantized.QuantizedWeight` of ``E * out`` rows."""
    if isinstance(t, QuantizedWeight):
        rows = t.out_features // num_experts
        for e in range(num_experts):
            yield f"{prefix}.{e}.{proj}.weight", t.rows(e * rows, (e + 1) * rows)
        return
    t = t.reshape(num_experts, -1, t.shape[-1])
    for e in range(num_experts):
        yield f"{prefix}.{e}.{proj}.weight", t[e]


def canonical_weights(weights: Iterable[tuple[str, Any]], num_experts: int = 0) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors renamed to one spelling: Mixtral's ``block_sparse_moe`` -> ``mlp`` and
    ``w1/w3/w2`` -> ``gate_proj/up_proj/down_proj``; transformers 5's fused 3-D
    ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]`` and GGUF's
    stacks ``mlp.experts.{gate,up,down}_proj.weight`` (``num_experts`` of them) split into each
    expert's ``gate_proj``/``up_proj``/``down_proj`` (views, no copy); GGUF's 1-D shared-expert
    gate ``[H]`` as ``[1, H]``."""
    for name, t in weights:
        name = canonical_name(name)
        stacked = _STACKED_EXPERTS.match(name)
        if stacked is not None:
            yield from _split_stack(stacked.group(1), stacked.group(2), t, num_experts)
            continue
        if name.endswith("shared_expert_gate.weight") and not isinstance(t, QuantizedWeight) and t.dim() == 1:
            t = t.reshape(1, -1)
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            yield name, t
            continue
        prefix, kind = m.groups()
        if t.dim() != 3:
            raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, expected a 3-D [experts, out, in] stack")
        for e in range(t.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", t[e]
            else:
                half = t.shape[1] // 2
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", t[e, half:]


def canonical_name(name: str) -> str:
    """One checkpoint name in the per-expert HF spelling (see :func:`canonical_weights`)."""
    parts = name.split(".")
    if "block_sparse_moe" in parts:
        i = parts.index("block_sparse_moe")
        parts[i] = "mlp"
        if len(parts) > i + 3 and parts[i + 1] == "experts":
            parts[i + 3] = _MIXTRAL_PROJ.get(parts[i + 3], parts[i + 3])
    return ".".join(parts)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE over a flat token batch (the surface of
    :class:`~pagedserve.model.llama.LlamaForCausalLM`; see :mod:`pagedserve.model.registry`).

    The CPU backend's one-call C step is refused (``c_step_ok``: it runs the Llama layer only);
    every projection still takes the packed / quantized matmuls, and the norms the fused kernels.
    LoRA is refused (``supports_lora``: adapters name the Llama MLP's modules), and so are CUDA
    graphs (``cuda_graphs_ok``).

    Raises:
        ValueError: an unsupported model_type or a ``num_experts_per_tok`` outside [1, experts].
    """

    layer_class = MoeDecoderLayer
    c_step_ok = False
    supports_lora = False
    cuda_graphs_ok = False  # the expert groups' sizes are read on the host each step

    @classmethod
    def module_of(cls, name: str) -> str:
        """``model.layers.0.block_sparse_moe.experts.3.w1.weight`` -> ``layers.0.mlp.experts.3.gate_up_proj``;
        a GGUF expert stack ``...mlp.experts.gate_proj.weight`` -> expert 0's module (all alike)."""
        name = canonical_name(name)
        if _STACKED_EXPERTS.match(name):
            name = name.replace(".experts.", ".experts.0.")
        return super().module_of(name)

    def load_weights(self, weights) -> None:
        """Load HF-named tensors in any of the spellings :func:`canonical_weights` accepts
        (float or :class:`~pagedserve.ops.quantized.QuantizedWeight`).

        Raises:
            ValueError: as :meth:`LlamaForCausalLM.load_weights` (unknown name, shape, missing).
        """
        super().load_weights(canonical_weights(weights, num_experts(self.config)))

    def pack_for_cpu(self) -> None:
        """As :meth:`LlamaForCausalLM.pack_for_cpu`, but the routers and shared-expert gates
        (:class:`FloatLinear`) stay PyTorch's ``F.linear``."""
        plans = self.pack_logits()
        for module in list(self.layers.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    linear = PackedLinear.from_linear(child)
                    attach_small_gemm(linear, plans)
                    setattr(module, name, linear)
