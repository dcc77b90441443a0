"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step decides ``{request: num_tokens}`` under a token budget (``max_num_batched_tokens``)
and a sequence limit (``max_num_seqs``), following vLLM v1's unified scheduler: there is no
prefill or decode phase, every request just tries to bring ``num_computed_tokens`` up to
``num_tokens``. RUNNING requests go first (a decode costs one token, a mid-prefill request
takes what the budget leaves), then WAITING requests in FCFS order, each after its prefix-cache
hit. Chunked prefill (Agrawal et al., "Sarathi-Serve", OSDI 2024) is that rule, not separate
code. When a running request cannot get a block, the most recently admitted running request is
preempted (its blocks freed, recomputed later: vLLM's recompute preemption) and nothing new is
admitted in that step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    """Limits of one step.

    Attributes:
        max_num_batched_tokens: token budget per step (tokens).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence, prompt plus output (tokens).
        enable_chunked_prefill: cut prompts longer than the remaining budget into chunks; when
            off, a prompt is admitted only once it fits the step's budget whole.
        long_prefill_token_threshold: cap on one request's chunk in a step (0 = none).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the live request (token ids are read from ``request.all_token_ids``).
        num_computed_tokens: tokens whose K/V is already in the cache before this step.
        num_new_tokens: tokens computed this step, positions
            ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.
        block_ids: the request's block table after this step's allocation.
        samples: this chunk reaches the end of the known tokens, so a token is sampled. Fixed
            when the step is scheduled (the request grows once the sampled token is appended).
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    # Prompt tokens looked up / served from the cache at a request's first admission. Resumes
    # after preemption are not counted (as in vLLM): they would mostly hit the request's own
    # blocks and make the hit rate track preemption churn instead of prefix reuse.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Scheduler:
    """Decides who runs each step; owns the request queues and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # -- queue management ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) live requests and free their blocks now."""
        assert status.finished
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        req.finished_time = time.monotonic()
        self.kv.free(req)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -------------------------------------------------------------------------
    def _chunk(self, num_tokens: int, budget: int) -> int:
        thr = self.config.long_prefill_token_threshold
        if thr > 0:
            num_tokens = min(num_tokens, thr)
        return min(num_tokens, budget)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and tokens, allocate their blocks, and advance their
        ``num_computed_tokens`` as if the step succeeds (the model runs every scheduled token).
        """
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput()
        scheduled: list[tuple[Request, int, int]] = []

        # 1) running requests, in admission order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, req.num_computed_tokens, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it is left

        # 2) waiting requests, FCFS, unless this step had to preempt.
        if not out.preempted_ids:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                num_remaining = req.num_tokens - num_hit
                if not self.config.enable_chunked_prefill and num_remaining > budget:
                    break
                num_new = self._chunk(num_remaining, budget)
                if self.kv.allocate_slots(req, num_new, hit_blocks, num_hit) is None:
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:  # first admission (not a resume after preemption)
                    req.num_cached_tokens = num_hit
                    self.stats.prefix_cache_queries += req.num_tokens
                    self.stats.prefix_cache_hits += num_hit
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                self.running.append(req)
                scheduled.append((req, num_hit, num_new))
                budget -= num_new

        for req, num_computed, num_new in scheduled:
            out.scheduled.append(ScheduledRequest(req, num_computed, num_new, self.kv.get_block_ids(req.request_id)))
            req.num_computed_tokens = num_computed + num_new
            out.num_batched_tokens += num_new
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append each sampled token and finish requests that hit EOS, a stop token, max_tokens
        or max_model_len; their blocks are freed in this same call.

        Args:
            sampled: request id -> sampled token id, for requests whose chunk reached the end.
        Returns:
            the requests that received a token or finished this step.
        """
        now = time.monotonic()
        touched = []
        finished = []
        for sr in scheduler_output.scheduled:
            req = sr.request
            if req.is_finished():  # aborted between schedule and update
                continue
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            req.append_output_token_ids([tok])
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            self.kv.update_block_hashes(req)
            touched.append(req)
            if self._check_stop(req, tok):
                finished.append(req)
        for req in finished:
            self.running.remove(req)
            self._free(req)
        return touched

    def _check_stop(self, req: Request, tok: int) -> bool:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and tok in req.eos_token_ids) or tok in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok if tok in params.stop_token_ids else None
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def get_stats(self) -> SchedulerStats:
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        return self.stats
