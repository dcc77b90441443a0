"""The CUDA step loop's pieces, on CPU (issue 52, items 3-4): the graph batch sizes and padding,
the profiling-based KV sizing arithmetic (a fake memory reader), the staging buffers, the
sync-free top-k, the one-copy fetch of sampled tokens and logprobs, the profiling run, the
config defaults by device; and the whole ``CudaStepRunner`` path (eager, and padded decode
steps as the graphs run them) against ``ModelRunner``'s own path on a tiny random model whose
attention is the Triton kernel under Triton's interpreter (the same kernel on both paths, so
the eager outputs are equal bit for bit).

What this cannot check (GPU only): pinned memory and ``non_blocking`` ordering, the event wait,
CUDA graph capture and replay, CUDA generators, and the memory readings themselves.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.model.logprobs import top_k_by_id, top_k_by_id_no_sync
from pagedserve.model.sampler import SamplerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.cuda_graphs import graph_batch_sizes, padded_batch_size
from pagedserve.worker.cuda_step import fetch_sampled
from pagedserve.worker.memory_profile import kv_budget_from_profile, profile_kv_budget
from pagedserve.worker.step_buffers import StagingArena, StepBuffers

GIB = 1 << 30


# -- graph sizes -------------------------------------------------------------------------------
def test_graph_batch_sizes_and_padding():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(48)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 33, 48)] == [1, 2, 4, 8, 8, 16, 48, 48]
    assert padded_batch_size(49, sizes) is None and padded_batch_size(0, sizes) is None
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


# -- KV sizing from a profiling run ------------------------------------------------------------
def test_kv_budget_arithmetic():
    # 80 GiB GPU at 0.9 = 72 GiB: 1 GiB outside PyTorch (context), peak 10 GiB of which 0.5 GiB
    # was the dummy KV cache: 72 - 1 - 9.5 = 61.5 GiB for the KV cache.
    total, reserved = 80 * GIB, 2 * GIB
    free = total - reserved - 1 * GIB
    res = kv_budget_from_profile(total, 0.9, free, reserved, 10 * GIB, GIB // 2)
    assert (res.non_torch, res.peak_torch) == (1 * GIB, int(9.5 * GIB))
    assert res.kv_budget == int(80 * GIB * 0.9) - int(9.5 * GIB) - GIB
    # another process holding 70 GiB: nothing left (never negative)
    assert kv_budget_from_profile(total, 0.9, total - reserved - 70 * GIB, reserved, 10 * GIB, 0).kv_budget == 0


class FakeMemory:
    """A device whose PyTorch peak grows while the profiling run runs."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.peak = 3 * GIB  # weights

    def mem_get_info(self):
        self.calls.append("info")
        return 16 * GIB - 4 * GIB - GIB // 2, 16 * GIB  # 4 GiB reserved, 0.5 GiB context

    def memory_reserved(self):
        return 4 * GIB

    def max_memory_allocated(self):
        self.calls.append("peak")
        return self.peak

    def reset_peak(self):
        self.calls.append("reset")

    def empty_cache(self):
        self.calls.append("empty")

    def synchronize(self):
        self.calls.append("sync")


def test_profile_kv_budget_reads_after_the_run():
    mem = FakeMemory()

    def run():
        mem.calls.append("run")
        mem.peak = 5 * GIB  # activations + a 1 GiB dummy cache
        return GIB

    res = profile_kv_budget(run, mem, 0.5)
    assert mem.calls == ["empty", "reset", "run", "sync", "peak", "empty", "info"]
    assert res.kv_budget == 8 * GIB - 4 * GIB - GIB // 2


def test_profile_run_on_a_tiny_model():
    """The dummy forward (a prefill group of max_num_seqs prompts) and sampler pass run; the
    dummy cache holds exactly the prompts' blocks."""
    from pagedserve.worker.memory_profile import profile_run

    model = tiny_model()
    nbytes = profile_run(model, 37, 5, 4, torch.float32, "auto", torch.device("cpu"))
    a = model.layers[0].self_attn
    blocks = 3 * 2 + 2 * 2  # 37 tokens over 5 prompts: 8, 8, 7, 7, 7 -> 2 blocks of 4 each
    assert nbytes == len(model.layers) * 2 * blocks * a.num_kv_heads * 4 * a.head_dim * 4


