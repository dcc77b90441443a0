"""Quantized weights through the whole engine: the default GGUF file served as it is (no float
copy written), against the same file dequantized in memory; batching and chunking leave a row's
result unchanged; online int8 of a float checkpoint; the weights' kind in the model identity."""

from __future__ import annotations

import os

import pytest
import torch

from logits_utils import capture_logits
from pagedserve import LLM, SamplingParams
from pagedserve.model import loader
from pagedserve.model.quant_linear import QuantEmbedding, QuantLinear

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Paged attention stores the key/value cache in fixed-size blocks so that",
]


def _model(llm: LLM):
    return llm.llm_engine.core.worker.model_runner.model


def _worker(llm: LLM):
    return llm.llm_engine.core.worker


def _greedy(llm: LLM, prompts, n: int = 12):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def quant_llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512, num_threads=2)


def test_gguf_served_quantized_without_a_float_copy(quant_llm):
    worker = _worker(quant_llm)
    assert worker.weights.kind == "Q4_1+Q8_0"
    model = _model(quant_llm)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model._logits_linear, QuantLinear)  # the tied LM head reads the Q8_0 embedding
    assert model._logits_linear.qweight is model.embed_tokens.qweight
    # The file's quantized bytes, give or take the float32 scales (Q4_1: 20 bytes per 32 weights
    # in the file, 24 here; Q8_0: 34 -> 36).
    size = os.path.getsize(loader.default_model_path())
    assert 1.0 * size < worker.weights.quantized_bytes < 1.25 * size
    folder = worker.model_dir
    assert loader.gguf_source(folder) == os.path.abspath(loader.default_model_path())
    written = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    assert written < 20 << 20
    assert not [f for f in os.listdir(folder) if f.endswith(".safetensors")]


def test_quantized_matches_dequantized_in_memory(quant_llm):
    """float32 activations: the quantized path and the dequantized weights compute the same
    products (the same float32 weights), so logits agree to rounding and greedy tokens match."""
    ref = LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=32 << 20, max_model_len=512, num_threads=2)
    assert _worker(ref).weights.kind == "float32" and not isinstance(_model(ref).embed_tokens, QuantEmbedding)
    with capture_logits(quant_llm) as a:
        got = _greedy(quant_llm, PROMPTS[0])
    with capture_logits(ref) as b:
        want = _greedy(ref, PROMPTS[0])
    assert got[0][0] == want[0][0]
    diff = max((x - y).abs().max().item() for x, y in zip(a.rows, b.rows))
    assert diff < 2e-3, diff
    # Different weights never share KV: the model identity names the weights' kind.
    assert _worker(ref).model_identity != _worker(quant_llm).model_identity
    del ref


def test_quantized_rows_do_not_depend_on_the_batch(monkeypatch):
    """Every product on qgemm (each output a float32 sum in input order, whatever the rows
    around it; the default): each prompt alone, all together, and with a small token budget
    (chunked prefill) give identical tokens and logprobs, bit for bit. bf16, where the attention
    kernel also reads every K/V from the cache whatever the chunking (float32 prefill attention
    is PyTorch's SDPA, equal only to rounding)."""
    from pagedserve.ops.cpu import kernels as cpu_kernels

    if not cpu_kernels.prefill_kernel_preferred(torch.bfloat16, 9, 3, 64):
        pytest.skip("no vectorised bf16 attention kernel here: chunked prefill is equal only to rounding")
    monkeypatch.setenv("PAGEDSERVE_QGEMM_MAX_ROWS", "all")
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=32 << 20, max_model_len=512, num_threads=2)
    together = _greedy(llm, PROMPTS)
    alone = [_greedy(llm, p)[0] for p in PROMPTS]
    assert together == alone
    del llm
    chunked = LLM(dtype="bfloat16", kv_cache_memory_bytes=32 << 20, max_model_len=512, max_num_batched_tokens=16, num_threads=2)
    assert _greedy(chunked, PROMPTS) == together


def test_quantized_decode_with_drafts_and_preemption_matches_plain_decode(monkeypatch):
    """n-gram drafts (k + 1 rows verified in one step) and a pool small enough to preempt (the
    recompute is a prefill): greedy tokens and logprobs equal plain decoding's, bit for bit (bf16:
    see the test above)."""
    from pagedserve.ops.cpu import kernels as cpu_kernels

    if not cpu_kernels.prefill_kernel_preferred(torch.bfloat16, 9, 3, 64):
        pytest.skip("no vectorised bf16 attention kernel here: recompute is equal only to rounding")
    prompts = ["one two three four five one two three four five one two three four", "a b c d a b c d a b c d a b"]
    monkeypatch.setenv("PAGEDSERVE_QGEMM_MAX_ROWS", "all")
    plain = LLM(dtype="bfloat16", kv_cache_memory_bytes=32 << 20, max_model_len=512, num_threads=2)
    want = _greedy(plain, prompts, n=40)
    del plain
    spec = LLM(
        dtype="bfloat16",
        num_kv_blocks=7,
        max_model_len=112,
        num_threads=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    )
    assert _greedy(spec, prompts, n=40) == want
    stats = spec.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_preemptions > 0


