"""Model FLOPs and this machine's matmul rate, for model FLOPs utilization (MFU).

FLOPs use the 2 * params * tokens rule (one multiply-add per weight per token), counting only
the weights that take part in matmuls: the decoder layers for every token run through the model (prompt
tokens, and each output token but the last one of a request, which is sampled and never fed
back), plus the LM head once per output token (both pagedserve and HF generate compute
logits for the last position of each sequence). Embedding lookups and attention's own
QK^T / AV products are left out, as the rule does. Only useful work counts: HF's left padding
and pagedserve's recomputation after a preemption are not model FLOPs.

The peak is measured, not looked up: a short ``torch.matmul`` loop in the run's dtype on
shapes like the model's (``[256 x hidden] @ [hidden x intermediate]`` and its neighbours); the
best rate seen is the denominator. On a shared machine it is as noisy as the run itself.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch


@dataclass
class ModelFlops:
    layer_params: int  # matmul weights of the decoder layers
    lm_head_params: int

    def flops(self, forward_tokens: int, sampled_tokens: int) -> float:
        """``forward_tokens``: tokens run through the decoder layers (prompt tokens not served
        from the prefix cache, plus every output token but each request's last);
        ``sampled_tokens``: positions whose logits were computed (one per output token)."""
        return 2.0 * self.layer_params * forward_tokens + 2.0 * self.lm_head_params * sampled_tokens

    def as_dict(self) -> dict:
        return asdict(self)


def projection_shapes(hf_config) -> list[tuple[int, int]]:
    """(out, in) of a Llama-family layer's fused qkv, o, gate_up and down projections (GQA,
    optional head_dim)."""
    h, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inter = hf_config.intermediate_size
    return [((heads + 2 * kv_heads) * head_dim, h), (h, heads * head_dim), (2 * inter, h), (h, inter)]


def mlp_params_per_token(hf_config, layer: int) -> int:
    """Matmul weights one token's MLP reads in ``layer``: the dense MLP (gate, up, down), or in a
    mixture-of-experts layer the router, its ``num_experts_per_tok`` experts and the shared expert
    with its gate where there is one (Qwen2-MoE). Expert size: ``moe_intermediate_size`` (Qwen MoE),
    else ``intermediate_size`` (Mixtral). Which layers are sparse: HF's Qwen2/3-MoE rule (not in
    ``mlp_only_layers``, and ``(layer + 1) % decoder_sparse_step == 0``); every layer for Mixtral."""
    h = hf_config.hidden_size
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    top_k = getattr(hf_config, "num_experts_per_tok", None) or 0
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    if not experts or not top_k or layer in (getattr(hf_config, "mlp_only_layers", None) or []) or (layer + 1) % step:
        return 3 * h * hf_config.intermediate_size
    inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or 0
    return experts * h + top_k * 3 * h * inter + (3 * h * shared + h if shared else 0)


def model_flops(hf_config) -> ModelFlops:
    """Matmul parameter counts of a Llama-family config, per token: its layers' attention
    projections and MLP (a mixture of experts: the weights of the experts a token is routed to,
    ``mlp_params_per_token``), and the LM head."""
    attn = sum(n * k for n, k in projection_shapes(hf_config)[:2])
    layers = sum(attn + mlp_params_per_token(hf_config, i) for i in range(hf_config.num_hidden_layers))
    return ModelFlops(layers, hf_config.hidden_size * hf_config.vocab_size)


def measure_matmul_flops(
    hidden: int, intermediate: int, dtype: torch.dtype, device: str | torch.device = "cpu", rows: int = 256, seconds: float = 1.0
) -> float:
    """Best achieved FLOP/s of ``[rows x K] @ [K x N]`` matmuls shaped like the model's MLP and
    attention projections, in ``dtype``, within about ``seconds``. bf16 on a CPU where the
    projections take the AVX2 bf16 matmul (float32 arithmetic) is measured in float32."""
    device = torch.device(device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        from pagedserve.model.packed_linear import avx2_bf16

        if avx2_bf16(dtype):
            dtype = torch.float32
    shapes = [(hidden, intermediate), (intermediate, hidden), (hidden, hidden)]
    gen = torch.Generator().manual_seed(0)
    mats = []
    for k, n in shapes:
        a = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
        mats.append((a, b, 2.0 * rows * k * n))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    best = 0.0
    per_shape = max(seconds / len(mats), 0.02)
    with torch.inference_mode():
        for a, b, flop in mats:
            for _ in range(3):  # warm-up: kernel selection, page faults
                torch.matmul(a, b)
            sync()
            deadline = time.perf_counter() + per_shape
            while time.perf_counter() < deadline:
                iters = 0
                t0 = time.perf_counter()
                while iters < 1000:
                    torch.matmul(a, b)
                    iters += 1
                    if iters >= 4 and time.perf_counter() - t0 > 0.02:
                        break
                sync()
                dt = time.perf_counter() - t0
                best = max(best, iters * flop / dt)
    return best


def peak_flops_for(
    hf_config, dtype: torch.dtype, device: str | torch.device = "cpu", seconds: float = 1.0, override_tflops: Optional[float] = None
) -> float:
    if override_tflops:
        return override_tflops * 1e12
    return measure_matmul_flops(hf_config.hidden_size, hf_config.intermediate_size, dtype, device, seconds=seconds)
