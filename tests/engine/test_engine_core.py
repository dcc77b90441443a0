"""The core / worker boundary: the core is torch-free, the SchedulerOutput is plain values (it
survives msgpack encoding, which refuses any other object), the worker produces the engine's
tokens from hand-written messages alone, and the frontend paths the engine tests do not reach
(FINAL_ONLY outputs, KV sizing from a memory budget)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from conftest import assert_engine_idle
from pagedserve import LLM, EngineConfig, RequestOutputKind, SamplingParams
from pagedserve.core.outputs import EngineCoreRequest, ModelRunnerOutput
from pagedserve.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve import messages as serial
from pagedserve.messages import AddRequest, EngineCoreEventType, EngineCoreRequestType, check

BLOCK = 16


def test_core_and_package_import_no_torch():
    """Every module of pagedserve.core, the config, the message codec and the package itself
    import without torch (a fresh interpreter, so nothing else pulled it in)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import pagedserve, pagedserve.core, pagedserve.config, pagedserve.sampling_params\n"
        "names = [m.name for m in pkgutil.walk_packages(pagedserve.core.__path__, 'pagedserve.core.')]\n"
        "for n in names: importlib.import_module(n)\n"
        "import pagedserve.messages, pagedserve.engine.core, pagedserve.engine.core_proc, pagedserve.engine.core_client\n"
        "assert len(names) >= 6, names\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad[:5]\n"
        "print('ok', len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def test_message_codec_round_trip_and_refusals():
    params = SamplingParams(n=1, temperature=0.7, top_k=5, stop=["x"], stop_token_ids=[3], logit_bias={7: 1.5}, seed=9,
                            min_tokens=2, logprobs=3, output_kind=RequestOutputKind.DELTA, allowed_token_ids=[4, 9])
    params._all_stop_token_ids = {2, 3}
    req = EngineCoreRequest("r", [1, 2, 3], params, [2], 12.5, "salt", priority=-(2**63))
    back = check(serial.decode(serial.encode((EngineCoreRequestType.ADD, AddRequest([req])))), EngineCoreRequestType)
    assert back[0] is EngineCoreRequestType.ADD and back[1].requests == [req]
    assert back[1].requests[0].sampling_params._all_stop_token_ids == {2, 3}
    # a message of the wrong conversation, or with the wrong payload, is refused
    for bad in ([EngineCoreEventType.OUTPUTS, None], [EngineCoreRequestType.ADD, req], [EngineCoreRequestType.SHUTDOWN, 1], ["add", [req]]):
        with pytest.raises(ValueError):
            check(serial.decode(serial.encode(bad)), EngineCoreRequestType)
    so = SchedulerOutput([NewRequestData("a", [1, 2], [], params, [2], [4, 5], 0)], CachedRequestData(["b"], [[6]], [17], [[]]),
                         {"a": 2, "b": 1}, 3, ["c"], ["d"])
    assert serial.decode(serial.encode(so)) == so
    with pytest.raises(TypeError):
        serial.encode(["add", object()])  # only registered dataclasses travel
    with pytest.raises(ValueError):
        serial.decode(b"\xc7\x01\x63\x00")  # an unknown extension type
    evil = serial._packb(["os.system", "echo no"])
    import msgpack

    with pytest.raises(ValueError):
        serial.decode(msgpack.packb(msgpack.ExtType(1, evil)))  # an unregistered type name


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def test_scheduler_outputs_are_values_only(tiny_dir):
    """Every message the scheduler sends in a run with chunking, preemption and prefix hits
    encodes with the msgpack codec (which rejects a Request or any unregistered object), and
    decoding it gives an equal message."""
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=24)
    core = llm.llm_engine.core
    seen = []
    real = core.worker.execute_model

    def spy(so):
        seen.append(so)
        assert serial.decode(serial.encode(so)) == so
        return real(so)

    core.worker.execute_model = spy
    prompts = [{"prompt_token_ids": [5 + i] * 20 + list(range(100, 100 + 7 * i))} for i in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert any(so.preempted_req_ids for so in seen) and any(so.scheduled_cached_reqs.req_ids for so in seen)
    assert any(n.num_computed_tokens > 0 for so in seen for n in so.scheduled_new_reqs)  # prefix hits
    assert_engine_idle(llm)


class HandScheduler:
    """Writes SchedulerOutputs by hand (no Scheduler): scattered block ids, prompts split in
    chunks of ``chunk`` tokens, one preemption and resume, requests finished by length."""

    def __init__(self, prompts: dict[str, list[int]], max_tokens: int, chunk: int) -> None:
        self.tokens = {r: list(p) for r, p in prompts.items()}
        self.prompt_len = {r: len(p) for r, p in prompts.items()}
        self.computed = {r: 0 for r in prompts}
        self.blocks: dict[str, list[int]] = {}
        self.free = [11, 3, 17, 8, 1, 14, 6, 19, 2, 12, 5, 9, 16, 4, 18, 7, 13, 10, 15]
        self.max_tokens, self.chunk = max_tokens, chunk
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.on_worker: set[str] = set()

    def next(self) -> SchedulerOutput:
        so = SchedulerOutput(finished_req_ids=self.finished, preempted_req_ids=self.preempted)
        self.finished, self.preempted = [], []
        for rid, toks in self.tokens.items():
            n = min(self.chunk, len(toks) - self.computed[rid])
            need = -(-(self.computed[rid] + n) // BLOCK)
            have = self.blocks.setdefault(rid, [])
            new_blocks = [self.free.pop(0) for _ in range(need - len(have))]
            have.extend(new_blocks)
            if rid in self.on_worker:
                so.scheduled_cached_reqs.req_ids.append(rid)
                so.scheduled_cached_reqs.new_block_ids.append(new_blocks)
                so.scheduled_cached_reqs.num_computed_tokens.append(self.computed[rid])
                so.scheduled_cached_reqs.new_token_ids.append([])
            else:
                p = self.prompt_len[rid]
                so.scheduled_new_reqs.append(NewRequestData(rid, toks[:p], toks[p:], self.params, [2], list(have), self.computed[rid]))
                self.on_worker.add(rid)
            so.num_scheduled_tokens[rid] = n
            self.computed[rid] += n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        return so

    def update(self, out: ModelRunnerOutput) -> None:
        for rid, tok in out.sampled.items():
            self.tokens[rid].append(tok)
        for rid in list(self.tokens):
            if len(self.tokens[rid]) - self.prompt_len[rid] >= self.max_tokens:
                self.free += self.blocks.pop(rid)
                self.finished.append(rid)
                self.on_worker.discard(rid)
                del self.tokens[rid]

    def preempt(self, rid: str) -> None:
        self.free += self.blocks.pop(rid)
        self.computed[rid] = 0
        self.preempted.append(rid)
        self.on_worker.discard(rid)


def test_worker_driven_by_hand_written_scheduler_outputs(tiny_dir):
    """The worker alone, fed hand-written messages (new requests in full, the rest as diffs,
    scattered block ids, a prompt in chunks, a preemption mid-decode then a resume with its
    output tokens), samples exactly the tokens the whole engine produces; finished requests
    leave no state in the worker."""
    from pagedserve.worker.worker import Worker

    prompts = {"a": list(range(200, 237)), "b": [7, 8, 9], "c": list(range(300, 318))}
    want = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, max_model_len=128).generate(
        [{"prompt_token_ids": p} for p in prompts.values()], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    config = EngineConfig(model=tiny_dir, dtype="float32", num_kv_blocks=20, max_model_len=128, max_num_seqs=4)
    worker = Worker(config)
    worker.initialize_cache(config.resolved(128))
    hand = HandScheduler(prompts, max_tokens=12, chunk=16)
    got: dict[str, list[int]] = {}
    real_update = hand.update

    def update(out: ModelRunnerOutput) -> None:
        for rid, tok in out.sampled.items():
            got.setdefault(rid, []).append(tok)
        real_update(out)

    hand.update = update
    for step in range(100):
        if not (hand.tokens or hand.finished):
            break
        if step == 6:
            assert len(hand.tokens["c"]) > len(prompts["c"])  # decoding
            hand.preempt("c")
        hand.update(worker.execute_model(hand.next()))
    assert [got[r] for r in prompts] == [o.outputs[0].token_ids for o in want]
    runner = worker.model_runner
    assert not runner.requests and runner.input_batch.num_reqs == 0


def test_final_only_outputs_once_with_everything(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, max_model_len=128)
    engine = llm.llm_engine
    cumulative = llm.generate("hello there", SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, n=2, seed=1), use_tqdm=False)[0]
    rid = engine.add_request(None, "hello there", SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, n=2, seed=1,
                                                                  output_kind=RequestOutputKind.FINAL_ONLY))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].request_id == rid and outs[0].finished
    assert [(c.text, c.token_ids, c.finish_reason) for c in outs[0].outputs] == \
        [(c.text, c.token_ids, c.finish_reason) for c in cumulative.outputs]
    assert all(len(c.token_ids) == 9 for c in outs[0].outputs)
    assert_engine_idle(llm)


