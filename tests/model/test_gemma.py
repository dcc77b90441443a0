"""Gemma 2 and Gemma 3 (text) against HF transformers on the same random weights.

Each tiny model keeps the real configs' structure scaled down: GQA 4/2 with ``head_dim`` 32
(not hidden / heads), ``query_pre_attn_scalar`` unlike head_dim, local layers with a 16-token
window beside global ones; Gemma 2 with both softcaps (set low so they bite), Gemma 3 with
q/k norms and two RoPE tables (local theta 1,000, global 100,000 with linear scaling). Every
1-D weight (the ``1 + w`` norm scales) is random too. Checked: greedy output equal to HF's
(float32) on 8 prompts of 5-130 tokens (300-600 in the slow test), again with chunked prefill
whose chunks straddle the window edge, prefix-cache hits, preemption and TP 2; close with the int8
KV cache; top-5 agreement in bfloat16; hub-style and multimodal ``gemma3`` checkpoints and
llama.cpp-style GGUF files (F32 exact, Q8_0 close) load.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TINY_VOCAB, _smollm2_dir, assert_engine_idle
from safetensors.torch import load_file, save_file
from test_model_hf import _hf_model, check_decode_logits, compare_with_hf, hf_greedy, our_prefill_logits

from pagedserve import LLM, SamplingParams

WINDOW = 16
NEW_TOKENS = 10
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}


def make_gemma(kind: str, path: str) -> str:
    """Save a tiny random ``gemma2`` / ``gemma3_text`` model with SmolLM2's tokenizer."""
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        cls = transformers.Gemma2ForCausalLM
    else:
        cfg = transformers.Gemma3TextConfig(**common, rope_parameters=json.loads(json.dumps(GEMMA3_ROPE)), layer_types=LAYER_TYPES)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)  # well separated greedy choices
            else:
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(_smollm2_dir()).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def gemma(request, tmp_path_factory):
    """(model dir, HF float32 model) per kind."""
    path = make_gemma(request.param, str(tmp_path_factory.mktemp(request.param)))
    return path, _hf_model(path, attn_implementation="eager")


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([5, 12, 17, 30, 47, 64, 90, 130])  # the window is 16 tokens


def _greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def hf_reference(gemma):
    """HF's cached greedy continuation of every prompt."""
    return [hf_greedy(gemma[1], p, NEW_TOKENS) for p in PROMPTS]


def test_gemma_logits_and_greedy_match_hf(gemma, hf_reference):
    path, hf = gemma
    llm = LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)
    assert _greedy(llm, PROMPTS) == hf_reference
    reports = compare_with_hf(llm, hf, ["The capital of France is", "Once upon a time, in a land far away, there lived a king who"], 12)
    assert all(r["identical"] for r in reports), reports
    check_decode_logits(llm, hf, "Paged attention stores the key/value cache in fixed-size blocks so that", 24)


def test_gemma_chunked_prefill_prefix_hits_and_preemption(gemma, hf_reference):
    path, _ = gemma
    # 12-token chunks: chunk edges fall at 12, 24, 36, ... across the 16-token window's edge.
    llm = LLM(path, dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=12, enable_prefix_caching=True)
    assert _greedy(llm, PROMPTS) == hf_reference
    assert _greedy(llm, PROMPTS[-3:]) == hf_reference[-3:]  # the same prompts again: prefix hits
    assert llm.stats().prefix_cache_hits > 0
    assert_engine_idle(llm)
    del llm
    # A pool of 40 blocks (320 tokens) for 8 requests that need ~60 blocks: preemptions.
    small = LLM(path, dtype="float32", num_kv_blocks=40, block_size=8, max_model_len=256, enable_prefix_caching=False)
    assert _greedy(small, PROMPTS) == hf_reference
    assert small.stats().num_preemptions > 0
    assert_engine_idle(small)


def test_gemma_int8_kv_cache_stays_close(gemma, hf_reference):
    """The int8 cache: greedy output does not depend on batching, chunking or prefix hits, and
    stays close to HF's float32 (first 4 tokens equal on at least 6 of 8 prompts)."""
    path, _ = gemma
    llm = LLM(path, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=256, block_size=8)
    batched = _greedy(llm, PROMPTS)
    again = _greedy(llm, PROMPTS)
    del llm
    chunked = LLM(path, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=256, block_size=8, max_num_batched_tokens=12, enable_prefix_caching=False)
    assert _greedy(chunked, PROMPTS) == batched == again
    close = sum(ours[:4] == ref[:4] for ours, ref in zip(batched, hf_reference))
    assert close >= 6, (batched, hf_reference)


