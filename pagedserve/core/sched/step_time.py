"""The scheduler's part in bounded step time (a mixin of :class:`Scheduler`).

With ``EngineConfig.max_step_ms`` on (the server's default), a :class:`StepCostModel` fits the
step's wall time against its tokens and attention pairs from the durations ``EngineCore``
reports (:meth:`StepTimeMixin.record_step_time`), and each prefill chunk is cut to what still
fits 90 % of the step's target once its decodes are counted (:class:`StepTimeBudget`; the
target is ``max_step_ms``, or ``max_step_decode_multiple`` times the decodes alone when longer).
It applies whether or not decodes are running: a prefill alone is cut too, so anything that
waits for the end of a step (a new request's admission, an abort from a client that went away,
a deadline) waits at most about one target. Decodes always run, and a step's first prefill
chunk gets at least max(16, block_size) tokens, so prefills always advance.
"""
from __future__ import annotations

from typing import Optional

from pagedserve.core.sched.step_cost import StepCostModel, StepTimeBudget, attention_pairs


class StepTimeMixin:
    """Needs ``self.config`` and ``self.running`` / ``self.waiting`` of the Scheduler.

    ``step_cost`` is the cost model (None with the bound off); ``last_step_features`` the last
    ``schedule()``'s (tokens, attention pairs), None when it is not to be learned from,
    ``last_predicted_ms`` its predicted duration and
    ``last_target_ms`` its target when it prefilled under the bound, for
    :meth:`record_step_time` and the step trace."""

    def _init_step_time(self) -> None:
        self.step_cost = StepCostModel() if self.config.max_step_ms and self.config.enable_chunked_prefill else None
        self.last_step_features = (0, 0)
        self.last_predicted_ms: Optional[float] = None
        self.last_target_ms: Optional[float] = None

    def _step_time_budget(self) -> Optional[StepTimeBudget]:
        """This step's time budget; None with the bound off or when nothing prefills."""
        if self.step_cost is None:
            return None
        c = self.config
        return StepTimeBudget.for_step(self.step_cost, c.max_step_ms, self.running, bool(self.waiting), c.block_size,
                                       c.max_step_decode_multiple)

    def _note_step_plan(self, scheduled: list, num_tokens: int, limit: Optional[StepTimeBudget]) -> None:
        """Keep what the step just planned (``scheduled``: (request, num_computed_tokens,
        num_new_tokens) triples; ``num_tokens`` in all) for the trace and the next measurement."""
        if self.step_cost is None:
            return
        pairs = sum(attention_pairs(n, c) for _, c, n in scheduled)
        # A chunk scored for prompt logprobs also runs the LM head on every token: that step's
        # time would teach the model a dearer prompt token, so it is not learned from.
        scores = any(r.sampling_params.prompt_logprobs is not None and c < r.num_prompt_tokens - 1 for r, c, _ in scheduled)
        self.last_step_features = None if scores else (num_tokens, pairs)
        self.last_predicted_ms = self.step_cost.predict(num_tokens, pairs) if scheduled else None
        self.last_target_ms = limit.step_target_ms if limit is not None and limit.num_prefills else None

    def record_step_time(self, duration_ms: float) -> None:
        """Teach the step-cost model the measured wall time (ms) of the step the last
        ``schedule()`` planned (``EngineCore.step`` calls this after each step)."""
        if self.step_cost is not None and self.last_step_features is not None:
            self.step_cost.observe(*self.last_step_features, duration_ms)
