"""Phi-3 family (``model_type`` phi3: Phi-3-mini-4k, Phi-3.5-mini, Phi-4, Phi-4-mini shapes,
scaled down) against HF transformers' ``Phi3ForCausalLM`` on the same random weights.

Greedy float32 output must equal HF's token for token (HF's argmax over one forward of our
sequence, i.e. teacher forcing; HF's own cached ``generate`` too for one prompt), through the
engine's paths that could break it: a sliding window shorter than the prompts (Phi-3-mini-4k),
chunked prefill with chunks straddling the window edge, prefix-cache hits, preemption, LongRoPE
with short factors (the model built for at most ``original_max_position_embeddings``) and long
ones (built for more; HF forced onto its long factors), partial rotary (Phi-4-mini). The int8
KV cache and bf16 agree loosely (as tests/ops/test_kv_int8.py and test_model_hf.py do).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, _smollm2_dir, assert_engine_idle

from pagedserve import LLM, SamplingParams

ORIGINAL = 1024  # original_max_position_embeddings of the LongRoPE cases
WINDOW = 48


def _factors(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(n, generator=g)).tolist()


def _longrope(rotary_dim: int, partial: float = 1.0) -> dict:
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=partial,
        short_factor=_factors(rotary_dim // 2, 1),
        long_factor=_factors(rotary_dim // 2, 2),
        original_max_position_embeddings=ORIGINAL,
    )


# id -> Phi3Config overrides (the real models' layouts, scaled down)
CASES = {
    # Phi-3-mini-4k: MHA, default RoPE, a sliding window (2047 of 4096 there)
    "phi3-mini-4k": dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=WINDOW),
    # Phi-3.5-mini / Phi-3-mini-128k: LongRoPE over the whole head, a window longer than any context
    "phi3.5-mini": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4 * ORIGINAL,
        sliding_window=8 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=_longrope(32),
    ),  # fmt: skip
    # Phi-4 (14B): GQA 40/10, head_dim 128, theta 250k, no scaling, no window
    "phi4": dict(num_attention_heads=8, num_key_value_heads=2, rope_parameters=dict(rope_type="default", rope_theta=250000.0)),
    # Phi-4-mini: GQA 24/8, head_dim 128 with partial rotary 0.75, LongRoPE, tied embeddings
    "phi4-mini": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=_longrope(24, 0.75),
    ),  # fmt: skip
}


def _make_phi3(path: str, overrides: dict) -> str:
    import transformers
    from transformers import AutoTokenizer

    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=ORIGINAL,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    kw.update(overrides)
    torch.manual_seed(1234)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kw)).to(torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # separated greedy choices; 1-D weights (norm scales) random too
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(_smollm2_dir()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def phi3_model(tmp_path_factory):
    cache: dict = {}

    def factory(case: str) -> str:
        if case not in cache:
            cache[case] = _make_phi3(str(tmp_path_factory.mktemp(f"phi3-{case}")), CASES[case])
        return cache[case]

    return factory


def _prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


SHORT = (5, 23, 49, 64, 97, 130)  # past the 48-token window from the third on
LONG = SHORT + (300, 600)


def _hf(path: str, long_factors: bool = False):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if long_factors:  # HF switches to long factors past the original length only: force them everywhere
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu", seq_len=ORIGINAL + 1)
        hf.model.rotary_emb.inv_freq.copy_(inv)
        hf.model.rotary_emb.original_inv_freq.copy_(inv)
    return hf


def _greedy(llm: LLM, prompts, n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert_engine_idle(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_rows(hf, prompt: list[int], ours: list[int]) -> torch.Tensor:
    """HF's float32 logits rows predicting each of ``ours`` after ``prompt`` ``[len(ours), V]``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ours])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(ours)]


def _assert_hf_greedy(hf, prompts, outs, check_generate: int = 1) -> None:
    for i, (p, ours) in enumerate(zip(prompts, outs)):
        theirs = _hf_rows(hf, p, ours).argmax(-1).tolist()
        assert ours == theirs, f"prompt {i} ({len(p)} tokens): ours {ours} != HF {theirs}"
        if i < check_generate:  # HF's own cached loop agrees with its forward
            with torch.no_grad():
                gen = hf.generate(torch.tensor([p]), max_new_tokens=len(ours), do_sample=False, min_new_tokens=len(ours))
            assert gen[0, len(p) :].tolist() == ours


