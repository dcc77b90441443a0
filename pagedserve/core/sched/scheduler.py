"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Each step decides ``{request: num_tokens}`` under a token budget (``max_num_batched_tokens``)
and a sequence limit (``max_num_seqs``), following vLLM v1's unified scheduler: there is no
prefill or decode phase, every request just tries to bring ``num_computed_tokens`` up to
``num_tokens``. RUNNING requests go first (a decode costs one token, a mid-prefill request takes
what the budget leaves), then WAITING requests in the order of the scheduling policy (arrival,
or ``priority`` then arrival: see :mod:`.request_queue`), each after its prefix-cache hit, its
first chunk cut to the budget, and only if its blocks can be allocated without preempting
anyone (the first one that cannot waits, and everything behind it: no overtaking). Chunked
prefill (Agrawal et al., "Sarathi-Serve", OSDI 2024) is that rule, not separate code. When a
running request cannot get a block, the running list's last request (the most recently
admitted; under the priority policy the one with the largest priority value) is preempted (its
blocks freed, recomputed later: vLLM's recompute preemption) and nothing new is admitted in
that step. After the step, :meth:`Scheduler.update_from_output` appends the sampled tokens and
finishes the requests that stop (:func:`check_stop`).

Shape (vLLM v1's ``Scheduler``; mini-sglang's ``scheduler/{prefill,decode,cache}.py``): this
class owns the queues (``waiting``, ``running``, ``requests``) and reads top to bottom,
``schedule()`` then ``update_from_output()``; it holds three collaborators, each built with what
it needs as constructor arguments and none sharing the scheduler's ``self``:

- ``step_budget`` (:class:`.step_budget.StepBudget`): the step's tokens left, the long-prefill
  cap and the step-time target with its learnt cost model; ``schedule()`` asks it how many
  tokens each chunk gets and tells it what it took.
- ``drafter`` (:class:`.spec_decode.Drafter`; None without speculative decoding): the draft
  tokens of a step's decodes, and the accepted ones after it.
- ``remote_kv`` (:class:`.remote_kv.RemoteKVWaiter`; None without a KV connector): requests
  that wait for their prompt KV from a prefill instance (``WAITING_FOR_REMOTE_KVS``), and
  finished requests whose blocks a decode instance reads.

Admission (the waiting-queue half of ``schedule()``, :meth:`Scheduler._admit_waiting`) stays in
this class: it is the scheduler's core rule, and all it does is move requests between the
queues this class owns (pop ``waiting``, insert into ``running`` in the policy's order) and set
their scheduling state. As an object of its own it would need every queue, the stats and the
other three collaborators: the scheduler again under another name, or a class sharing its state.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Iterable, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.outputs import EngineCoreOutput, EngineCoreOutputs, KVConnectorOutput, ModelRunnerOutput, SchedulerStats
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.output import NewRequestData, SchedulerOutput
from pagedserve.core.sched.remote_kv import RemoteKVWaiter
from pagedserve.core.sched.request_queue import make_request_queue, priority_key
from pagedserve.core.sched.spec_decode import Drafter
from pagedserve.core.sched.step_budget import StepBudget
from pagedserve.core.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from pagedserve.core.sched.step_cost import StepCostModel


class Scheduler:
    """Decides who runs each step; owns the request queues and the KV cache manager.

    Args:
        config: a resolved :class:`EngineConfig` (``max_model_len`` and
            ``max_num_batched_tokens`` set, see ``EngineConfig.resolved``).
        kv_cache_manager: the block tables and prefix cache.
        structured_output_manager: grammars of constrained requests (None: none are accepted).
        kv_connector: the scheduler side of a KV connector (prefill/decode disaggregation,
            see :mod:`pagedserve.core.sched.remote_kv`), or None.
    Raises:
        ValueError: when the config is not resolved.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        structured_output_manager: Optional[StructuredOutputManager] = None,
        kv_connector=None,
    ) -> None:
        if config.max_model_len is None or config.max_num_batched_tokens is None:
            raise ValueError("Scheduler needs a resolved EngineConfig (max_model_len and max_num_batched_tokens set)")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.structured_output_manager = structured_output_manager
        self.waiting = make_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats(num_total_blocks=kv_cache_manager.num_total_blocks)
        # What the worker must hear about in the next SchedulerOutput.
        self.finished_req_ids: list[str] = []
        self.num_block_ids_on_worker: dict[str, int] = {}
        # The requests of the last schedule(), by id: update_from_output applies tokens only to
        # them (not to a request that took a finished one's id in between).
        self.scheduled_requests: dict[str, Request] = {}
        self.num_with_deadline = 0
        self.timed_out: list[Request] = []  # finished at their deadline, reported by the next update
        self.step_budget = StepBudget(
            config.max_num_batched_tokens,
            config.long_prefill_token_threshold,
            config.max_step_ms if config.enable_chunked_prefill else 0.0,
            config.max_step_decode_multiple,
            config.block_size,
        )
        self.drafter = Drafter(config.speculative, kv_cache_manager, config.max_model_len, self.stats) if config.speculative is not None else None
        self.connector = kv_connector
        self.remote_kv = RemoteKVWaiter(kv_connector, kv_cache_manager, config.block_size, self.stats) if kv_connector is not None else None

    # -- queue management ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError when its id is already in use or its structured
        output constraint does not compile."""
        if request.request_id in self.requests or (self.remote_kv is not None and self.remote_kv.in_use(request.request_id)):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs is not supported by this engine")
            request.grammar = self.structured_output_manager.new_matcher(constraint)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.deadline is not None:
            self.num_with_deadline += 1

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) live requests and free their blocks now.
        Unknown or finished ids are ignored."""
        assert status.finished
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                req.status = status
                self._free(req, free_blocks=not self.remote_kv.abort(req))
                done.append(req)
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request, free_blocks: bool = True) -> None:
        """Forget a finished request; its blocks are freed, or held for a remote reader
        (``free_blocks`` False: the remote-KV waiter has freed them, or frees them when the
        request's load reports)."""
        req.finished_time = time.monotonic()
        if req.deadline is not None:
            self.num_with_deadline -= 1
        if free_blocks and self.remote_kv is not None:
            self.remote_kv.release_blocks(req)
        elif free_blocks:
            self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self.num_block_ids_on_worker.pop(req.request_id, None)
        self.finished_req_ids.append(req.request_id)

    @property
    def num_waiting_for_remote(self) -> int:
        """Requests waiting for their prompt KV from a prefill instance."""
        return len(self.remote_kv.waiting_for_remote) if self.remote_kv is not None else 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.num_waiting_for_remote)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + self.num_waiting_for_remote

    def kv_poll_interval(self) -> Optional[float]:
        """Seconds between checks for KV transfers that finished while nothing else runs, or
        None when none is outstanding."""
        return self.remote_kv.poll_interval() if self.remote_kv is not None else None

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and tokens, allocate their blocks, advance their
        ``num_computed_tokens`` as if the step succeeds (the model runs every scheduled token),
        and describe it all as a :class:`SchedulerOutput` of plain values."""
        if self.num_with_deadline:
            now = time.monotonic()
            expired = [r for r in self.requests.values() if r.deadline is not None and r.deadline <= now]
            self.timed_out += self.finish_requests([r.request_id for r in expired], RequestStatus.FINISHED_TIMEOUT)
        out = SchedulerOutput()
        scheduled: list[tuple[Request, int, int]] = []
        new_ids: set[str] = set()
        kv = self.kv_cache_manager
        step = self.step_budget
        step.start(self.running, bool(self.waiting))

        # 1) running requests, in list order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and step.tokens > 0:
            req = self.running[i]
            num_computed = req.num_computed_tokens
            decode = req.num_tokens - num_computed == 1
            num_new = step.chunk(req.num_tokens - num_computed, num_computed, decode)
            if num_new <= 0:  # no time left for this chunk; the decodes behind it still run
                i += 1
                continue
            if not self._allocate_or_preempt(req, num_new, out):
                break  # req itself was preempted: nothing after it is left
            step.take(num_new, num_computed, decode)
            scheduled.append((req, num_computed, num_new))
            i += 1

        # 2) waiting requests, in the policy's order, unless this step had to preempt.
        if not out.preempted_req_ids:
            self._admit_waiting(step, scheduled, new_ids)

        # 3) draft tokens for decodes (speculative decoding), from what the budget and the free
        # blocks have left, in steps that prefill nothing under the step-time bound.
        if step.time_limit is None and self.drafter is not None and self.drafter.may_speculate(len(self.running)):
            step.tokens = self.drafter.add_drafts(scheduled, new_ids, step.tokens, out)

        cached = out.scheduled_cached_reqs
        self.scheduled_requests = {req.request_id: req for req, _, _ in scheduled}
        for req, num_computed, num_new in scheduled:
            rid = req.request_id
            block_ids = kv.get_block_ids(rid)
            if rid in new_ids:
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.sampling_params,
                        sorted(req.eos_token_ids),
                        block_ids,
                        num_computed,
                        req.lora_request,
                    )
                )
                req.num_tokens_on_worker = req.num_tokens
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(block_ids[self.num_block_ids_on_worker[rid] :])
                cached.num_computed_tokens.append(num_computed)
                cached.new_token_ids.append(req.all_token_ids[req.num_tokens_on_worker :])
                req.num_tokens_on_worker = req.num_tokens
            self.num_block_ids_on_worker[rid] = len(block_ids)
            out.num_scheduled_tokens[rid] = num_new
            req.num_computed_tokens = num_computed + num_new
        out.total_num_scheduled_tokens = step.num_scheduled
        step.note_plan(scheduled)
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        drafts_of = out.scheduled_spec_decode_tokens
        constrained = [
            req
            for req, _, _ in scheduled
            if req.grammar is not None and not req.in_reasoning and req.num_computed_tokens - len(drafts_of.get(req.request_id, ())) == req.num_tokens
        ]
        if constrained:  # they sample this step: the worker masks their logits (a row per draft too)
            drafts = [drafts_of.get(req.request_id, []) for req in constrained]
            out.structured_output_request_ids = [req.request_id for req, d in zip(constrained, drafts) for _ in range(1 + len(d))]
            out.grammar_bitmask, slow = self.structured_output_manager.grammar_bitmask([req.grammar for req in constrained], drafts)
            for i in slow:  # fails after this step instead of holding up every step
                constrained[i].error = "the grammar is too slow to follow: a token's mask took over 0.1 s"
        return out

    def _admit_waiting(self, step: StepBudget, scheduled: list[tuple[Request, int, int]], new_ids: set[str]) -> None:
        """Admit waiting requests into this step while ``step`` has tokens and time, in the
        queue's order, appending ``(request, num_computed_tokens, num_new_tokens)`` to
        ``scheduled`` and their ids to ``new_ids``: each after its prefix-cache hit (or with the
        blocks its remote KV was loaded into), and only if its blocks can be allocated without
        preempting anyone (the first one that cannot waits, and everything behind it). With
        LoRA, the running requests use at most ``max_loras`` adapters: a request whose adapter
        would be one too many waits likewise."""
        kv = self.kv_cache_manager
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while self.waiting and step.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            lora_id = req.lora_request.lora_int_id if req.lora_request is not None else None
            if lora_id is not None and lora_id not in loras and len(loras) >= self.config.max_loras:
                break
            if req.request_id in kv.req_to_blocks:  # its remote KV arrived: it holds the loaded blocks
                hit_blocks, num_hit = [], req.num_computed_tokens
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(req)
                if self.remote_kv is not None and req.kv_transfer_params is not None:
                    remote = self.remote_kv.try_admit(req, hit_blocks, num_hit)
                    if remote is False:  # no blocks for it now
                        break
                    if remote:  # it waits for its KV now
                        self.waiting.pop()
                        continue
            num_remaining = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_remaining > step.tokens:
                break
            num_new = step.chunk(num_remaining, num_hit)
            if num_new <= 0:  # no time left
                break
            if kv.allocate_slots(req, num_new, hit_blocks, num_hit - req.num_computed_tokens) is None:
                if not self.running and self.remote_kv is not None and self.remote_kv.release_loaded(list(self.waiting)[1:]):
                    continue
                break
            self.waiting.pop()
            if req.num_cached_tokens < 0:  # first admission (not a resume after preemption)
                req.num_cached_tokens = num_hit
                if req.sampling_params.prompt_logprobs is None:  # else no lookup was made (as vLLM counts)
                    self.stats.prefix_cache_queries += req.num_tokens
                    self.stats.prefix_cache_hits += num_hit
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            if self.config.scheduling_policy == "priority":  # the back is preempted first
                bisect.insort(self.running, req, key=priority_key)
            else:
                self.running.append(req)
            scheduled.append((req, num_hit, num_new))
            new_ids.add(req.request_id)
            step.take(num_new, num_hit)
            if lora_id is not None:
                loras.add(lora_id)

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate ``num_new`` slots for a running request, preempting from the back of the
        running list until they fit; False when ``req`` itself had to go."""
        while self.kv_cache_manager.allocate_slots(req, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_req_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        self.num_block_ids_on_worker.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(req)

    # -- after the step --------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append each sampled token and finish requests that hit EOS, a stop token, max_tokens
        or max_model_len; their blocks are freed in this same call.

        Returns:
            one :class:`EngineCoreOutput` per request that received a token (requests aborted
            between ``schedule`` and now are skipped) or passed its deadline in ``schedule``,
            and the stats after the step.
        """
        now = time.monotonic()
        outputs = [
            EngineCoreOutput(
                r.request_id, [], finish_reason="timeout", num_cached_tokens=max(0, r.num_cached_tokens), first_scheduled_time=r.first_scheduled_time
            )
            for r in self.timed_out
        ]
        self.timed_out = []
        if self.remote_kv is not None and runner_output.kv_connector_output is not None:
            outputs += self._update_from_kv_output(runner_output.kv_connector_output)
        logprobs = runner_output.logprobs
        for rid, chunk in runner_output.prompt_logprobs.items():
            req = self.scheduled_requests.get(rid)
            if req is not None and not req.is_finished():
                req.add_prompt_logprobs(chunk)
        for rid, pooled in runner_output.pooled.items():
            req = self.scheduled_requests.get(rid)
            if req is not None and not req.is_finished():
                outputs.append(self._finish_pooled(req, pooled, now))
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        for rid, tok in runner_output.sampled.items():
            req = self.scheduled_requests.get(rid)
            if req is None or req.is_finished():  # aborted between schedule and update
                continue
            drafts = drafts_of.get(rid)
            tokens = self.drafter.accept(req, drafts, runner_output.num_accepted_tokens.get(rid, 0), tok) if drafts else [tok]
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.num_prompt_tokens += req.num_prompt_tokens
            req.last_token_time = now
            for n, tok in enumerate(tokens, start=1):  # noqa: B007  (n is read after the loop); the worker sampled them, so it holds them
                req.append_output_token_ids([tok])
                req.num_tokens_on_worker += 1
                stopped = check_stop(req, tok, self.config.max_model_len, self.structured_output_manager)
                if stopped:
                    break
            self.stats.num_generation_tokens += n
            self.kv_cache_manager.update_block_hashes(req)
            lps = logprobs.get(rid)
            out = EngineCoreOutput(
                rid,
                tokens[:n],
                lps[:n] if lps else None,
                req.status.finish_reason,
                req.stop_reason if stopped else None,
                max(0, req.num_cached_tokens),
                req.first_scheduled_time,
                req.error,
            )
            if req.pending_prompt_logprobs is not None:
                out.new_prompt_logprobs, req.pending_prompt_logprobs = req.pending_prompt_logprobs, None
            outputs.append(out)
            if stopped:
                self.running.remove(req)
                self._free(req)
                out.kv_transfer_params = req.kv_transfer_params_out
        stats = self.get_stats()
        if runner_output.kv_connector_output is not None:
            stats.kv_transfer_seconds = list(runner_output.kv_connector_output.transfer_seconds)
        return EngineCoreOutputs(outputs, now, stats)

    def _finish_pooled(self, req: Request, pooled: bytes, now: float) -> EngineCoreOutput:
        """The pooling runner: ``req``'s prompt is done and pooled; it finishes ("stop") without
        a token and its blocks are freed now."""
        req.first_token_time = req.last_token_time = now
        self.stats.num_prompt_tokens += req.num_prompt_tokens
        req.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(req)
        self._free(req)
        return EngineCoreOutput(
            req.request_id,
            [],
            finish_reason="stop",
            num_cached_tokens=max(0, req.num_cached_tokens),
            first_scheduled_time=req.first_scheduled_time,
            pooled=pooled,
        )

    def _update_from_kv_output(self, kvo: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Apply the KV transfers the worker side finished: loaded (or to-recompute) requests
        go back to the front of the waiting queue; outputs of requests that failed for good."""
        resumed, failed = self.remote_kv.update(kvo)
        for req in failed:
            self._free(req, free_blocks=False)
        for req in reversed(resumed):
            self.waiting.prepend(req)
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason="error",
                error=r.error,
                num_cached_tokens=max(0, r.num_cached_tokens),
                first_scheduled_time=r.first_scheduled_time,
            )
            for r in failed
        ]

    # -- for the engine ----------------------------------------------------------------------
    def record_step_time(self, duration_ms: float) -> None:
        """Teach the step budget's cost model the measured wall time (ms) of the step the last
        ``schedule()`` planned (``EngineCore.step`` calls this after each step)."""
        self.step_budget.record_step_time(duration_ms)

    @property
    def step_cost(self) -> Optional[StepCostModel]:
        """The step budget's cost model (None with the step-time bound off)."""
        return self.step_budget.cost

    def get_stats(self) -> SchedulerStats:
        """A snapshot of the counters (a new object each call)."""
        s = self.stats
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting) + self.num_waiting_for_remote
        s.num_free_blocks = self.kv_cache_manager.num_free_blocks
        snap = SchedulerStats(**vars(s))
        snap.kv_transfer_failures = dict(s.kv_transfer_failures)
        snap.spec_decode_num_accepted_tokens_per_pos = dict(s.spec_decode_num_accepted_tokens_per_pos)
        return snap


def check_stop(req: Request, tok: int, max_model_len: int, grammars: Optional[StructuredOutputManager]) -> bool:
    """After ``tok`` was appended to ``req``: set its finished status and return True when it
    ends here (its grammar, which starts after a thinking request's end-of-thinking token,
    completed or failed, EOS unless ``ignore_eos`` once ``min_tokens``
    are out, a stop token id, ``max_tokens``, or ``max_model_len``)."""
    params = req.sampling_params
    if req.in_reasoning:  # unconstrained until it stops thinking; the end token is not the grammar's
        req.in_reasoning = tok != params._reasoning_end_token_id
    elif req.grammar is not None:
        state = grammars.accept_token(req.grammar, tok)
        if state is not None and state != "done":
            req.error = f"structured output failed: {state}"
        if req.error is not None:
            req.status = RequestStatus.FINISHED_ERROR
            return True
        if state == "done":
            req.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
            return True
    if req.num_output_tokens >= params.min_tokens:
        if (not params.ignore_eos and tok in req.eos_token_ids) or tok in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok if tok in params.stop_token_ids else None
            return True
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