def test_online_int8_of_a_float_checkpoint(tiny_model_factory):
    tiny_dir = tiny_model_factory("llama")
    ref = LLM(tiny_dir, dtype="float32", num_kv_blocks=32, max_model_len=128, num_threads=2)
    q = LLM(tiny_dir, dtype="float32", quantization="int8", num_kv_blocks=32, max_model_len=128, num_threads=2)
    assert _worker(q).weights.kind == "int8" and _worker(ref).weights.kind == "float32"
    layer = _model(q).layers[0]
    assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.qweight.group == layer.mlp.down_proj.in_features
    with capture_logits(ref) as a:
        _greedy(ref, PROMPTS[1], n=4)
    with capture_logits(q) as b:
        _greedy(q, PROMPTS[1], n=4)
    # Random weights: per-channel int8 moves the logits a little, never grossly.
    rel = (a.rows[0] - b.rows[0]).norm() / a.rows[0].norm()
    assert 0 < rel.item() < 0.05, rel.item()
    assert _worker(ref).model_identity != _worker(q).model_identity


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_tiny_quantized_gguf_equals_dequantized_and_shards_under_tensor_parallelism(qtype, tmp_path):
    """A tiny llama GGUF of one quantized type: served quantized, its logits equal the same file
    dequantized in memory to rounding; under tensor parallelism (2 ranks: rows of q/k/v and
    gate/up, columns of o/down cut on group boundaries before use) the greedy tokens are the
    single engine's."""
    from gguf_utils import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path / f"tiny-{qtype}.gguf"), hidden=64, inter=128, layers=2, heads=4, kv_heads=2, qtype=qtype)
    kw = dict(dtype="float32", num_kv_blocks=32, max_model_len=128)
    one = LLM(path, num_threads=2, **kw)
    assert _worker(one).weights.kind == qtype
    ref = LLM(path, num_threads=2, quantization="none", **kw)
    prompt = "the the in er"
    with capture_logits(one) as a:
        want = _greedy(one, prompt, n=8)
    with capture_logits(ref) as b:
        _greedy(ref, prompt, n=8)
    assert (a.rows[0] - b.rows[0]).abs().max().item() < 1e-3
    del ref
    tp = LLM(path, num_threads=1, tensor_parallel_size=2, **kw)
    try:
        got = _greedy(tp, prompt, n=8)
        assert got[0][0] == want[0][0]
        assert max(abs(x - y) for x, y in zip(got[0][1], want[0][1])) < 1e-3
    finally:
        del tp


def test_a_mistral_named_llama_gguf_is_unpermuted_too(tmp_path):
    """llama.cpp writes Mistral models as arch llama with Q/K rows permuted, and transformers'
    GGUF reader may name such a file's model_type "mistral" (from general.name). Its rows are
    un-permuted like any llama file's: the same weights named "Mistral-7B-tiny" give the "tiny"
    file's logits."""
    from gguf_utils import write_tiny_gguf

    kw = dict(dtype="float32", num_kv_blocks=16, max_model_len=64, num_threads=1)
    rows = []
    for name in ("tiny", "Mistral-7B-tiny"):
        llm = LLM(write_tiny_gguf(str(tmp_path / f"{name}.gguf"), qtype="Q8_0", name=name), **kw)
        assert _worker(llm).hf_config.model_type in ("llama", "mistral")
        with capture_logits(llm) as cap:
            _greedy(llm, "the the in er", n=2)
        rows.append(cap.rows[0])
        del llm
    assert (rows[0] - rows[1]).abs().max().item() < 1e-5


def test_float16_activations_bad_settings_and_int8_limits(tmp_path, monkeypatch, tiny_model_factory):
    """float16 activations on quantized weights are computed in float32 (equal to float32's
    logits to float16 rounding); a malformed PAGEDSERVE_QGEMM_MAX_ROWS and an int8 layer whose
    inputs are not a multiple of 16 are refused at start-up, naming what is wrong."""
    from gguf_utils import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path / "tiny-q8.gguf"), hidden=64, inter=128, layers=2, heads=4, kv_heads=2, qtype="Q8_0")
    kw = dict(num_kv_blocks=32, max_model_len=128, num_threads=2)
    half = LLM(path, dtype="float16", **kw)
    with capture_logits(half) as a:
        _greedy(half, "the in", n=2)
    del half
    full = LLM(path, dtype="float32", **kw)
    with capture_logits(full) as b:
        _greedy(full, "the in", n=2)
    del full
    assert (a.rows[0] - b.rows[0]).abs().max().item() < 0.05
    monkeypatch.setenv("PAGEDSERVE_QGEMM_MAX_ROWS", "abc")
    with pytest.raises(ValueError, match="PAGEDSERVE_QGEMM_MAX_ROWS must be 'all' or an integer"):
        LLM(path, **kw)
    monkeypatch.delenv("PAGEDSERVE_QGEMM_MAX_ROWS")
    odd = tiny_model_factory("llama", intermediate_size=100)
    with pytest.raises(ValueError, match=r"--quantization int8: layers\.0\.mlp\.down_proj has 100 inputs, not a multiple of 16"):
        LLM(odd, quantization="int8", **kw)


def test_quantization_values_are_checked():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="fp8 weights are not supported"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="awq")
