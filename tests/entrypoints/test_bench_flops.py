"""``bench.flops.model_flops`` counts the matmul weights one token reads, checked against HF
transformers' own modules (built on the meta device, no memory): every 2-D+ weight of the decoder
layers, a mixture of experts' routed experts scaled by top-k / experts (the router and a shared
expert read in full). The batch-1 decode ceiling of ``bench latency`` and MFU rest on it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], decoder_sparse_step=1),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=48, decoder_sparse_step=2),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def _hf_active_layer_params(config) -> int:
    with torch.device("meta"):
        model = getattr(transformers, CONFIGS[config.model_type][1])(config)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    total = 0
    for name, p in model.named_parameters():
        if ".layers." not in name or p.dim() < 2:
            continue
        n = p.numel()
        if ".experts." in name or name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            n = n * config.num_experts_per_tok // experts
        total += n
    return total


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_model_flops_counts_the_weights_a_token_reads(model_type):
    from pagedserve.bench.flops import model_flops

    cfg_name, _, extra = CONFIGS[model_type]
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    mf = model_flops(config)
    assert mf.layer_params == _hf_active_layer_params(config)
    assert mf.lm_head_params == 64 * 1000
    assert mf.flops(10, 2) == 2.0 * mf.layer_params * 10 + 2.0 * mf.lm_head_params * 2