def test_kv_cache_sized_from_a_memory_budget(tiny_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_dir)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_block = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * head_dim * 4  # K and V, float32
    budget = 37 * per_block + per_block // 2
    llm = LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=budget, max_model_len=256)
    info = llm.llm_engine.core.info
    assert info.block_bytes == per_block and info.num_blocks == 37 and llm.stats().num_total_blocks == 37
    kv = llm.llm_engine.core.worker.model_runner.kv_cache
    assert kv.numel() * kv.element_size() == 37 * per_block
    with pytest.raises(ValueError, match="smaller than one block"):
        LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=per_block - 1)
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(tiny_dir, dtype="float32", kv_cache_memory_bytes=budget, max_model_len=1000)
    # No budget given: never more than max_num_seqs full-length sequences.
    small = LLM(tiny_dir, dtype="float32", max_num_seqs=3, max_model_len=100)
    assert small.stats().num_total_blocks == 3 * -(-100 // BLOCK)


def test_config_flags_are_the_fields():
    import argparse

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    args = p.parse_args(["--max-num-seqs", "5", "--no-enable-chunked-prefill", "--kv-cache-memory", "1000", "--dtype", "float32"])
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.max_num_seqs, cfg.enable_chunked_prefill, cfg.kv_cache_memory_bytes, cfg.dtype) == (5, False, 1000, "float32")
    assert dataclasses.replace(cfg, max_num_seqs=None) == EngineConfig.from_cli_args(p.parse_args(
        ["--no-enable-chunked-prefill", "--kv-cache-memory-bytes", "1000", "--dtype", "float32"]))
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(TypeError):
        LLM(no_such_field=1)


