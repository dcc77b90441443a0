"""The scheduler's admission of waiting requests (a mixin of :class:`Scheduler`). Torch-free.

After the running requests, waiting ones are admitted in the queue policy's order while the
step's token budget and ``max_num_seqs`` allow: each after its prefix-cache hit (or with the
blocks its remote KV was loaded into, see :mod:`.remote_kv`), its first chunk cut to the token
budget and the step-time target, and only if its blocks can be allocated without preempting
anyone (the first one that cannot waits, and everything behind it: no overtaking).
"""
from __future__ import annotations

import bisect
import time
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.request_queue import priority_key
from pagedserve.core.sched.step_budget import StepBudget


class AdmissionMixin:
    """Needs the Scheduler's ``config``, ``waiting``, ``running``, ``stats``,
    ``kv_cache_manager``, ``connector`` and its ``_chunk`` and remote-KV methods."""

    def _admit_waiting(self, step: StepBudget, scheduled: list[tuple[Request, int, int]], new_ids: set[str]) -> None:
        """Admit waiting requests into this step while ``step`` has tokens and time, appending
        ``(request, num_computed_tokens, num_new_tokens)`` to ``scheduled`` and their ids to
        ``new_ids``."""
        kv = self.kv_cache_manager
        while self.waiting and step.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
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