def _llm(path: str, **kw) -> LLM:
    args = dict(dtype="float32", num_threads=1, num_kv_blocks=160, max_model_len=ORIGINAL)
    args.update(kw)
    return LLM(path, **args)


# -- RoPE unit: the permuted layout is HF's partial rotary --------------------------------------
def test_partial_rotary_permutation_is_hf_rotary():
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as HFRope
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from pagedserve.model.layers import rotate_half
    from pagedserve.model.phi3 import Phi3RotaryEmbedding, rotary_permutation

    cfg = transformers.Phi3Config(**{**dict(hidden_size=128, num_hidden_layers=1, vocab_size=64), **CASES["phi4-mini"]})
    perm = rotary_permutation(32, 24)
    assert sorted(perm.tolist()) == list(range(32)) and perm[:12].tolist() == list(range(12)) and perm[16:28].tolist() == list(range(12, 24))
    torch.manual_seed(0)
    T, H = 40, 3
    q, k = torch.randn(1, H, T, 32), torch.randn(1, H, T, 32)
    pos = torch.arange(0, 4 * T, 4)
    ours = Phi3RotaryEmbedding(cfg, ORIGINAL)  # built for ORIGINAL tokens: short factors
    cos, sin = HFRope(cfg)(q, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    oc, os_ = ours(pos, torch.float32)  # [T, 1, 32]
    qp, kp = (x[0].transpose(0, 1)[..., perm] for x in (q, k))  # [T, H, 32], our slot order
    q_ours, k_ours = qp * oc + rotate_half(qp) * os_, kp * oc + rotate_half(kp) * os_
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1)[..., perm])  # the same numbers, slots permuted
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1)[..., perm])
    long = Phi3RotaryEmbedding(cfg, ORIGINAL + 1)  # built for more: long factors
    assert not torch.equal(long.cos_cache[: 4 * T], ours.cos_cache[: 4 * T])


@pytest.mark.parametrize("rope_type", ["longrope", "su"])  # "su": the name in early Phi-3 hub configs
def test_longrope_tables_equal_hf_for_hub_spelled_configs(rope_type):
    """A config spelled as the hub's Phi-3-mini-128k (``rope_scaling`` with ``type``,
    top-level ``original_max_position_embeddings``): built for at most the original length our
    table is HF's short-factor RoPE, built for more it is HF's after its switch to long factors."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as HFRope

    from pagedserve.model.phi3 import Phi3RotaryEmbedding

    scaling = {"type": rope_type, "short_factor": _factors(16, 1), "long_factor": _factors(16, 2)}
    cfg = transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, num_hidden_layers=1, vocab_size=64, max_position_embeddings=4096,
        original_max_position_embeddings=256, rope_scaling=scaling, rope_theta=10000.0, sliding_window=262144,
    )  # fmt: skip
    x = torch.zeros(1)
    short_pos, long_pos = torch.arange(0, 256), torch.arange(0, 300)
    hf = HFRope(cfg)
    for built, pos in ((256, short_pos), (4096, long_pos)):  # HF picks long factors once a sequence passes 256
        cos, sin = hf(x, pos[None])
        ours = Phi3RotaryEmbedding(cfg, built)
        assert torch.equal(ours.cos_cache[pos], cos[0]) and torch.equal(ours.sin_cache[pos], sin[0])


# -- greedy equal to HF --------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf(phi3_model, case):
    path = phi3_model(case)
    prompts = _prompts(SHORT)
    llm = _llm(path)
    model = llm.llm_engine.core.worker.model
    assert type(model).__name__ == "Phi3ForCausalLM"
    if case == "phi3-mini-4k":
        assert {layer.self_attn.sliding_window for layer in model.layers} == {WINDOW}
    else:  # a window longer than the context is dropped: the C kernels stay usable
        assert all(layer.self_attn.sliding_window is None for layer in model.layers)
    _assert_hf_greedy(_hf(path), prompts, _greedy(llm, prompts, 8))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_hf_long_prompts(phi3_model, case):
    path = phi3_model(case)
    prompts = _prompts(LONG, seed=1)
    _assert_hf_greedy(_hf(path), prompts, _greedy(_llm(path, num_kv_blocks=400), prompts, 12))


def test_long_factors_when_built_past_the_original_length(phi3_model):
    path = phi3_model("phi4-mini")
    prompts = _prompts(SHORT, seed=2)
    ours = _greedy(_llm(path, max_model_len=2 * ORIGINAL), prompts, 8)
    _assert_hf_greedy(_hf(path, long_factors=True), prompts, ours)


# -- engine paths: chunks across the window edge, prefix hits, preemption ----------------------
@pytest.mark.parametrize("case", ["phi3-mini-4k", "phi4-mini"])
def test_chunked_prefill_prefix_hits_and_preemption_equal_hf(phi3_model, case):
    path = phi3_model(case)
    prompts = _prompts((70, 97, 130), seed=3)
    hf = _hf(path)
    # 20-token chunks: the 3rd straddles the 48-token window edge
    llm = _llm(path, max_num_batched_tokens=20, enable_prefix_caching=True, block_size=16)
    first = _greedy(llm, prompts, 8)
    again = _greedy(llm, prompts, 8)  # each full prompt block a prefix hit
    assert llm.stats().prefix_cache_hits >= 64
    _assert_hf_greedy(hf, prompts, first, check_generate=0)
    assert again == first
    del llm
    # 10 blocks of 16 tokens; 4 requests admitted at 2 blocks each grow to 5 (4 with the window)
    small = _llm(path, num_kv_blocks=10, block_size=16, max_model_len=160)
    many = _prompts((20, 25, 30, 18), seed=4)
    outs = _greedy(small, many, 60)
    assert small.stats().num_preemptions > 0
    _assert_hf_greedy(hf, many, outs, check_generate=0)


# -- loose agreement: int8 KV cache, bf16 -----------------------------------------------------
def _assert_in_hf_top5(hf, prompts, outs) -> None:
    """Each of our greedy tokens is in HF's float32 top 5 along our own sequence."""
    for p, ours in zip(prompts, outs):
        top = _hf_rows(hf, p, ours).topk(5).indices
        assert all(t in row.tolist() for t, row in zip(ours, top)), (ours, top)