# -- staging -----------------------------------------------------------------------------------
def test_staging_arena_put_flush_and_overflow():
    arena = StagingArena(64, torch.device("cpu"))
    a = arena.put(np.array([1.5, 2.5], dtype=np.float32))
    b = arena.put(np.array([True, False, True]))
    c = arena.put(np.arange(6, dtype=np.int64).reshape(2, 3))
    big = arena.put(np.arange(20, dtype=np.int64))  # 160 bytes: copied alone
    assert (a.dtype, b.dtype, c.dtype, c.shape) == (torch.float32, torch.bool, torch.int64, (2, 3))
    assert big.tolist() == list(range(20))
    arena.flush()
    assert a.tolist() == [1.5, 2.5] and b.tolist() == [True, False, True] and c.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert all(t.data_ptr() % StagingArena.ALIGN == 0 for t in (a, b, c))
    arena.reset()
    d = arena.put(np.array([7], dtype=np.int64))
    assert d.data_ptr() == a.data_ptr()


def test_step_buffers_stage_and_pad():
    B = 4
    table = np.arange(64, dtype=np.int64).reshape(8, 8) + 100  # rows of the input batch
    buf = StepBuffers(16, 8, 8, torch.device("cpu"))
    rows = np.array([3, 1])
    # a decode after 5 tokens, a 3-token chunk after 6
    s = buf.stage(np.array([7, 8, 9, 10]), np.array([5, 6, 7, 8]), np.array([11, 12, 13, 14]), np.array([1, 3]), np.array([6, 9]), table, rows, B)
    assert s.input_ids.tolist() == [7, 8, 9, 10] and s.positions.tolist() == [5, 6, 7, 8] and s.slot_mapping.tolist() == [11, 12, 13, 14]
    f = s.flat
    assert f.query_start_loc.tolist() == [0, 1, 4] and f.seq_lens.tolist() == [6, 9] and (f.max_query_len, f.max_seq_len) == (3, 9)
    assert f.block_tables.dtype == torch.int32 and f.block_tables.tolist() == table[rows, :3].tolist()
    # a decode step of 3 padded to 8 for a graph: full-width tables at fixed addresses
    d = buf.stage(np.array([1, 2, 3]), np.array([4, 9, 0]), np.array([20, 37, 8]), np.ones(3, np.int64), np.array([5, 10, 1]), table, np.array([0, 2, 4]), B, pad_to=8, scratch_block=9)
    assert d.input_ids.tolist() == [1, 2, 3] + [0] * 5 and d.positions.tolist() == [4, 9, 0] + [0] * 5
    assert d.slot_mapping.tolist() == [20, 37, 8] + [36] * 5
    assert d.flat.query_start_loc.tolist() == list(range(9)) and d.flat.seq_lens.tolist() == [5, 10, 1] + [1] * 5
    bt = d.flat.block_tables
    assert bt.shape == (8, 8) and bt[:3, :3].tolist() == table[[0, 2, 4], :3].tolist() and bt[3:, 0].tolist() == [9] * 5
    again = buf.stage(np.array([5]), np.array([1]), np.array([2]), np.ones(1, np.int64), np.array([2]), table, np.array([1]), B, pad_to=8, scratch_block=9)
    assert again.flat.block_tables.data_ptr() == bt.data_ptr() and again.input_ids.data_ptr() == d.input_ids.data_ptr()
    with pytest.raises(ValueError):
        buf.stage(np.array([1, 2]), np.array([0, 1]), np.array([0, 1]), np.array([2]), np.array([2]), table, np.array([0]), B, pad_to=4)
    with pytest.raises(ValueError):
        buf.stage(np.array([1]), np.array([0]), np.array([0]), np.array([1]), np.array([1]), table, np.array([0]), B, pad_to=9)


