"""Multi-LoRA offline (``LLM(enable_lora=True).generate(..., lora_request=...)``): greedy output of
every adapter equals HF PEFT's merged model in float32, with rows of three adapters and the base
model in one batch, through chunked prefill, preemption and prefix hits; the prefix cache is
keyed by adapter; refusals leave the engine serving."""

from __future__ import annotations

import pytest

from conftest import assert_engine_idle
from lora_utils import make_adapter, merged_greedy
from pagedserve import LLM, LoRARequest, SamplingParams

MAX_NEW = 8
TEXTS = [
    "The capital of France is",
    "Paged attention stores the KV cache in blocks; " * 6,
    "one two three",
    "LoRA adapters are small low-rank updates",
]


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    from transformers import AutoTokenizer

    d = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("loras")
    adapters = {
        "all": make_adapter(d, str(root / "all"), r=8, alpha=16, seed=1),
        "qv": make_adapter(d, str(root / "qv"), r=4, alpha=8, targets=["q_proj", "v_proj"], seed=2),
        "mlp": make_adapter(d, str(root / "mlp"), r=16, alpha=16, targets=["gate_proj", "up_proj", "down_proj"], seed=3, use_rslora=True),
    }
    tok = AutoTokenizer.from_pretrained(d)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    refs = {name: merged_greedy(d, path, ids, MAX_NEW) for name, path in [("base", None), *adapters.items()]}
    return d, adapters, ids, refs


def requests(adapters) -> dict:
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), start=1)}


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def make_llm(d: str, **kw) -> LLM:
    args = dict(dtype="float32", num_threads=1, kv_cache_memory_bytes=8_000_000, max_model_len=512, enable_lora=True)
    args.update(kw)
    return LLM(d, **args)


def run_mixed(llm: LLM, setup, order: list) -> None:
    """Every prompt under every name of ``order`` in one batch; each equals its reference."""
    d, adapters, ids, refs = setup
    reqs = requests(adapters)
    prompts, loras, want = [], [], []
    for name in order:
        for i, p in enumerate(ids):
            prompts.append({"prompt_token_ids": p})
            loras.append(None if name == "base" else reqs[name])
            want.append(refs[name][i])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want


def test_adapters_and_base_in_one_batch_equal_peft(setup):
    d = setup[0]
    assert setup[3]["all"] != setup[3]["base"]  # the adapters change the output
    llm = make_llm(d)
    run_mixed(llm, setup, ["all", "base", "qv", "mlp"])
    assert_engine_idle(llm)


def test_chunked_prefill_and_preemption(setup):
    # 16-token chunks side by side in a 24-block pool: prompts are chunked and some are preempted.
    llm = make_llm(setup[0], max_num_batched_tokens=64, long_prefill_token_threshold=16, num_kv_blocks=24, max_model_len=256)
    run_mixed(llm, setup, ["mlp", "all", "base", "qv"])
    assert llm.stats().num_preemptions > 0
    assert_engine_idle(llm)


def test_more_adapters_than_slots_wait_for_one(setup):
    llm = make_llm(setup[0], max_loras=2)
    run_mixed(llm, setup, ["all", "qv", "mlp", "base"])
    assert len(llm.llm_engine.core.worker.lora_manager.slot_of) <= 2
    assert_engine_idle(llm)


def test_prefix_cache_is_keyed_by_adapter(setup):
    d, adapters, ids, refs = setup
    reqs = requests(adapters)
    llm = make_llm(d)
    prompt = {"prompt_token_ids": ids[1]}  # 5 full blocks
    seq = [reqs["all"], reqs["all"], reqs["qv"], None]
    outs = [llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=r)[0] for r in seq]
    assert [o.num_cached_tokens for o in outs] == [0, (len(ids[1]) - 1) // 16 * 16, 0, 0]
    assert [o.outputs[0].token_ids for o in outs] == [refs["all"][1], refs["all"][1], refs["qv"][1], refs["base"][1]]
    assert_engine_idle(llm)


def test_refusals_leave_the_engine_serving(setup, tmp_path):
    d, adapters, ids, refs = setup
    llm = make_llm(d, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp", 3, adapters["mlp"]))  # rank 16 > 8
    with pytest.raises(ValueError):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("missing", 4, str(tmp_path / "nothing")))
    with pytest.raises(ValueError, match="already"):
        llm.llm_engine.core.add_lora(LoRARequest("all", 1, adapters["all"]))
        llm.llm_engine.core.add_lora(LoRARequest("other", 1, adapters["qv"]))
    out = llm.generate({"prompt_token_ids": ids[0]}, GREEDY, use_tqdm=False, lora_request=LoRARequest("all", 1, adapters["all"]))
    assert out[0].outputs[0].token_ids == refs["all"][0]
    assert_engine_idle(llm)
    plain = LLM(d, dtype="float32", num_threads=1, kv_cache_memory_bytes=4_000_000, max_model_len=256)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("all", 1, adapters["all"]))


def test_lora_config_refusals():
    from pagedserve.config import EngineConfig
    from pagedserve.lora_request import parse_lora_modules

    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig(lora_modules=["a=/x"])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])] == [
        ("a", 1, "/x"),
        ("b", 2, "/y"),
    ]
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


@pytest.mark.parametrize("name", ["", "   ", " a", "a ", "a\n", "a\x00b", "a\x7fb", "a/b", "\u2028a"])
def test_bad_adapter_names_are_refused(name):
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest(name, 1, "/x")


def test_adapter_ids_are_small_ints():
    from pagedserve.lora_request import MAX_LORA_INT_ID

    assert MAX_LORA_INT_ID == 2**31 - 1 and LoRARequest("a", MAX_LORA_INT_ID, "/x").lora_int_id == MAX_LORA_INT_ID
    for bad in (2**31, 2**63, -1, True, 1.0):
        with pytest.raises(ValueError, match="lora_int_id"):
            LoRARequest("a", bad, "/x")


def test_add_lora_is_transactional(setup, monkeypatch):
    """A failure after the worker loaded the adapter unloads it again; a request whose id was
    changed after construction is checked again; the engine keeps serving."""
    d, adapters, ids, refs = setup
    llm = make_llm(d)
    core = llm.llm_engine.core
    manager = core.worker.lora_manager
    real_add = manager.add

    def add_then_fail(lora):
        real_add(lora)
        raise RuntimeError("boom after the load")

    monkeypatch.setattr(manager, "add", add_then_fail)
    with pytest.raises(RuntimeError, match="boom"):
        core.add_lora(LoRARequest("all", 5, adapters["all"]))
    assert core.loras == {} and manager.adapters == {} and core.list_loras() == []
    monkeypatch.undo()
    lora = LoRARequest("all", 5, adapters["all"])
    lora.lora_int_id = 2**63
    with pytest.raises(ValueError, match="lora_int_id"):
        core.add_lora(lora)
    assert core.loras == {} and manager.adapters == {}
    out = llm.generate({"prompt_token_ids": ids[0]}, GREEDY, use_tqdm=False, lora_request=LoRARequest("all", 5, adapters["all"]))
    assert out[0].outputs[0].token_ids == refs["all"][0]
    assert_engine_idle(llm)