@pytest.mark.parametrize("case", ["phi3-mini-4k", "phi4-mini"])
def test_int8_kv_cache_stays_close(phi3_model, case):
    """int8 K/V (per token and head scales, tests/ops/test_kv_int8.py): every greedy token in
    HF's top 5 along our sequence; random models this small diverge from the float path within
    a few tokens, so exact agreement is not the bar."""
    path = phi3_model(case)
    prompts = _prompts(SHORT, seed=5)
    _assert_in_hf_top5(_hf(path), prompts, _greedy(_llm(path, kv_cache_dtype="int8"), prompts, 16))


def test_bf16_tokens_in_hf_top5(phi3_model):
    path = phi3_model("phi4-mini")
    prompts = _prompts(SHORT[:4], seed=6)
    _assert_in_hf_top5(_hf(path), prompts, _greedy(_llm(path, dtype="bfloat16"), prompts, 8))


def test_pooling_runner_gives_hf_last_hidden_state(phi3_model):
    """``runner="pooling"`` just works: the permuted q/k layout never shows in hidden states."""
    from transformers import AutoModel

    path = phi3_model("phi4-mini")
    ids = _prompts((35,), seed=9)[0]
    llm = _llm(path, runner="pooling", pooler_config={"pooling_type": "LAST", "normalize": False})
    ours = torch.tensor(llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.embedding)
    with torch.no_grad():
        want = AutoModel.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_lora_is_refused(phi3_model):
    with pytest.raises(ValueError, match="LoRA is not supported for model_type 'phi3'"):
        _llm(phi3_model("phi4"), enable_lora=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["phi3-mini-4k", "phi4-mini"])
def test_tp2_equals_hf(phi3_model, case):
    """TP 2: the fused qkv / gate_up tensors split before sharding, q/k permuted per head."""
    path = phi3_model(case)
    prompts = _prompts((23, 64, 97), seed=7)
    tp = _llm(path, num_threads=2, tensor_parallel_size=2, num_kv_blocks=48, max_model_len=256, max_num_batched_tokens=24)
    try:
        outs = _greedy(tp, prompts, 10)
    finally:
        tp.llm_engine.core.shutdown()
    _assert_hf_greedy(_hf(path), prompts, outs, check_generate=0)