# -- sampling without syncs --------------------------------------------------------------------
def test_top_k_by_id_no_sync_equals_the_exact_one():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (64, 40), generator=g).float()  # many ties, at the cut too
    x[::5] = torch.randn(13, 40, generator=g)  # and rows without ties
    for k in (1, 3, 7, 39, 40):
        want = top_k_by_id(x, k)
        got = top_k_by_id_no_sync(x, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k


def test_fetch_sampled_in_one_copy():
    tokens = torch.tensor([5, 49151, 0])
    assert fetch_sampled(SamplerOutput(tokens))[0].tolist() == [5, 49151, 0]
    lp = torch.tensor([[-0.1, -0.1, -2.5], [-3.25, -0.5, -3.25], [-1e-7, -1e-7, -30.0]])
    ids = torch.tensor([[5, 5, 7], [49151, 3, 49151], [0, 0, 1]])
    ranks = torch.tensor([1, 2, 1])
    got_tokens, (got_lp, got_ids, got_ranks) = fetch_sampled(SamplerOutput(tokens, lp, ids, ranks))
    assert got_tokens.tolist() == tokens.tolist() and got_ids == ids.tolist() and got_ranks == ranks.tolist()
    assert got_lp == lp.tolist()  # float32 values, exactly


# -- config ------------------------------------------------------------------------------------
def test_max_num_seqs_and_enforce_eager_defaults():
    import argparse

    cfg = EngineConfig()
    assert cfg.max_num_seqs is None and cfg.enforce_eager is True
    assert cfg.max_num_seqs_for("cpu") == 64 and cfg.max_num_seqs_for("cuda") == 256
    assert cfg.resolved(128).max_num_seqs == 64 and cfg.resolved(128, "cuda").max_num_seqs == 256
    assert EngineConfig(max_num_seqs=7).resolved(128, "cuda").max_num_seqs == 7
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_cli_args(p.parse_args(["--no-enforce-eager"])).enforce_eager is False
    assert EngineConfig.from_cli_args(p.parse_args([])).enforce_eager is True


# -- the whole step, against ModelRunner's own path --------------------------------------------
def tiny_model(seed: int = 0, num_layers: int = 2):
    from transformers import LlamaConfig

    from pagedserve.model.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128
    )
    cfg.model_type = "llama"
    model = LlamaForCausalLM(cfg, 128)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture
def triton_interpreted(monkeypatch):
    """The Triton attention module compiled for the interpreter (as tests/model/test_triton_attention.py)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton", reason="triton is not installed (make setup installs it on Linux x86-64)")
        from triton.runtime import interpreter
        from triton.runtime.interpreter import InterpretedFunction

        from pagedserve.model.backends import triton_attention as ta

        if not isinstance(ta._paged_attention_kernel, InterpretedFunction):
            ta = importlib.reload(ta)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    orig = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):  # NumPy >= 2.4 with Triton 3.6's interpreter (triton#9171)
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
    return ta


BLOCK = 4
NUM_BLOCKS = 40
SCRATCH = NUM_BLOCKS - 1  # never handed out below


class Script:
    """Hand-made scheduler outputs: blocks from a counter, tokens computed per request."""

    def __init__(self) -> None:
        self.next_block = 0
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def step(self, sched: dict[str, int], new: dict[str, tuple[list[int], SamplingParams]] = {}, finished: tuple[str, ...] = ()) -> SchedulerOutput:
        so = SchedulerOutput(finished_req_ids=list(finished))
        cached = CachedRequestData()
        for rid, n in sched.items():
            have = self.blocks.setdefault(rid, [])
            done = self.computed.get(rid, 0)
            need = -(-(done + n) // BLOCK) - len(have)
            fresh = list(range(self.next_block, self.next_block + need))
            self.next_block += need
            assert self.next_block <= SCRATCH
            have += fresh
            if rid in new:
                prompt, params = new[rid]
                so.scheduled_new_reqs.append(NewRequestData(rid, prompt, [], params, [], list(have), 0))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(fresh)
                cached.num_computed_tokens.append(done)
                cached.new_token_ids.append([])
            self.computed[rid] = done + n
        so.scheduled_cached_reqs = cached
        so.num_scheduled_tokens = dict(sched)
        so.total_num_scheduled_tokens = sum(sched.values())
        return so


def script_steps() -> list[SchedulerOutput]:
    s = Script()
    greedy = SamplingParams(temperature=0.0, logprobs=3)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=5, logprobs=2)
    plain = SamplingParams(temperature=0.0)
    steps = [
        # a fresh prompt, a chunk that does not reach its end (no sample), a short prompt
        s.step({"a": 7, "b": 12, "c": 3}, new={"a": ([3, 14, 15, 92, 65, 35, 89], greedy), "b": (list(range(1, 21)), seeded), "c": ([7, 7, 7], plain)}),
        s.step({"a": 1, "b": 8, "c": 1}),  # decodes beside the rest of b's prompt
    ]
    steps += [s.step({"a": 1, "b": 1, "c": 1}) for _ in range(3)]  # decode-only: padded 3 -> 4
    steps.append(s.step({"a": 1, "b": 1}, finished=("c",)))  # 2 -> 2
    steps.append(s.step({"d": 5, "a": 1}, new={"d": ([1, 2, 3, 4, 5], greedy)}))  # a prompt after c left
    steps.append(s.step({"a": 1, "d": 1, "b": 1}))
    return steps


def make_runner(model, cuda_step: str):
    from pagedserve.worker.cuda_step import CudaStepRunner
    from pagedserve.worker.model_runner import ModelRunner

    r = ModelRunner(model, NUM_BLOCKS, BLOCK, torch.device("cpu"), torch.float32, max_num_reqs=8, max_model_len=64)
    assert r.cuda_step is None  # never on CPU by itself
    if cuda_step != "off":
        r.cuda_step = CudaStepRunner(r, 32, SCRATCH if cuda_step == "graphs" else None, 64, capture=False)
    return r


def test_cuda_step_path_equals_the_runner_path(triton_interpreted):
    """The CUDA step loop's code (staged buffers, flat attention inputs, logits rows picked on
    the device, arena-staged sampling state, one-copy fetch), and its padded decode steps,
    give the runner's own outputs: tokens equal, logprobs equal (eager: bit for bit)."""
    model = tiny_model()
    model.backend = triton_interpreted.TritonBackend()
    outs, padded = {}, []
    for mode in ("off", "eager", "graphs"):
        runner = make_runner(model, mode)
        if mode == "graphs":
            graphs = runner.cuda_step.graphs
            run = graphs.run
            graphs.run = lambda staged: padded.append((staged.num_seqs, staged.flat.seq_lens.shape[0])) or run(staged)
        outs[mode] = [runner.execute_model(so) for so in script_steps()]
    assert padded == [(3, 4)] * 3 + [(2, 2), (3, 4)]  # the decode-only steps, padded
    ref = outs["off"]
    assert ref[0].sampled.keys() == {"a", "c"} and ref[1].sampled.keys() == {"a", "b", "c"}
    for mode in ("eager", "graphs"):
        for i, (want, got) in enumerate(zip(ref, outs[mode])):
            assert got.sampled == want.sampled, (mode, i)
            assert got.logprobs.keys() == want.logprobs.keys(), (mode, i)
            for rid, [(ids, lps, rank)] in want.logprobs.items():
                [(gids, glps, grank)] = got.logprobs[rid]
                assert (gids, grank) == (ids, rank), (mode, i, rid)
                if mode == "eager":
                    assert glps == lps, (mode, i, rid)
                else:
                    np.testing.assert_allclose(glps, lps, rtol=1e-5, atol=1e-5)


def test_cuda_step_not_used_on_cpu_or_with_lora_pooling():
    """ModelRunner builds a CudaStepRunner only for CUDA + Triton without LoRA, pooling or TP
    (no CUDA call here: a CPU model)."""
    model = tiny_model(num_layers=1)
    assert make_runner(model, "off").cuda_step is None
