"""The scheduler's step budget: how many tokens a step may still take, and, with a step-time
target, how long it may last. Torch-free.

Every step has ``max_num_batched_tokens`` tokens; a prefill chunk is also cut to
``long_prefill_token_threshold`` when that is set. With ``EngineConfig.max_step_ms`` on (the
server's default; it needs chunked prefill), a :class:`StepCostModel` fits the step's wall time
against its tokens and attention pairs from the durations ``EngineCore`` reports
(:meth:`StepBudget.record_step_time`), and each prefill chunk is cut to what still fits 90 % of
the step's target once its decodes are counted (:class:`StepTimeBudget`; the target is
``max_step_ms``, or ``max_step_decode_multiple`` times the decodes alone when longer). It applies
whether or not decodes are running: a prefill alone is cut too, so anything that waits for the
end of a step (a new request's admission, an abort from a client that went away, a deadline)
waits at most about one target. Decodes always run, and a step's first prefill chunk gets at
least max(16, block_size) tokens, so prefills always advance.
"""

from __future__ import annotations

from typing import Optional

from pagedserve.core.sched.step_cost import StepCostModel, StepTimeBudget, attention_pairs


class StepBudget:
    """One step's token and time budget at a time (:meth:`start` opens the next step), and the
    step-cost model that learns from the steps run.

    Args:
        max_num_batched_tokens: tokens per step.
        long_prefill_token_threshold: the most tokens of one prefill chunk (0: no cap).
        max_step_ms: the step-time target (ms); 0 turns the time bound off (the scheduler passes
            0 without chunked prefill: an unchunked prompt cannot be cut).
        max_step_decode_multiple: the target may grow to this multiple of the step's decodes
            alone (0: off).
        block_size: chunks cut by time end on a block boundary when they can.

    Attributes:
        cost: the step-cost model (None with the time bound off).
        tokens: tokens the current step has left.
        time_limit: the current step's time bookkeeping (None when the bound is off or nothing
            prefills).
        last_step_features: the last step's (tokens, attention pairs) for
            :meth:`record_step_time`; None when it is not to be learned from.
        last_predicted_ms, last_target_ms: the last step's predicted duration and, when it
            prefilled under the bound, its target (for the step trace).
    """

    def __init__(
        self, max_num_batched_tokens: int, long_prefill_token_threshold: int, max_step_ms: float, max_step_decode_multiple: float, block_size: int
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_step_ms = max_step_ms
        self.max_step_decode_multiple = max_step_decode_multiple
        self.block_size = block_size
        self.cost: Optional[StepCostModel] = StepCostModel() if max_step_ms else None
        self.tokens = 0
        self.time_limit: Optional[StepTimeBudget] = None
        self._decodes_left = 0  # decodes the time budget counted that the step has not taken yet
        self.last_step_features: Optional[tuple[int, int]] = (0, 0)
        self.last_predicted_ms: Optional[float] = None
        self.last_target_ms: Optional[float] = None

    def start(self, running: list, any_waiting: bool) -> None:
        """Open a step over the ``running`` requests (whose decodes the time budget reserves up
        front); ``any_waiting``: whether waiting requests may prefill in it."""
        self.tokens = self.max_num_batched_tokens
        self.time_limit = None
        if self.cost is not None:
            self.time_limit = StepTimeBudget.for_step(
                self.cost, self.max_step_ms, running, any_waiting, self.block_size, self.max_step_decode_multiple
            )
        self._decodes_left = self.time_limit.num_decodes if self.time_limit is not None else 0

    @property
    def num_scheduled(self) -> int:
        """Tokens the current step has taken."""
        return self.max_num_batched_tokens - self.tokens

    def chunk(self, num_tokens: int, num_computed_tokens: int, decode: bool = False) -> int:
        """Tokens the step can give a request that has ``num_tokens`` left to compute after
        ``num_computed_tokens``: cut to the threshold and the tokens left and, unless it is a
        decode (reserved up front), to the time left. 0: no time left for it."""
        thr = self.long_prefill_token_threshold
        n = min(num_tokens, thr) if thr > 0 else num_tokens
        n = min(n, self.tokens)
        if self.time_limit is not None and not decode:
            n = self.time_limit.prefill_chunk(min(n, self.tokens - self._decodes_left), num_computed_tokens)
        return n

    def take(self, num_tokens: int, num_computed_tokens: int, decode: bool = False) -> None:
        """Count a scheduled chunk (or decode) of ``num_tokens`` after ``num_computed_tokens``."""
        self.tokens -= num_tokens
        if self.time_limit is not None:
            if decode:
                self._decodes_left -= 1
            else:
                self.time_limit.add(num_tokens, num_computed_tokens)

    def note_plan(self, scheduled: list) -> None:
        """Keep what the step just planned (``scheduled``: (request, num_computed_tokens,
        num_new_tokens) triples) for the trace and the next measurement."""
        if self.cost is None:
            return
        num_tokens = self.num_scheduled
        pairs = sum(attention_pairs(n, c) for _, c, n in scheduled)
        # A chunk scored for prompt logprobs also runs the LM head on every token: that step's
        # time would teach the model a dearer prompt token, so it is not learned from.
        scores = any(r.sampling_params.prompt_logprobs is not None and c < r.num_prompt_tokens - 1 for r, c, _ in scheduled)
        self.last_step_features = None if scores else (num_tokens, pairs)
        self.last_predicted_ms = self.cost.predict(num_tokens, pairs) if scheduled else None
        limit = self.time_limit
        self.last_target_ms = limit.step_target_ms if limit is not None and limit.num_prefills else None

    def record_step_time(self, duration_ms: float) -> None:
        """Teach the step-cost model the measured wall time (ms) of the step last planned."""
        if self.cost is not None and self.last_step_features is not None:
            self.cost.observe(*self.last_step_features, duration_ms)