# -- GGUF (llama.cpp's phi3 layout: attn_qkv, ffn_up = gate+up, rope factor tensors) -------------
def _write_phi3_gguf(hf_dir: str, path: str, qtype: str) -> str:
    """The HF checkpoint's tensors as llama.cpp's converter (``Phi3MiniModel``) writes them:
    2-D weights in ``qtype``, the metadata it sets, the LongRoPE factors as tensors; the tiny
    byte-level tokenizer of tests/gguf_utils.py (the model's vocab is its 264 tokens)."""
    import json

    import gguf
    import numpy as np
    from gguf_utils import _byte_chars
    from safetensors.torch import load_file

    with open(f"{hf_dir}/config.json") as fh:
        cfg = json.load(fh)
    rope = cfg["rope_parameters"]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * (cfg.get("head_dim") or hidden // heads))
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_chars() + [m.replace(" ", "") for m in merges]
    assert len(tokens) == cfg["vocab_size"]
    w = gguf.GGUFWriter(path, "phi3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    w.add_vocab_size(len(tokens))
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    qt = gguf.GGMLQuantizationType[qtype]
    for name, t in load_file(f"{hf_dir}/model.safetensors").items():
        stem = name.removeprefix("model.").removesuffix(".weight")
        if stem.startswith("layers."):
            _, i, part = stem.split(".", 2)
            gname = f"blk.{i}.{names[part]}.weight"
        else:
            gname = f"{names[stem]}.weight"
        arr = t.float().numpy()
        if arr.ndim == 2 and qtype != "F32":
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _prompt_logprobs(llm: LLM, prompts) -> list[torch.Tensor]:
    """Each prompt token's logprob (teacher forcing over the prompt), per prompt."""
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [torch.tensor([e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]) for o in outs]


@pytest.mark.parametrize("case", [pytest.param("phi3-mini-4k", marks=pytest.mark.slow), "phi4-mini"])
def test_gguf_equals_safetensors(tmp_path, monkeypatch, case):
    import os

    from pagedserve.platform import cache_dir

    # The converted GGUF folder goes to a temporary cache; the compiled kernels are shared.
    os.makedirs(tmp_path / "cache")
    os.makedirs(os.path.join(cache_dir(), "kernels"), exist_ok=True)  # a fresh machine may have none yet
    os.symlink(os.path.join(cache_dir(), "kernels"), tmp_path / "cache" / "kernels")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    hf_dir = _make_phi3(str(tmp_path / "hf"), {**CASES[case], "vocab_size": 264})
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 264, (n,), generator=g).tolist() for n in (23, 64, 97)]
    want = _prompt_logprobs(_llm(hf_dir), prompts)
    f32 = _llm(_write_phi3_gguf(hf_dir, str(tmp_path / "f32.gguf"), "F32"))
    config = f32.llm_engine.core.worker.hf_config
    assert (config.sliding_window, config.rope_parameters["rope_type"]) == (
        CASES[case].get("sliding_window"),
        CASES[case].get("rope_parameters", {}).get("rope_type", "default"),
    )
    for a, b in zip(_prompt_logprobs(f32, prompts), want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    del f32
    q8 = _llm(_write_phi3_gguf(hf_dir, str(tmp_path / "q8.gguf"), "Q8_0"))
    assert q8.llm_engine.core.worker.weights.kinds  # served quantized
    for a, b in zip(_prompt_logprobs(q8, prompts), want):
        assert (a - b).abs().mean() < 0.05, (a - b).abs().mean()


@pytest.mark.parametrize(
    "rope, field",
    [
        ({"rope_type": "longrope", "short_factor": [0, 0, 0, 0], "long_factor": [1, 1, 1, 1]}, "short_factor"),
        ({"rope_type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [1, -2, 1, 1]}, "long_factor"),
        ({"rope_type": "longrope", "short_factor": [1, 1, 1, float("nan")], "long_factor": [1, 1, 1, 1]}, "short_factor"),
        ({"rope_type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [1, 1, 1, 1], "attention_factor": -1.0}, "attention_factor"),
        ({"rope_type": "linear", "factor": 0}, "factor"),
    ],
)
def test_bad_rope_factors_are_refused(rope, field):
    """A zero, negative or NaN LongRoPE factor would turn every rotation into NaN (the output
    then silently becomes token 0): refused when the config is checked (GGUF metadata too)."""
    from pagedserve.model.file_headers import ModelFileError
    from pagedserve.model.validation import check_config

    with pytest.raises(ModelFileError, match=field):
        check_config("c.json", {"model_type": "phi3", "rope_parameters": rope})


def test_unknown_layer_types_are_refused():
    """A layer_types entry other than full/sliding attention is refused, not run as full attention."""
    from pagedserve.model.file_headers import ModelFileError
    from pagedserve.model.validation import check_config

    with pytest.raises(ModelFileError, match="chunked_attention"):
        check_config("c.json", {"model_type": "qwen2", "layer_types": ["full_attention", "chunked_attention"]})
    check_config("c.json", {"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]})
