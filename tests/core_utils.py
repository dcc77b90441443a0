"""Shared helpers of the scheduler and block-pool tests (vLLM's ``tests/v1/core/utils.py``
shape): building schedulers and requests, a fake worker that reads the ``SchedulerOutput``
message exactly as the real model runner must (new requests in full, the rest as diffs), and the
invariant checks of design.md. No model, no torch.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager, num_skipped_blocks
from pagedserve.core.outputs import EngineCoreOutputs, ModelRunnerOutput
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.output import SchedulerOutput
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

B = 4  # block size of every unit test
EOS = 2
TOK = 7  # an ordinary sampled token
IDENTITY = "/models/tiny|torch.float32"


def make_kv_manager(num_blocks: int = 16, caching: bool = True, identity: str = IDENTITY, window: Optional[int] = None) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, enable_caching=caching, model_identity=identity, sliding_window=window)


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, max_model_len: Optional[int] = None,
                   chunked: bool = True, threshold: int = 0, caching: bool = True, max_step_ms: float = 0.0,
                   max_step_decode_multiple: float = 0.0, policy: str = "fcfs", spec: Optional[dict] = None,
                   window: Optional[int] = None) -> Scheduler:
    """A scheduler over a fresh pool of ``num_blocks`` blocks of ``B`` tokens. The step-time
    bound is off unless ``max_step_ms`` is given (the token-budget tests pin the plain rule;
    with it on, ``step(..., step_ms=...)`` plays the clock); its decode multiple is off unless
    given, so that ``max_step_ms`` is the fixed target. ``window``: every layer's sliding
    window (tokens), whose blocks the KV cache manager frees as requests move on."""
    cfg = EngineConfig(
        block_size=B, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold, enable_prefix_caching=caching, max_step_ms=max_step_ms,
        max_step_decode_multiple=max_step_decode_multiple, scheduling_policy=policy, speculative_config=spec,
    ).resolved(max_model_len or num_blocks * B)
    sched = Scheduler(cfg, make_kv_manager(num_blocks, caching, "unit", window))
    sched.fake_worker = FakeWorker()
    return sched


def make_request(rid: str, tokens: list[int], salt: Optional[str] = None, eos: int = EOS, priority: int = 0,
                 arrival_time: Optional[float] = None, **params) -> Request:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    return Request(rid, tokens, SamplingParams(**params), eos_token_ids={eos}, cache_salt=salt, priority=priority,
                   arrival_time=arrival_time)


@dataclass
class Scheduled:
    """One request's share of a step, as the worker sees it."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    token_ids: list[int]  # every token the worker holds for the request
    samples: bool


class FakeWorker:
    """Keeps per-request state from the messages alone (block tables, tokens), as the model
    runner does, and answers with the tokens a test chooses."""

    def __init__(self) -> None:
        self.block_ids: dict[str, list[int]] = {}
        self.token_ids: dict[str, list[int]] = {}
        self.kept: set[str] = set()  # preempted: no block table, state kept

    def apply(self, so: SchedulerOutput) -> list[Scheduled]:
        for rid in so.finished_req_ids:
            self.block_ids.pop(rid, None)
            self.token_ids.pop(rid, None)
            self.kept.discard(rid)
        for rid in so.preempted_req_ids:
            del self.block_ids[rid]
            self.kept.add(rid)
        computed = {}
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.block_ids, f"{new.req_id} sent in full while the worker holds it"
            self.kept.discard(new.req_id)
            self.block_ids[new.req_id] = list(new.block_ids)
            self.token_ids[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, blocks, num_computed, toks in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, c.new_token_ids):
            self.block_ids[rid].extend(blocks)
            self.token_ids[rid].extend(toks)
            computed[rid] = num_computed
        assert set(computed) == set(so.num_scheduled_tokens)
        out = []
        for rid, n in so.num_scheduled_tokens.items():
            toks = self.token_ids[rid]
            out.append(Scheduled(rid, computed[rid], n, list(self.block_ids[rid]), list(toks), computed[rid] + n == len(toks)))
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        return out

    def sampled(self, scheduled: list[Scheduled], token: Callable[[str], int]) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for s in scheduled:
            if s.samples:
                out.sampled[s.request_id] = token(s.request_id)
                self.token_ids[s.request_id].append(out.sampled[s.request_id])
        return out


@dataclass
class StepResult:
    output: SchedulerOutput
    scheduled: list[Scheduled]
    core_outputs: EngineCoreOutputs = field(default_factory=EngineCoreOutputs)

    @property
    def preempted_ids(self) -> list[str]:
        return self.output.preempted_req_ids

    @property
    def num_batched_tokens(self) -> int:
        return self.output.total_num_scheduled_tokens


def step(sched: Scheduler, token: Callable[[Request], int] = lambda r: TOK,
         step_ms: Optional[Callable[[list[Scheduled]], float]] = None) -> StepResult:
    """``schedule()``, the fake worker, then ``update_from_output`` with ``token(request)``
    for the requests that sample; then, when ``step_ms`` is given, the step's "measured"
    duration ``step_ms(scheduled)`` (ms) goes to ``record_step_time`` as EngineCore.step does."""
    so = sched.schedule()
    scheduled = sched.fake_worker.apply(so)
    live = dict(sched.requests)
    runner_out = sched.fake_worker.sampled(scheduled, lambda rid: token(live[rid]))
    result = StepResult(so, scheduled, sched.update_from_output(so, runner_out))
    if step_ms is not None:
        sched.record_step_time(step_ms(scheduled))
    return result


