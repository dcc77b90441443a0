"""MoE GGUF files (``pagedserve.model.moe`` + ``moe_gguf``): a tiny random HF model's tensors
written with the ``gguf`` package in llama.cpp's layout (what ``convert_hf_to_gguf.py`` writes:
architectures ``qwen3moe`` / ``qwen2moe``, Mixtral as ``llama`` with ``llama.expert_count`` and
permuted Q/K rows; the router ``ffn_gate_inp`` F32, experts as 3-D stacks ``ffn_{gate,up,down}_exps
[E, out, in]``, Qwen2-MoE's shared expert ``ffn_*_shexp`` and its 1-D gate ``ffn_gate_inp_shexp``).
An F32 file gives HF's logits (within 1e-3); a Q8_0 file (stacks quantized, each expert a row
slice kept quantized) stays close to the F32 one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf_utils import _byte_chars
from test_model_hf import hf_logits, our_prefill_logits
from test_moe import CASES, COMMON, _classes

from pagedserve import LLM

MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_chars() + [m.replace(" ", "") for m in MERGES]
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (NeoX halves -> interleaved rows) for Q/K."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf(kind: str):
    cfg_cls, model_cls = _classes(kind)
    overrides = {"vocab_size": len(TOKENS), "mlp_only_layers": []}
    if kind == "qwen2_moe":
        overrides["shared_expert_intermediate_size"] = 64  # a multiple of Q8_0's block of 32
    if kind == "mixtral":
        overrides["sliding_window"] = None  # llama-arch GGUF metadata has no window
    config = cfg_cls(**{**COMMON, **CASES[kind], **overrides})
    torch.manual_seed(7)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.copy_(1.0 + 0.5 * torch.randn_like(p) if name.endswith("norm.weight") else 0.5 * torch.randn_like(p))
    return model


def write_moe_gguf(model, kind: str, path: str, qtype: str, used_count: bool = True) -> str:
    """``model``'s tensors as llama.cpp's converter names and lays them out; 2-D and 3-D weights
    other than the router in ``qtype`` (``F32``: all float32)."""
    import gguf

    cfg = model.config
    arch = ARCH[kind]
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-moe")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(TOKENS))
    w.add_rope_dimension_count(head_dim)
    w.add_expert_count(cfg.num_local_experts if kind == "mixtral" else cfg.num_experts)
    if used_count:
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if kind != "mixtral":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * 3 + [1] * (len(TOKENS) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    qt = gguf.GGMLQuantizationType[qtype]

    def add(name: str, t: torch.Tensor, keep_float: bool = False) -> None:
        arr = t.detach().float().numpy().copy()
        if arr.ndim >= 2 and qtype != "F32" and not keep_float:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, arr.astype(np.float32))

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute(q, cfg.num_attention_heads), _permute(k, cfg.num_key_value_heads)
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for proj in ("q", "k", "v"):
            if p + f"self_attn.{proj}_proj.bias" in sd:
                add(f"blk.{i}.attn_{proj}.bias", sd[p + f"self_attn.{proj}_proj.bias"])
        if kind == "qwen3_moe":
            add(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            add(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        m = p + "mlp."
        add(f"blk.{i}.ffn_gate_inp.weight", sd[m + "gate.weight"], keep_float=True)
        gate_up, down = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]  # [E, 2I, H], [E, H, I]
        half = gate_up.shape[1] // 2
        add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :half])
        add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, half:])
        add(f"blk.{i}.ffn_down_exps.weight", down)
        if kind == "qwen2_moe":
            for proj in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{proj}_shexp.weight", sd[m + f"shared_expert.{proj}_proj.weight"])
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", sd[m + "shared_expert_gate.weight"].reshape(-1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_gguf_f32_equals_hf_and_q8_0_stays_close(kind, tmp_path):
    from pagedserve.model.moe import MoeForCausalLM
    from pagedserve.model.quant_linear import QuantLinear

    hf = _tiny_hf(kind)
    ids = torch.randint(3, len(TOKENS), (40,), generator=torch.Generator().manual_seed(0)).tolist()
    want = hf_logits(hf, ids)
    f32 = LLM(write_moe_gguf(hf, kind, str(tmp_path / "f32.gguf"), "F32"), dtype="float32", num_kv_blocks=16, max_model_len=128)
    model = f32.llm_engine.core.worker.model_runner.model
    assert isinstance(model, MoeForCausalLM) and model.config.model_type == kind
    got = our_prefill_logits(f32, ids)
    assert (got - want).abs().max().item() < 1e-3
    del f32
    q8 = LLM(write_moe_gguf(hf, kind, str(tmp_path / "q8.gguf"), "Q8_0"), dtype="float32", num_kv_blocks=16, max_model_len=128)
    block = q8.llm_engine.core.worker.model_runner.model.layers[0].mlp
    assert all(isinstance(e.gate_up_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear) for e in block.experts)
    assert not isinstance(block.gate, QuantLinear)
    close = our_prefill_logits(q8, ids)
    assert (close - got).abs().max().item() < 0.5
    assert (close.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.9
    assert os.path.getsize(tmp_path / "q8.gguf") < os.path.getsize(tmp_path / "f32.gguf") / 2


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_gguf_without_experts_per_token_is_refused(kind, tmp_path):
    """A file with experts but no ``<arch>.expert_used_count`` is refused, naming the key (the
    top-k would be transformers' default: all 8 experts of a qwen3moe file)."""
    from pagedserve.model.file_headers import ModelFileError

    path = write_moe_gguf(_tiny_hf(kind), kind, str(tmp_path / "no-k.gguf"), "F32", used_count=False)
    with pytest.raises(ModelFileError, match="expert_used_count"):
        LLM(path, dtype="float32", num_kv_blocks=16, max_model_len=128)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_gguf_tp2_equals_tp1(kind, tmp_path):
    """TP 2 on a GGUF file: the expert stacks are split per expert, then each expert's
    intermediate dimension per rank (Mixtral: after the Q/K un-permutation)."""
    from pagedserve import SamplingParams

    path = write_moe_gguf(_tiny_hf(kind), kind, str(tmp_path / "f32.gguf"), "F32")
    prompts = [{"prompt_token_ids": torch.randint(3, len(TOKENS), (n,), generator=torch.Generator().manual_seed(n)).tolist()} for n in (20, 45, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=48, max_model_len=128, max_num_batched_tokens=24)
    ref = LLM(path, num_threads=1, **kw)
    want = [list(o.outputs[0].token_ids) for o in ref.generate(prompts, params, use_tqdm=False)]
    del ref
    tp = LLM(path, num_threads=2, tensor_parallel_size=2, **kw)
    try:
        got = [list(o.outputs[0].token_ids) for o in tp.generate(prompts, params, use_tqdm=False)]
    finally:
        tp.llm_engine.core.shutdown()
    assert got == want


def test_experts_given_twice_are_refused():
    """A checkpoint holding layer 0's experts both per expert and as transformers 5's fused 3-D
    stack is refused (the later copy used to win silently)."""
    from pagedserve.model.moe import MoeForCausalLM

    hf = _tiny_hf("qwen3_moe")
    sd = hf.state_dict()  # transformers 5 holds the experts as fused 3-D stacks
    fused = sd["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, H], gate rows first
    inter = fused.shape[1] // 2
    per_expert = [
        (f"model.layers.0.mlp.experts.{i}.{p}_proj.weight", fused[i, j * inter : (j + 1) * inter]) for i in range(fused.shape[0]) for j, p in enumerate(("gate", "up"))
    ]
    MoeForCausalLM(hf.config, 64).load_weights(list(sd.items()))  # the checkpoint alone loads
    with pytest.raises(ValueError, match="given twice"):
        MoeForCausalLM(hf.config, 64).load_weights(list(sd.items()) + per_expert)
