"""The one-call C step (``csrc/decode_step.c``): decodes, prefill chunks and steps with both run
every layer in one C call, bit-identical to the layer-by-layer path, so neither batch size nor
chunking changes a sequence's greedy tokens.

Skipped where the step cannot run (no C compiler, no AVX512-BF16, AMX or AVX2 matmul)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_engine_idle
from pagedserve import LLM, SamplingParams
from pagedserve.model.backends import CpuBackend, cpu_backend
from pagedserve.ops import cpu as cpu_kernels
from pagedserve.ops.cpu import matmul


PROMPTS = [
    {"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 40, 130, 19, 64, 3)
]
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)


def _run(llm, prompts, params=LOGPROBS):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def _decode_step_calls(llm, monkeypatch, prefills=None):
    """Spy on the C step (a list of the row counts of its decode-only calls, cleared by the
    caller; calls with prefill tokens go to ``prefills`` when given) and run each of PROMPTS
    alone; skips where the step does not run. Returns (calls, alone outputs)."""
    calls = []
    real = matmul.decode_layers

    def spy(*a, **kw):
        (calls if kw.get("token_seq") is None else prefills if prefills is not None else []).append(a[1].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(matmul, "decode_layers", spy)
    alone = [_run(llm, p)[0] for p in PROMPTS]
    if not calls:
        pytest.skip("the C decode step does not run on this CPU")
    return calls, alone


def _randomize_norms(path):
    """HF initialises RMSNorm weights to 1, which would hide a mixed-up norm weight."""
    import os

    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    weights = load_file(f)
    g = torch.Generator().manual_seed(5)
    for name, t in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.2 * torch.randn(t.shape, generator=g).to(t.dtype)
    save_file(weights, f, metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decode_step_bit_identical_to_layer_by_layer(kind, tiny_model_factory, monkeypatch):
    """head_dim 64 (the attention kernel's fast path), GQA 2:1, qkv bias for qwen2. Decodes of
    any number of sequences and the prompts' prefills take the C step; the same requests with the
    C step disabled give identical tokens and logprobs, alone and batched, so batch size does not
    change the output."""
    path = tiny_model_factory(kind, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, num_hidden_layers=3)
    _randomize_norms(path)
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=512, max_model_len=512, max_num_seqs=128)
    prefills = []
    calls, alone = _decode_step_calls(llm, monkeypatch, prefills)
    assert set(calls) == {1}
    assert len(prefills) == len(PROMPTS)  # one prefill each (the uncached part of its prompt)
    for n in (2, 3, 4, 6):
        calls.clear()
        assert _run(llm, PROMPTS[:n]) == alone[:n]
        assert set(calls) == {n}
    calls.clear()
    assert _run(llm, PROMPTS * 3) == alone * 3  # 18 sequences: within the small-M limit too
    assert set(calls) == {18}
    reps = -(-(cpu_kernels.SMALL_GEMM_MAX_ROWS + 1) // len(PROMPTS))  # past 64 rows: the small-M kernel 64 at a time
    calls.clear()
    assert _run(llm, PROMPTS * reps) == alone * reps
    assert max(calls) == len(PROMPTS) * reps
    monkeypatch.setattr(CpuBackend, "decode_step", lambda *a: False)
    calls.clear()
    assert [_run(llm, p)[0] for p in PROMPTS] == alone and _run(llm, PROMPTS) == alone
    assert not calls
    assert_engine_idle(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_mixed_steps_in_one_c_call_equal_layer_by_layer(kv_cache_dtype, tiny_model_factory, monkeypatch):
    """A 24-token budget puts prefill chunks beside decodes in most steps; each such step takes
    the C step as one call (the decode and prefill groups merged into one block table, chunks
    attending to their earlier chunks in the cache). Tokens and logprobs equal the
    layer-by-layer path's, with the bf16 and the int8 cache."""
    path = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, num_hidden_layers=3)
    _randomize_norms(path)
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=512, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=24,
              kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    kinds = []
    real = cpu_backend._one_group
    monkeypatch.setattr(cpu_backend, "_one_group", lambda groups, n: kinds.append([g.is_decode for g in groups]) or real(groups, n))
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 900 + 10 for j in range(n)]} for i, n in enumerate((7, 40, 130, 19, 64, 3))]
    c_step = _run(llm, prompts)
    if not kinds:
        pytest.skip("the C step does not run on this CPU")
    assert [True, False] in kinds  # decodes and a prefill chunk in one call
    monkeypatch.setattr(CpuBackend, "decode_step", lambda *a: False)
    assert _run(llm, prompts) == c_step
    assert [_run(llm, p)[0] for p in prompts] == c_step
    assert_engine_idle(llm)


@pytest.mark.parametrize("inter", [512, 4160])
def test_steps_with_prefill_take_the_c_step_within_its_bounds(inter, tiny_model_factory, monkeypatch):
    """Prefills of up to C_STEP_MAX_PREFILL_ROWS tokens take the C step, longer ones the
    layer-by-layer path; where a small-M projection is wider than C_STEP_SMALL_GEMM_MAX_K
    (down_proj's input here with inter 4160) only those of up to C_STEP_WIDE_MAX_PREFILL_ROWS;
    decodes take it either way. Outputs equal the layer-by-layer path's."""
    path = tiny_model_factory("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=inter, num_hidden_layers=2)
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=256, max_model_len=1024, enable_prefix_caching=False)
    down = llm.llm_engine.core.worker.model.layers[0].mlp.down_proj
    small_m = getattr(down, "amx_weight", None) is None and getattr(down, "avx2_weight", None) is None
    limit = cpu_backend.C_STEP_MAX_PREFILL_ROWS
    prefills = []
    calls, _ = _decode_step_calls(llm, monkeypatch, prefills)
    wide = cpu_backend.C_STEP_WIDE_MAX_PREFILL_ROWS
    prompts = [{"prompt_token_ids": [(5 * j) % 700 + 10 for j in range(n)]} for n in (wide, wide + 1, limit, limit + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    prefills.clear()
    c_step = [_run(llm, p, params)[0] for p in prompts]
    assert prefills == ([wide] if small_m and inter > cpu_backend.C_STEP_SMALL_GEMM_MAX_K else [wide, wide + 1, limit])
    monkeypatch.setattr(CpuBackend, "decode_step", lambda *a: False)
    assert [_run(llm, p, params)[0] for p in prompts] == c_step
    assert_engine_idle(llm)


def test_decode_step_wide_projection_up_to_the_row_limit(tiny_model_factory, monkeypatch):
    """down_proj with K = 2048 (16 chunks of the kernel's k loop), which used to cap the C step at
    16 rows: 12, 18 and 60 decodes take the C step with the small-M kernel, and each sequence's
    tokens and logprobs equal its own run alone."""
    path = tiny_model_factory("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=2048, num_hidden_layers=2)
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=512, max_model_len=512, max_num_seqs=128)
    down = llm.llm_engine.core.worker.model.layers[0].mlp.down_proj
    if getattr(down, "amx_weight", None) is not None or getattr(down, "avx2_weight", None) is not None:
        pytest.skip("the AMX or AVX2 matmul takes any number of rows here")
    calls, alone = _decode_step_calls(llm, monkeypatch)
    for reps in (2, 3, cpu_kernels.SMALL_GEMM_MAX_ROWS // len(PROMPTS)):  # 12, 18, 60 decodes
        calls.clear()
        assert _run(llm, PROMPTS * reps) == alone * reps
        assert max(calls) == len(PROMPTS) * reps
    assert_engine_idle(llm)
