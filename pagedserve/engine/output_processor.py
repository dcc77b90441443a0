"""OutputProcessor: turns the core's per-step :class:`EngineCoreOutputs` into
:class:`RequestOutput`s (after vLLM v1's ``vllm/v1/engine/output_processor.py``).

Per request it keeps the frontend's state: each of the ``n`` sequences' incremental
detokenizer, output tokens and logprobs, and what has been reported so far. It detokenizes the
new tokens, checks stop strings (a sequence that hits one finishes here, and its id is returned
so the caller aborts it in the core), gathers the ``n`` sequences of a request, and shapes
outputs by ``output_kind`` (cumulative, delta, final only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedserve.core.outputs import EngineCoreOutput, EngineCoreOutputs
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.input_processor import ProcessedRequest
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceState:
    """One of the ``n`` completions of a request, as the frontend sees it."""

    request_id: str  # the core's id of this sequence
    index: int
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: float = 0.0
    num_tokens_sent: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    kv_transfer_params: Optional[dict] = None  # a prefill instance's, from the core's last output
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    finish_sent: bool = False
    pooled: Optional[bytes] = None  # the pooling runner's vector, with the final output
    terminators: frozenset = frozenset()  # EOS and stop token ids of this sequence

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    """A request and its sequences."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[SequenceState]
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None  # from the first completion to report
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


class OutputProcessor:
    """Frontend state of the live requests of one engine.

    Args:
        tokenizer: for detokenization and the text of logprob tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.sequence_of: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(self, req: ProcessedRequest) -> None:
        """Track a processed request. Raises ValueError when its id is in use."""
        if req.request_id in self.request_states:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        for c in req.children:  # "x#0" of a request "x" with n > 1 must not meet a request "x#0"
            if c.request_id in self.sequence_of or (c.request_id != req.request_id and c.request_id in self.request_states):
                raise ValueError(f"request_id {c.request_id!r} is already in use")
        wants_logprobs = req.params.logprobs is not None
        seqs = [
            SequenceState(
                c.request_id,
                i,
                IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, c.sampling_params),
                logprobs=[] if wants_logprobs else None,
                terminators=frozenset(c.eos_token_ids) | frozenset(c.sampling_params.stop_token_ids or ()),
            )
            for i, c in enumerate(req.children)
        ]
        state = RequestState(req.request_id, req.prompt, req.prompt_token_ids, req.params, req.children[0].arrival_time, seqs)
        self.request_states[req.request_id] = state
        for s in seqs:
            self.sequence_of[s.request_id] = (state, s)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the core ids of their sequences still running."""
        to_abort = []
        for rid in request_ids:
            state = self.request_states.pop(rid, None)
            if state is None:
                continue
            for s in state.sequences:
                self.sequence_of.pop(s.request_id, None)
                if not s.finished:
                    to_abort.append(s.request_id)
        return to_abort

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    # -- one step -------------------------------------------------------------------------
    def process_outputs(self, core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Fold in one step's outputs.

        Returns:
            (the RequestOutputs of requests that progressed, shaped by their output kind; the
            core ids of sequences that hit a stop string, which the caller must abort).
        """
        ts = core_outputs.timestamp
        changed: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in core_outputs.outputs:
            entry = self.sequence_of.get(out.request_id)
            if entry is None:  # aborted here after the core produced it
                continue
            state, seq = entry
            if seq.finished:
                continue
            if out.new_token_ids and state.params.prompt_logprobs is not None and state.prompt_logprobs is None:
                # Each completion scores the prompt (as vLLM's children); the first to report is kept.
                ids, lps, ranks = out.new_prompt_logprobs or ([], [], [])  # none for a one-token prompt
                state.prompt_logprobs = [None] + [self._logprob_entry(*e) for e in zip(ids, lps, ranks)]
            if self._update_sequence(seq, out, ts):
                to_abort.append(seq.request_id)
            changed[state.request_id] = state
        outputs = []
        for rid, state in changed.items():
            ro = self._make_output(state)
            if ro is not None:
                outputs.append(ro)
            if state.finished:
                del self.request_states[rid]
                for s in state.sequences:
                    self.sequence_of.pop(s.request_id, None)
        return outputs, to_abort

    def _update_sequence(self, seq: SequenceState, out: EngineCoreOutput, ts: float) -> bool:
        """Apply one core output; returns True when a stop string finished the sequence here
        while the core still runs it (the caller aborts it there)."""
        seq.num_cached_tokens = out.num_cached_tokens
        seq.first_scheduled_time = out.first_scheduled_time
        if out.kv_transfer_params is not None:
            seq.kv_transfer_params = out.kv_transfer_params
        if out.pooled is not None:
            seq.pooled = out.pooled
        if out.new_token_ids:
            seq.output_token_ids.extend(out.new_token_ids)
            if seq.first_token_time is None:
                seq.first_token_time = ts
            seq.last_token_time = ts
        # The token that ended a request by EOS or a stop id is not part of the text (a grammar
        # that completes ends on an ordinary token, which is).
        stop_terminated = out.finish_reason == "stop" and bool(out.new_token_ids) and out.new_token_ids[-1] in seq.terminators
        stop_str = seq.detokenizer.update(out.new_token_ids, stop_terminated)
        hit_stop_string = stop_str is not None and out.finish_reason is None
        dropped = 0
        if stop_str is not None:  # also when the core stopped it for length on the same token
            seq.finish_reason, seq.stop_reason = "stop", stop_str
            dropped = seq.detokenizer.num_token_ids_dropped
            if dropped:  # several ids at once (drafts): those after the stop string go, and their logprobs
                del seq.output_token_ids[-dropped:]
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.error if out.finish_reason == "error" else out.stop_reason
        if seq.logprobs is not None and out.new_logprobs is not None:
            for ids, lps, rank in out.new_logprobs[: len(out.new_logprobs) - dropped]:
                seq.logprobs.append(self._logprob_entry(ids, lps, rank))
                seq.cumulative_logprob += lps[0]
        if seq.finished:
            seq.finished_time = ts
        return hit_stop_string

    def _logprob_entry(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        """{token: Logprob} of one position: the chosen (or prompt) token first, then the top-k."""
        entry = {ids[0]: Logprob(lps[0], rank, self.tokenizer.convert_ids_to_tokens(ids[0]))}
        for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            if t not in entry:
                entry[t] = Logprob(lp, r, self.tokenizer.convert_ids_to_tokens(t))
        return entry

    def _make_output(self, state: RequestState) -> Optional[RequestOutput]:
        kind = state.params.output_kind
        finished = state.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outs = []
        for s in state.sequences:
            done = s.finished
            if delta and s.finish_sent:  # a finished sequence of n > 1 is reported once
                continue
            text = s.detokenizer.get_next_output_text(done, delta)
            start = s.num_tokens_sent if delta else 0
            token_ids = s.output_token_ids[start:]
            logprobs = s.logprobs[start:] if s.logprobs is not None else None
            s.num_tokens_sent = len(s.output_token_ids)
            s.finish_sent = done
            if delta and not token_ids and not text and not done:
                continue
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        prompt_logprobs = None if delta and state.prompt_logprobs_sent else state.prompt_logprobs
        state.prompt_logprobs_sent = state.prompt_logprobs is not None
        s0 = state.sequences[0]
        metrics = RequestMetrics(state.arrival_time, s0.first_scheduled_time, s0.first_token_time, s0.last_token_time, s0.finished_time)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=s0.num_cached_tokens,
            metrics=metrics,
            kv_transfer_params=s0.kv_transfer_params if finished else None,
            prompt_logprobs=prompt_logprobs,
            pooled=s0.pooled,
        )
