"""Shared fixtures: small random HF models saved as safetensors (loaded through the same path a
user's checkpoint takes) and one SmolLM2 engine per session; and the markers each test gets
from where it lives and what it uses (``kernel``: tests/ops/; ``e2e``: tests/e2e/; ``server``:
it starts a server or another process; ``model``: it loads a model), so ``make test-unit`` can
leave those out."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run under Triton's interpreter in tests (no GPU in CI). It must be set before
# anything imports triton (peft does, at import): `triton.jit` picks the mode at decoration.
os.environ["TRITON_INTERPRET"] = "1"
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from server_utils import client, server  # noqa: E402,F401  (the session's real server, as fixtures)

# What in a test module's source means its tests start processes (servers, engine cores, CLIs).
_PROCESS_STARTERS = ("start_tiny_server(", "subprocess.", "Popen(", "serve(", "AsyncLLM(", "MPClient(", "engine_process=True",
                     "tensor_parallel_size=", "data_parallel_size=")
_module_starts_processes: dict[str, bool] = {}
# Fixtures that load a model (and any fixture built on them).
_MODEL_FIXTURES = {"smollm2_dir", "smollm2_llm", "tiny_model_factory", "tiny_llm", "tiny_url", "thinking_model", "plain_bf16"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.parts
        if "ops" in parts:
            item.add_marker(pytest.mark.kernel)
        if "e2e" in parts:
            item.add_marker(pytest.mark.e2e)
        key = str(item.path)
        if key not in _module_starts_processes:
            text = item.path.read_text(encoding="utf-8")
            _module_starts_processes[key] = any(s in text for s in _PROCESS_STARTERS)
        if _module_starts_processes[key] or {"server", "client"} & set(item.fixturenames):
            item.add_marker(pytest.mark.server)
        if _MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.model)

# The tokenizer saved beside every random model: SmolLM2's (byte-level BPE, 49152 ids).
TINY_VOCAB = 49152


def _smollm2_dir() -> str:
    from pagedserve.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF-style directory converted from the default model's GGUF file."""
    return _smollm2_dir()


TINY_SHAPES = {
    # model_type: extra config kwargs
    "llama": dict(),
    "qwen2": dict(),
    "qwen3": dict(head_dim=32),
    "mistral": dict(),
}


def make_tiny_model(kind: str, path: str, **overrides) -> str:
    """Save a small random ``kind`` model (GQA: 4 heads, 2 KV heads) with SmolLM2's tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    cfg_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[kind]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[kind]
    kw = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=(kind in ("qwen2", "qwen3")),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    kw.update(TINY_SHAPES[kind])
    kw.update(overrides)
    config = cfg_cls(**kw)
    torch.manual_seed(1234)
    model = model_cls(config).to(torch.float32)
    # Random init gives near-uniform logits; widen them so greedy choices are well separated.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(_smollm2_dir()).save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def _remove_temp_dirs_after_a_passing_session(request, tmp_path_factory):
    """A session with no failure leaves nothing in the temp folder (the random models alone are
    about 1 GB); a failing one keeps its folders for a look (pytest keeps the last three)."""
    yield
    if request.session.testsfailed == 0 and not request.config.option.basetemp:
        shutil.rmtree(tmp_path_factory.getbasetemp(), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(kind, **config_overrides) -> model dir``; cached per (kind, overrides) for the
    session, and removed at its end whatever the outcome (about 50 MB each, rebuilt in seconds)."""
    cache: dict = {}

    def factory(kind: str = "llama", **overrides) -> str:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{kind}")
            cache[key] = make_tiny_model(kind, str(d), **overrides)
        return cache[key]

    yield factory
    for path in cache.values():
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_llm():
    """One float32 SmolLM2 engine for the session (small KV pool), its GGUF weights dequantized
    in memory (``quantization="none"``: the weights HF transformers computes with). Tests must
    leave it idle."""
    from pagedserve import LLM

    return LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=192 << 20, max_model_len=2048)


def assert_engine_idle(llm_or_engine) -> None:
    """No request state left anywhere (frontend, scheduler, worker) and every block back in the
    free queue with ref_cnt 0."""
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    stats = engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    sched = engine.core.scheduler
    kv = sched.kv_cache_manager
    assert not sched.requests
    assert not kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not engine.has_unfinished_requests()
    # The worker drops a finished request's state when the next step's message says so.
    engine.core.step()
    runner = engine.core.worker.model_runner
    assert not runner.requests and runner.input_batch.num_reqs == 0, list(runner.requests)


@pytest.fixture(scope="session")
def thinking_model(tiny_model_factory, tmp_path_factory):
    """The tiny llama with 128 spare embedding rows, and SmolLM2's tokenizer plus <think> and
    </think> (ids 49152 and 49153, not special: they stay in the text, as DeepSeek-R1's)."""
    from transformers import AutoTokenizer

    src = tiny_model_factory("llama", vocab_size=49280)
    path = tmp_path_factory.mktemp("thinking")
    shutil.copytree(src, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(path)
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_factory):
    """An in-thread AsyncLLM over the tiny llama (``app_utils.tiny_async_llm``), one per module."""
    from app_utils import tiny_async_llm

    llm = tiny_async_llm(tiny_model_factory("llama"))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tiny_url(tiny_llm):
    """``tiny_llm`` served on a loopback port (``app_utils.serve``); every block is back at the end."""
    from app_utils import kv_idle, serve

    with serve(tiny_llm) as base:
        yield base
    kv_idle(tiny_llm)