def test_gemma_bf16_agrees_with_hf_top5(gemma):
    """bfloat16 on the CPU paths (packed matmuls, C attention for global layers): each greedy
    token of ours is in HF float32's top-5 along our sequence."""
    path, hf = gemma
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=256, block_size=8)
    outs = _greedy(llm, PROMPTS[2:6])
    for prompt, ours in zip(PROMPTS[2:6], outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        top5 = logits.topk(5).indices
        assert all(t in top5[i].tolist() for i, t in enumerate(ours)), (ours, top5[:, 0].tolist())


@pytest.mark.slow
def test_gemma_tp2_matches_hf(gemma, hf_reference):
    """Tensor parallelism 2 (gloo workers): greedy output still HF's, with chunked prefill."""
    path, _ = gemma
    tp = LLM(path, dtype="float32", num_threads=2, tensor_parallel_size=2, num_kv_blocks=256, block_size=8, max_num_batched_tokens=24)
    try:
        assert _greedy(tp, PROMPTS) == hf_reference
        assert tp.llm_engine.core.worker.model_runner.model.layers[0].self_attn.num_kv_heads == 1  # rank 0's share
    finally:
        tp.llm_engine.core.shutdown()


@pytest.mark.slow
def test_gemma_long_prompts_match_hf(gemma):
    path, hf = gemma
    prompts = _prompts([300, 450, 600], seed=1)
    want = [hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(path, dtype="float32", num_kv_blocks=512, block_size=16, max_num_batched_tokens=100)
    assert _greedy(llm, prompts, 8) == want


# -- config spellings and checkpoint layouts ------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_gemma("gemma3_text", str(tmp_path_factory.mktemp("gemma3-src")))


def test_hub_style_gemma3_config_loads_as_hf_reads_it(gemma3_dir, tmp_path):
    """A config.json as the hub has them (rope_theta, rope_local_base_freq,
    sliding_window_pattern, rope_scaling; no layer_types / rope_parameters) gives HF's model."""
    import shutil

    dst = str(tmp_path / "hub")
    shutil.copytree(gemma3_dir, dst)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    for k in ("layer_types", "rope_parameters"):
        cfg.pop(k, None)
    cfg.update(rope_theta=50000.0, rope_local_base_freq=500.0, sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 4.0})
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    hf = _hf_model(dst, attn_implementation="eager")
    assert hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    llm = LLM(dst, dtype="float32", num_kv_blocks=128, block_size=8)
    model = llm.llm_engine.core.worker.model_runner.model
    assert [layer.self_attn.sliding_window for layer in model.layers] == [WINDOW, WINDOW, None, WINDOW]
    ids = PROMPTS[5]
    diff = (our_prefill_logits(llm, ids) - hf(torch.tensor([ids])).logits[0]).abs().max().item()
    assert diff < 1e-3
    assert _greedy(llm, PROMPTS[4:6]) == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS[4:6]]