def plan(result: StepResult) -> dict[str, int]:
    return dict(result.output.num_scheduled_tokens)


def drain(sched: Scheduler, max_steps: int = 1000, **kw) -> list[dict[str, int]]:
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return plans
        plans.append(plan(step(sched, **kw)))
    raise AssertionError(f"not finished after {max_steps} steps: {sched.requests}")


def assert_pool_idle(kv: KVCacheManager) -> None:
    pool = kv.block_pool
    assert not kv.req_to_blocks and not kv.num_cached_blocks and not kv.num_released
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks == len(list(pool.free_queue))
    assert sorted(b.block_id for b in pool.free_queue) == list(range(pool.num_blocks))


def assert_scheduler_idle(sched: Scheduler) -> None:
    assert not sched.requests and not sched.running and not sched.waiting
    assert_pool_idle(sched.kv_cache_manager)


def check_invariants(sched: Scheduler, spare_tokens: int = 0) -> None:
    """design.md's invariants, checkable at any point between steps, plus: the fake worker's
    view (built from the messages alone) equals the scheduler's. ``spare_tokens``: a block
    table may also cover that many tokens past the computed ones (rejected drafts)."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    live = sched.requests
    running_ids = [r.request_id for r in sched.running]
    waiting_ids = [r.request_id for r in sched.waiting]
    assert len(running_ids) + len(waiting_ids) == len(live)
    assert set(running_ids) | set(waiting_ids) == set(live)
    assert len(sched.running) <= sched.config.max_num_seqs
    if sched.config.scheduling_policy == "priority":  # the back of running is the first to preempt
        keys = [(r.priority, r.arrival_time) for r in sched.running]
        assert keys == sorted(keys), keys
    # Free queue vs ref counts: free + used == total, and a block is free iff ref_cnt == 0.
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    free_set = set(free_ids)
    assert sum(1 for b in pool.blocks if b.ref_cnt > 0) + len(free_ids) == pool.num_blocks
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b.ref_cnt == 0) == (b.block_id in free_set), b
    # The O(1) count of cached-and-evictable blocks (read by the step trace) matches a walk.
    assert pool.num_cached_free_blocks == sum(1 for b in pool.free_queue if b.block_hash is not None)
    # Every ref_cnt equals the number of live block tables holding the block (with a sliding
    # window, the entries after the released ones; released only once out of every future
    # query's window).
    counts: Counter = Counter()
    where = defaultdict(list)
    assert set(kv.num_released) <= set(kv.req_to_blocks)
    for rid, blocks in kv.req_to_blocks.items():
        assert rid in live and live[rid].status == RequestStatus.RUNNING, rid
        released = kv.num_released.get(rid, 0)
        assert released <= min(len(blocks), num_skipped_blocks(live[rid].num_computed_tokens, kv.sliding_window, B)), (rid, released)
        ids = [b.block_id for b in blocks[released:]]
        assert all(pool.blocks[b.block_id] is b for b in blocks[released:]), rid
        assert len(ids) == len(set(ids)), (rid, ids)
        counts.update(ids)
        for i, bid in enumerate(ids, start=released):
            where[bid].append((rid, i))
    for b in pool.blocks:
        assert b.ref_cnt == counts[b.block_id], (b, counts[b.block_id])
    # A block in two live tables is a full, hashed prefix block at the same position in both.
    for bid, occ in where.items():
        if len(occ) < 2:
            continue
        blk = pool.blocks[bid]
        assert blk.block_hash is not None, (blk, occ)
        assert len({i for _, i in occ}) == 1, occ
        for rid, i in occ:
            req = live[rid]
            assert i < len(req.block_hashes) and req.block_hashes[i] == blk.block_hash
            assert (i + 1) * B <= req.num_computed_tokens
    # Block tables cover exactly the computed tokens (they only grow; no over-allocation).
    for req in sched.running:
        blocks = kv.req_to_blocks.get(req.request_id, [])
        assert -(-req.num_computed_tokens // B) <= len(blocks) <= -(-(req.num_computed_tokens + spare_tokens) // B), req
        assert 0 < req.num_computed_tokens <= req.num_tokens
    for req in sched.waiting:
        assert req.request_id not in kv.req_to_blocks
        assert req.num_computed_tokens == 0 and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    # The prefix-cache index agrees with the blocks.
    for h, b in pool.cached_blocks.items():
        assert b.block_hash == h
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool.cached_blocks.get(b.block_hash) is b
    assert set(kv.num_cached_blocks) <= set(kv.req_to_blocks)
    # The worker, from the messages alone, holds what the scheduler holds.
    worker = getattr(sched, "fake_worker", None)
    if worker is not None:
        for req in sched.running:
            if req.request_id in worker.block_ids:
                assert worker.block_ids[req.request_id] == kv.get_block_ids(req.request_id), req
                assert worker.token_ids[req.request_id] == req.all_token_ids[: len(worker.token_ids[req.request_id])]