def test_frontend_edge_cases_found_in_review(tiny_dir):
    """n > 1 in DELTA mode reports each finished sequence once; a request id equal to another
    request's child id is refused without harming it; a stop string completed by the last
    allowed token finishes with "stop" and the string, as vLLM reports it."""
    llm = LLM(tiny_dir, dtype="float32", num_kv_blocks=64, max_model_len=128)
    engine = llm.llm_engine
    ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text0 = ref.outputs[0].text
    stop = text0[len(text0) // 2 : len(text0) // 2 + 3]
    assert stop and all(stop not in o.text for o in ref.outputs[1:]), "pick another seed: the stop string hits every sequence"
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=12, ignore_eos=True, stop=[stop],
                                                       output_kind=RequestOutputKind.DELTA))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x#0", [9, 9, 9], SamplingParams(max_tokens=2))
    finish_chunks = {0: 0, 1: 0, 2: 0}
    texts = {0: "", 1: "", 2: ""}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] += c.text
                finish_chunks[c.index] += c.finish_reason is not None
    assert finish_chunks == {0: 1, 1: 1, 2: 1}
    assert texts[0] == text0[: text0.index(stop)] and texts[1] == ref.outputs[1].text and texts[2] == ref.outputs[2].text
    assert_engine_idle(llm)

    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    last = llm.get_tokenizer().decode(greedy.token_ids[-1:])
    stop = last.strip()[:2] or last
    assert stop not in llm.get_tokenizer().decode(greedy.token_ids[:-1])
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop) and stop not in out.text
    assert_engine_idle(llm)


def test_tokenizer_flag_loads_another_tokenizer_folder(tiny_dir, smollm2_dir, tmp_path):
    """--tokenizer / LLM(tokenizer=...): the front and the core read the tokenizer from there."""
    import shutil

    model = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_dir, model)
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    with pytest.raises(Exception):
        LLM(str(model), dtype="float32", num_kv_blocks=16, max_model_len=64)
    llm = LLM(str(model), tokenizer=smollm2_dir, dtype="float32", num_kv_blocks=16, max_model_len=64)
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.prompt_token_ids == llm.get_tokenizer()("hello")["input_ids"]