def test_hub_style_gemma2_config_loads_as_hf_reads_it(tmp_path):
    """Gemma 2 as on the hub: rope_theta, hidden_act beside hidden_activation,
    cache_implementation; no layer_types (even layers local) / rope_parameters."""
    dst = make_gemma("gemma2", str(tmp_path / "hub2"))
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    for k in ("layer_types", "rope_parameters"):
        cfg.pop(k, None)
    cfg.update(rope_theta=3000.0, hidden_act="gelu_pytorch_tanh", cache_implementation="hybrid")
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh)
    hf = _hf_model(dst, attn_implementation="eager")
    llm = LLM(dst, dtype="float32", num_kv_blocks=128, block_size=8)
    model = llm.llm_engine.core.worker.model_runner.model
    assert [layer.self_attn.sliding_window for layer in model.layers] == [WINDOW, None, WINDOW, None]
    assert _greedy(llm, PROMPTS[4:6]) == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS[4:6]]


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_multimodal_gemma3_checkpoint_serves_its_text_model(gemma3_dir, tmp_path, layout):
    """A ``gemma3`` checkpoint (text_config + vision weights): the text weights under
    ``language_model.model.*`` (hub files) or ``model.language_model.*`` (transformers 5), the
    vision tower skipped; logits equal to the text-only checkpoint's."""
    import shutil

    dst = str(tmp_path / layout)
    shutil.copytree(gemma3_dir, dst)
    st = os.path.join(dst, "model.safetensors")
    tensors = load_file(st)
    prefix = "language_model.model." if layout == "hub" else "model.language_model."
    vision = "vision_tower." if layout == "hub" else "model.vision_tower."
    renamed = {prefix + k[len("model.") :]: v for k, v in tensors.items()}
    renamed[vision + "vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 4, 4)
    save_file(renamed, st, metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        text = json.load(fh)
    with open(cfg_path, "w") as fh:
        json.dump({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}, fh)
    ref = LLM(gemma3_dir, dtype="float32", num_kv_blocks=64, block_size=8)
    want = our_prefill_logits(ref, PROMPTS[4])
    del ref
    llm = LLM(dst, dtype="float32", num_kv_blocks=64, block_size=8)
    assert torch.equal(our_prefill_logits(llm, PROMPTS[4]), want)


def test_refused_features(gemma3_dir):
    from pagedserve.model.file_headers import ModelFileError
    from pagedserve.model.validation import check_config

    with pytest.raises(ValueError, match="LoRA"):
        LLM(gemma3_dir, dtype="float32", num_kv_blocks=64, enable_lora=True)
    with pytest.raises(ModelFileError, match="hidden_activation"):
        check_config("c.json", {"model_type": "gemma2", "hidden_activation": "relu"})
    with pytest.raises(ModelFileError, match="query_pre_attn_scalar"):
        check_config("c.json", {"model_type": "gemma3", "text_config": {"query_pre_attn_scalar": -1}})


@pytest.mark.parametrize("window", [0, None])
def test_local_layers_without_a_window_are_refused(gemma3_dir, tmp_path, window):
    """sliding_window 0 or null would run Gemma's local layers as global ones: refused."""
    import shutil

    from pagedserve.model.file_headers import ModelFileError

    dst = str(tmp_path / "nowindow")
    shutil.copytree(gemma3_dir, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["sliding_window"] = window
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    with pytest.raises((ModelFileError, ValueError), match="sliding_window"):
        LLM(dst, dtype="float32", num_kv_blocks=64)


# -- GGUF ----------------------------------------------------------------------------------------
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gemma_gguf(hf_dir: str, path: str, arch: str, qtype: str) -> str:
    """A GGUF of an HF Gemma checkpoint as llama.cpp's converter writes one: its names, norms
    stored as ``1 + w`` (float32), the metadata of ``conversion/gemma.py``; 2-D weights in
    ``qtype``. The tokenizer is gguf_utils' byte-level BPE (the model's vocabulary is its size)."""
    import gguf
    import numpy as np
    from gguf_utils import _byte_chars

    with open(os.path.join(hf_dir, "config.json")) as fh:
        cfg = json.load(fh)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_chars() + [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        full, local = cfg["rope_parameters"]["full_attention"], cfg["rope_parameters"]["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        arr = t.float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        stem = name[len("model.") :].rsplit(".", 1)[0]
        if stem.startswith("layers."):
            _, i, part = stem.split(".", 2)
            gname = f"blk.{i}.{_TO_GGUF[part]}.weight"
        else:
            gname = {"embed_tokens": "token_embd", "norm": "output_norm"}[stem] + ".weight"
        if arr.ndim == 2 and qtype != "F32":
            w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_gguf_loads_as_the_safetensors_checkpoint(kind, tmp_path, monkeypatch):
    """llama.cpp's layout (names, ``1 + w`` norms, metadata): F32 gives the safetensors
    checkpoint's logits exactly; Q8_0 stays close (same top-1 on most rows)."""
    import transformers

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    common = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  query_pre_attn_scalar=32, max_position_embeddings=512, sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:  # 6 layers: llama.cpp's fixed pattern (5 local, 1 global)
        cfg = transformers.Gemma3TextConfig(**common, num_hidden_layers=6, rope_parameters=json.loads(json.dumps(GEMMA3_ROPE)))
        model = transformers.Gemma3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(4.0 * torch.randn_like(p) * 0.02 if p.dim() >= 2 else 0.5 * torch.randn_like(p))
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    transformers.AutoTokenizer.from_pretrained(_smollm2_dir()).save_pretrained(hf_dir)
    arch = "gemma2" if kind == "gemma2" else "gemma3"
    ids = _prompts([40], seed=3)[0]
    ids = [i % 264 for i in ids]
    ref = LLM(hf_dir, dtype="float32", num_kv_blocks=32, block_size=8)
    want = our_prefill_logits(ref, ids)
    del ref
    f32 = LLM(write_gemma_gguf(hf_dir, str(tmp_path / "m-f32.gguf"), arch, "F32"), dtype="float32", num_kv_blocks=32, block_size=8)
    assert torch.equal(our_prefill_logits(f32, ids), want)
    del f32
    q8_path = write_gemma_gguf(hf_dir, str(tmp_path / "m-q8.gguf"), arch, "Q8_0")
    for dtype, agree in (("float32", 0.9), ("bfloat16", 0.8)):  # bf16: the default on CPUs, weights kept in Q8_0
        q8 = LLM(q8_path, dtype=dtype, num_kv_blocks=32, block_size=8)
        got = our_prefill_logits(q8, ids)
        del q8
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item() * (1 if dtype == "float32" else 2), dtype
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= agree, dtype


def test_pooling_runner_embeds_as_hf_last_hidden_state(gemma3_dir):
    """``runner="pooling"``: the mean of the final normed hidden states, as HF's
    ``Gemma3TextModel.last_hidden_state`` (the windowed layers included: 40 tokens > 16)."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(gemma3_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = PROMPTS[4][:40]
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)
    llm = LLM(gemma3_dir, runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False}, dtype="float32", num_kv_blocks=64, block_size=8)
    got = torch.tensor(llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cpu_fused_rope_path_reads_each_layers_table(gemma, hf_reference):
    """The CPU backend's fused RoPE + KV write (taken in bf16 where the CPU has AVX512-BF16),
    forced on here in float32: each layer's C RoPE reads its own table (Gemma 3: local or
    global), global layers' prefill runs in the C kernel, local ones read the cache in PyTorch."""
    path, _ = gemma
    llm = LLM(path, dtype="float32", num_kv_blocks=256, block_size=8)
    backend = llm.llm_engine.core.worker.model_runner.model.backend
    if backend.name != "cpu-kernels":
        pytest.skip("no compiled CPU kernels")
    backend.fused_rope = True
    assert _greedy(llm, PROMPTS) == hf_reference
