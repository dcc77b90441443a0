"""The pooling runner offline (``LLM(..., runner="pooling").embed``): vectors equal to HF
transformers' ``last_hidden_state`` pooled the same way (float32, random weights), through
chunked prefill, prefix hits and preemption, with the pool's invariants kept."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import assert_engine_idle
from pagedserve import LLM, PoolingParams
from pagedserve.pooler_config import PoolerConfig, finish_embedding, resolve_pooler_config

TEXTS = [
    "hello world",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Paged attention keeps the KV cache in fixed-size blocks; " * 5,
    "Embeddings for retrieval",
]


@pytest.fixture(scope="module")
def hf_model(tiny_model_factory):
    from transformers import AutoModel, AutoTokenizer

    d = tiny_model_factory("llama")
    return d, AutoTokenizer.from_pretrained(d), AutoModel.from_pretrained(d, dtype=torch.float32).eval()


def hf_pooled(hf_model, ids: list[int], kind: str) -> torch.Tensor:
    _, _, model = hf_model
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    return {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]


def make_llm(d: str, kind: str, normalize: bool = False, **kw) -> LLM:
    args = dict(dtype="float32", num_threads=1, kv_cache_memory_bytes=8_000_000, max_model_len=512)
    args.update(kw)
    return LLM(d, runner="pooling", pooler_config={"pooling_type": kind, "normalize": normalize}, **args)


def assert_close(vec: list[float], ref: torch.Tensor) -> None:
    v = torch.tensor(vec)
    assert v.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(v, ref, dim=0).item() > 0.9999
    torch.testing.assert_close(v, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embed_equals_hf_with_chunked_prefill(hf_model, kind):
    d, tok, _ = hf_model
    # A 64-token budget: the long prompts are pooled across several chunks, batched with the short ones.
    llm = make_llm(d, kind, max_num_batched_tokens=64)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in TEXTS]
    assert max(len(o.prompt_token_ids) for o in outs) > 64
    for o in outs:
        assert o.finished and o.outputs.hidden_size == 128
        assert_close(o.outputs.embedding, hf_pooled(hf_model, o.prompt_token_ids, kind))
    stats = llm.stats()
    assert stats.num_generation_tokens == 0
    assert stats.num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert_engine_idle(llm)


def test_last_pooling_prefix_hit_and_token_id_prompts(hf_model):
    d, tok, _ = hf_model
    llm = make_llm(d, "LAST", normalize=True)
    ids = tok(TEXTS[2])["input_ids"]
    first = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0]
    again = llm.embed([ids, ids[:40] + [7, 8, 9]], use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert again[0].num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0  # whole blocks, the last token recomputed
    assert again[1].num_cached_tokens == 32
    ref = hf_pooled(hf_model, ids, "LAST")
    ref = ref / ref.norm()
    for vec in (first.outputs.embedding, again[0].outputs.embedding):
        assert_close(vec, ref)
        assert abs(sum(x * x for x in vec) - 1.0) < 1e-5
    assert_close(again[1].outputs.embedding, torch.nn.functional.normalize(hf_pooled(hf_model, ids[:40] + [7, 8, 9], "LAST"), dim=0))
    assert_engine_idle(llm)


def test_mean_pooling_turns_prefix_caching_off(hf_model):
    d, tok, _ = hf_model
    llm = make_llm(d, "MEAN")
    assert llm.llm_engine.config.enable_prefix_caching is False
    ids = tok(TEXTS[3])["input_ids"]
    a, b = llm.embed([ids, ids], use_tqdm=False)
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert a.outputs.embedding == b.outputs.embedding


def test_preemption_recomputes_the_pooled_state(hf_model):
    """A pool of 24 blocks for 4 prompts of ~130 tokens (9 blocks each) prefilled side by side
    in 16-token chunks: they run out of blocks, the newest is preempted and recomputed from
    position 0; vectors stay HF's."""
    d, tok, _ = hf_model
    llm = make_llm(d, "MEAN", num_kv_blocks=24, max_num_batched_tokens=64, long_prefill_token_threshold=16, max_model_len=256)
    texts = [f"{i}: " + "the cache is paged and blocks are shared " * 16 for i in range(4)]
    outs = llm.embed(texts, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    for o in outs:
        assert_close(o.outputs.embedding, hf_pooled(hf_model, o.prompt_token_ids, "MEAN"))
    assert_engine_idle(llm)


def test_embed_and_generate_refuse_the_other_runner(hf_model, tiny_model_factory):
    d, _, _ = hf_model
    llm = make_llm(d, "LAST")
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    gen = LLM(d, dtype="float32", num_threads=1, kv_cache_memory_bytes=4_000_000, max_model_len=256)
    with pytest.raises(ValueError, match='runner="pooling"'):
        gen.embed("hello")


def test_embed_refuses_in_embedding_words(hf_model):
    """An input over max_model_len - 1 tokens is refused as an input to embed (not "no room to
    generate"), naming truncate_prompt_tokens, which makes it fit; prompts that are not prompts
    are ValueErrors, as generate's; nothing is left queued."""
    d, _, _ = hf_model
    llm = make_llm(d, "LAST", max_model_len=64)
    for prompt, field in (([5] * 64, "prompt_token_ids"), ("word " * 200, "prompt")):
        with pytest.raises(ValueError) as e:
            llm.embed(prompt, use_tqdm=False)
        msg = str(e.value)
        assert msg.startswith(f"{field} is ") and "63 tokens (max_model_len - 1" in msg and "truncate_prompt_tokens" in msg, msg
        assert "generate" not in msg
    [ok] = llm.embed([5] * 64, use_tqdm=False, truncate_prompt_tokens=63)
    assert len(ok.prompt_token_ids) == 63 and len(ok.outputs.embedding) > 0
    for bad in (5, 2.5, None, b"hi", object()):
        with pytest.raises(ValueError, match="prompts must be"):
            llm.embed(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.embed([5, "x"], use_tqdm=False)
    assert_engine_idle(llm)


def with_config(src: str, dst: str, **extra) -> str:
    """A copy of the model folder ``src`` whose config.json also holds ``extra``."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(extra)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


def test_matryoshka_dimensions_truncate_then_normalize(tiny_model_factory, tmp_path):
    d = with_config(tiny_model_factory("llama"), str(tmp_path / "mrl"), matryoshka_dimensions=[32, 64])
    llm = make_llm(d, "LAST", normalize=True)
    full = llm.embed("hello world", PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    cut = llm.embed("hello world", PoolingParams(dimensions=32), use_tqdm=False)[0].outputs.embedding
    ref = torch.nn.functional.normalize(torch.tensor(full[:32]), dim=0)
    torch.testing.assert_close(torch.tensor(cut), ref)
    with pytest.raises(ValueError, match="one of"):
        llm.embed("hello", PoolingParams(dimensions=48), use_tqdm=False)


def test_config_refusals():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="runner must be"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match="only used with runner"):
        EngineConfig(pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="pooling_type must be"):
        EngineConfig(runner="pooling", pooler_config='{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(runner="pooling", pooler_config={"softmax": True})
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert EngineConfig(runner="auto").runner == "generate"
    assert EngineConfig(runner="pooling", pooler_config='{"pooling_type": "mean"}').pooler.pooling_type == "MEAN"


def test_sentence_transformers_files_set_the_defaults(tiny_model_factory, tmp_path):
    d = str(tmp_path / "st")
    shutil.copytree(tiny_model_factory("llama"), d)
    assert resolve_pooler_config(None, d) == PoolerConfig("LAST", True, None, 128)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    with open(os.path.join(d, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(d, "1_Pooling"))
    with open(os.path.join(d, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 128, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, f)
    assert resolve_pooler_config(None, d) == PoolerConfig("MEAN", False, None, 128)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(d, "modules.json"), "w") as f:
        json.dump(modules, f)
    assert resolve_pooler_config(None, d) == PoolerConfig("MEAN", True, None, 128)
    assert resolve_pooler_config({"pooling_type": "CLS", "normalize": False}, d) == PoolerConfig("CLS", False, None, 128)


def test_finish_embedding_values():
    import array

    raw = array.array("f", [3.0, 4.0, 12.0]).tobytes()
    cfg = PoolerConfig("LAST", True, [], 3)
    assert finish_embedding(raw, cfg) == pytest.approx([3 / 13, 4 / 13, 12 / 13])
    assert finish_embedding(raw, cfg, PoolingParams(dimensions=2)) == pytest.approx([0.6, 0.8])
    assert finish_embedding(raw, cfg, PoolingParams(normalize=False)) == [3.0, 4.0, 12.0]
