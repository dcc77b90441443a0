"""Mixture-of-experts models (``pagedserve.model.moe``: Mixtral, Qwen2-MoE, Qwen3-MoE) against
HF transformers on the same random weights, loaded through the user's path (``LLM(dir)``).

Each tiny model keeps its family's layout scaled down: Mixtral (top-2 of 4 experts, always
renormalised, a sliding window of 32 tokens), Qwen2-MoE (qkv bias, top-2 of 6 unnormalised, a
sigmoid-gated shared expert), Qwen3-MoE (q/k norm, top-3 of 8 renormalised, a dense layer from
``mlp_only_layers``). 1-D weights are randomised (HF initialises them to 0 / 1). Checks: float32
greedy equal to HF (teacher-forced argmax and logits within 1e-3); equal again with chunked
prefill, prefix hits and preemption; the MoE block equal to HF's block (ties included) and
independent of its batch neighbours; transformers 5's fused 3-D expert tensors load to the same
model; bf16 and the int8 KV cache close to HF; the pooling runner; LoRA refused. Long prompts and TP 2 are in
the slow suite.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY_VOCAB, _smollm2_dir, assert_engine_idle
from logits_utils import capture_logits
from test_model_hf import BF16_LOGIT_TOL, PROMPTS, compare_with_hf, hf_logits, our_prefill_logits

from pagedserve import LLM, SamplingParams

COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
)
CASES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32, mlp_only_layers=[1]),
}
KINDS = list(CASES)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _classes(kind: str):
    import transformers

    return {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[kind]


def make_moe_model(kind: str, path: str, seed: int = 0, **overrides) -> str:
    """Save a random tiny ``kind`` model (2-D weights x4 so greedy choices are well apart, 1-D
    weights random) with SmolLM2's tokenizer; returns ``path``."""
    from transformers import AutoTokenizer

    cfg_cls, model_cls = _classes(kind)
    config = cfg_cls(**{**COMMON, **CASES[kind], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.copy_(1.0 + 0.5 * torch.randn_like(p) if name.endswith("norm.weight") else 0.5 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(_smollm2_dir()).save_pretrained(path)
    return path


def _hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = make_moe_model(kind, str(tmp_path_factory.mktemp(f"moe-{kind}") / "model"))
        return cache[kind]

    return get


def _hf_argmax_along(hf, prompt_ids: list[int], ours: list[int]) -> list[int]:
    """HF's greedy choice at each of our generated positions (teacher forcing on our sequence)."""
    P = len(prompt_ids)
    return hf_logits(hf, prompt_ids + ours)[P - 1 : P - 1 + len(ours)].argmax(-1).tolist()


def _long_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 5000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


# -- the whole model against HF ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_moe_matches_hf(kind, moe_dir):
    path = moe_dir(kind)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256)
    model = llm.llm_engine.core.worker.model_runner.model
    assert type(model).__name__ == "MoeForCausalLM" and not model.c_step_ok
    reports = compare_with_hf(llm, _hf(path), PROMPTS, max_new_tokens=16, num_hf_generate=int(kind == "qwen3_moe"))
    assert all(r["identical"] for r in reports), reports


@pytest.mark.parametrize("kind", KINDS)
def test_moe_chunked_prefill_prefix_hits_and_preemption(kind, moe_dir):
    """Prompts of 36-72 tokens (past Mixtral's window of 32) in chunks of 16 tokens, 5 requests
    on a pool too small for all of them (preemption), then one prompt twice (a prefix hit):
    every output equals HF's greedy argmax along it."""
    path = moe_dir(kind)
    hf = _hf(path)
    prompts = _long_prompts(5, 36, 72, seed=1)
    llm = LLM(path, dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=128, max_num_batched_tokens=16, enable_prefix_caching=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    stats = llm.stats()
    assert stats.num_preemptions > 0, stats
    for p, out in zip(prompts, first):
        assert out == _hf_argmax_along(hf, p, out)
    # The same prompt twice in a row: the second run's full blocks are prefix-cache hits.
    again = [list(llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(2)]
    assert llm.stats().prefix_cache_hits >= len(prompts[0]) // 8 * 8 - 8, llm.stats()
    assert again == [first[0], first[0]]
    assert_engine_idle(llm)


# -- the MoE block alone ------------------------------------------------------------------------------
def _block_pair(kind: str, seed: int = 0):
    """(our SparseMoeBlock, HF's sparse MoE block) with the same random weights."""
    from pagedserve.model.moe import SparseMoeBlock, canonical_weights

    cfg_cls, model_cls = _classes(kind)
    config = cfg_cls(**{**COMMON, **CASES[kind], "num_hidden_layers": 1, "vocab_size": 64, "mlp_only_layers": []})
    torch.manual_seed(seed)
    hf_layer = model_cls(config).model.layers[0]
    hf_block = hf_layer.mlp
    with torch.no_grad():
        for p in hf_block.parameters():
            p.normal_(0.0, 0.3)
    ours = SparseMoeBlock(config)
    params = dict(ours.named_parameters())
    state = {f"layers.0.mlp.{k}": v for k, v in hf_block.state_dict().items()}
    for name, t in canonical_weights(state.items()):
        local = name[len("layers.0.mlp.") :]
        for src, dst, part in (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)):
            if f".{src}." in local:
                local = local.replace(src, dst)
                half = params[local].shape[0] // 2
                params[local].data[part * half : (part + 1) * half] = t
                break
        else:
            params[local].data.copy_(t)
    return ours.eval(), hf_block.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_moe_block_equals_hf_block_with_ties(kind):
    from pagedserve.model.backends import TorchBackend

    ours, hf_block = _block_pair(kind)
    with torch.no_grad():
        # Two experts with identical router rows: every token ties between them (topk breaks the
        # tie the same way on both sides); the experts' weights differ, so a different pick shows.
        ours.gate.weight[2] = ours.gate.weight[1]
        hf_block.gate.weight[2] = hf_block.gate.weight[1]
        x = torch.randn(20, COMMON["hidden_size"])
        want = hf_block(x[None])[0]
        got = ours(x, TorchBackend())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_moe_row_does_not_depend_on_its_batch_neighbours(kind):
    """A row's experts and output are those it gets alone, even when every row of the batch picks
    the same expert (no capacity limit, no padding)."""
    from pagedserve.model.backends import TorchBackend

    ours, _ = _block_pair(kind, seed=1)
    backend = TorchBackend()
    with torch.no_grad():
        x = torch.randn(32, COMMON["hidden_size"])
        crowd = x.clone()
        crowd[:16] = crowd[:16] + 5.0 * torch.sign(ours.gate.weight[1])  # half the batch crowds expert 1
        w, ids = ours.route(crowd)
        assert int((ids == 1).any(-1).sum()) >= 16
        batch = ours(crowd, backend)
        for i in range(crowd.shape[0]):
            w1, ids1 = ours.route(crowd[i : i + 1])
            assert torch.equal(ids1[0], ids[i])
            torch.testing.assert_close(ours(crowd[i : i + 1], backend)[0], batch[i], atol=1e-4, rtol=1e-4)  # matmul rounding with M


# -- checkpoint spellings -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_fused_3d_expert_tensors_load_the_same_model(kind, moe_dir, tmp_path):
    """transformers 5's in-memory layout (``mlp.experts.gate_up_proj [E, 2I, H]``,
    ``mlp.experts.down_proj [E, H, I]``) and the hub's per-expert tensors give equal logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = moe_dir(kind)
    dst = str(tmp_path / "fused")
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    proj = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            prefix = ".".join(parts[:i]).replace("block_sparse_moe", "mlp")
            experts.setdefault(prefix, {}).setdefault(int(parts[i + 1]), {})[proj[parts[i + 2]]] = t
        else:
            fused[name] = t
    for prefix, per in experts.items():
        E = len(per)
        fused[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate"], per[e]["up"]]) for e in range(E)])
        fused[f"{prefix}.experts.down_proj"] = torch.stack([per[e]["down"] for e in range(E)])
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file(fused, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    ids = _long_prompts(1, 30, 31, seed=3)[0]
    a = our_prefill_logits(LLM(src, dtype="float32", num_kv_blocks=16, max_model_len=128), ids)
    b = our_prefill_logits(LLM(dst, dtype="float32", num_kv_blocks=16, max_model_len=128), ids)
    assert torch.equal(a, b)


# -- other precisions -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,kw,tol",
    [
        ("qwen3_moe", dict(dtype="bfloat16"), BF16_LOGIT_TOL),
        ("qwen2_moe", dict(dtype="bfloat16"), BF16_LOGIT_TOL),
        ("mixtral", dict(dtype="float32", kv_cache_dtype="int8"), BF16_LOGIT_TOL),  # a flipped expert moves a row by ~1
    ],
)
def test_moe_bf16_and_int8_kv_stay_close_to_hf(kind, kw, tol, moe_dir):
    """bf16 weights (experts on the packed CPU matmuls, routers on F.linear) and the int8 KV
    cache: every logits row the sampler saw (prefill, then decode steps through the paged cache)
    within ``tol`` of HF float32's along the same sequence, and the same argmax in 85 % of them
    (the tiny random model's top logits are ~0.1 apart, so bf16 legitimately flips a few)."""
    from pagedserve.model.moe import FloatLinear
    from pagedserve.model.packed_linear import PackedLinear, packing_available

    path = moe_dir(kind)
    hf = _hf(path)
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, **kw)
    block = llm.llm_engine.core.worker.model_runner.model.layers[0].mlp
    assert type(block.gate) is FloatLinear
    if packing_available(torch.device("cpu"), torch.bfloat16) and kw["dtype"] == "bfloat16":
        assert isinstance(block.experts[0].gate_up_proj, PackedLinear) and isinstance(block.experts[-1].down_proj, PackedLinear)
    agree, total = 0, 0
    for p in _long_prompts(3, 20, 60, seed=2):
        with capture_logits(llm) as cap:
            out = list(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        rows = torch.cat(cap.rows)
        want = hf_logits(hf, p + out)[len(p) - 1 : len(p) - 1 + len(out)]
        diff = (rows - want).abs().max().item()
        assert diff < tol, f"logits differ by {diff}"
        agree += int((rows.argmax(-1) == want.argmax(-1)).sum())
        total += len(out)
    assert agree >= 0.85 * total, (agree, total)
    assert_engine_idle(llm)


def test_moe_lora_refused(moe_dir):
    with pytest.raises(ValueError, match="LoRA is not supported for model_type 'qwen2_moe'"):
        LLM(moe_dir("qwen2_moe"), dtype="float32", num_kv_blocks=16, enable_lora=True)


def test_moe_pooling_runner_embeds_like_hf(moe_dir):
    """``runner="pooling"`` needs only the final hidden states: LAST pooling, normalised, equals
    HF's last hidden state of the same model."""
    from transformers import AutoModel

    path = moe_dir("qwen2_moe")
    llm = LLM(path, dtype="float32", num_kv_blocks=16, max_model_len=128, runner="pooling")
    ids = _long_prompts(1, 30, 31, seed=8)[0]
    got = torch.tensor(llm.embed([{"prompt_token_ids": ids}])[0].outputs.embedding)
    with torch.no_grad():
        last = AutoModel.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).last_hidden_state[0, -1]
    assert llm.llm_engine.config.pooler.pooling_type == "LAST"
    torch.testing.assert_close(got, torch.nn.functional.normalize(last, dim=-1), atol=1e-5, rtol=1e-5)


def test_moe_flops_count_the_active_parameters():
    """The benchmark's MFU counts what one token touches: the issue's Qwen3-MoE layout (hidden
    1,024, 16 query / 4 KV heads of 64, top-4 of 32 experts of 768) is 0.29B layer + 0.05B head."""
    import transformers

    from pagedserve.bench.flops import model_flops

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=768, intermediate_size=6144,
    )  # fmt: skip
    attn = (16 + 2 * 4) * 64 * 1024 + 1024 * 16 * 64
    experts = 4 * 3 * 1024 * 768 + 32 * 1024  # 4 experts' gate/up/down, the router
    flops = model_flops(cfg)
    assert flops.layer_params == 24 * (attn + experts) and flops.lm_head_params == 49152 * 1024
    dense_one = model_flops(transformers.Qwen3MoeConfig(**{**cfg.to_dict(), "mlp_only_layers": [0]}))
    assert dense_one.layer_params == flops.layer_params - experts + 3 * 1024 * 6144


# -- slow: long prompts, tensor parallelism --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_moe_long_prompts_match_hf(kind, moe_dir):
    """8 prompts of 5-600 tokens in one batch (Mixtral's window of 32 far behind)."""
    path = moe_dir(kind)
    hf = _hf(path)
    prompts = _long_prompts(4, 5, 40, seed=4) + _long_prompts(4, 300, 600, seed=5)
    llm = LLM(path, dtype="float32", num_kv_blocks=400, max_model_len=1024)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    for p, out in zip(prompts, outs):
        assert out == _hf_argmax_along(hf, p, out)
    assert_engine_idle(llm)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_moe_tp2_equals_tp1(kind, moe_dir):
    """Each expert's intermediate dimension (and the shared expert's) split over 2 ranks, the
    router replicated, one all-reduce after the MoE block: greedy output equals TP 1."""
    path = moe_dir(kind)
    prompts = [{"prompt_token_ids": p} for p in _long_prompts(4, 20, 70, seed=6)]
    kw = dict(dtype="float32", num_kv_blocks=48, max_model_len=256, max_num_batched_tokens=24)
    ref = LLM(path, num_threads=1, **kw)
    want = [list(o.outputs[0].token_ids) for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    del ref
    tp = LLM(path, num_threads=2, tensor_parallel_size=2, **kw)
    try:
        got = [list(o.outputs[0].token_ids) for o in tp.generate(prompts, GREEDY, use_tqdm=False)]
        block = next(layer.mlp for layer in tp.llm_engine.core.worker.model_runner.model.layers if hasattr(layer.mlp, "experts"))
        assert block.experts[0].intermediate_size == (CASES[kind].get("moe_intermediate_size") or COMMON["intermediate_size"]) // 2
    finally:
        tp.llm_engine.core.shutdown()
    assert got == want
