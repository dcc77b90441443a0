"""Request state as the scheduler and KV cache manager see it."""

from __future__ import annotations

import enum
import time
from typing import Optional

from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3  # holds blocks that a KV connector is filling; not scheduled until they arrive
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # the request could not go on (its grammar failed, its KV transfer failed); ``Request.error`` says why
    FINISHED_TIMEOUT = 8  # past its deadline

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        """finish_reason: "stop", "length", "abort", "error" or "timeout" (None while alive)."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
            RequestStatus.FINISHED_TIMEOUT: "timeout",
        }.get(self)


class Request:
    """One sequence being generated.

    There is no separate prefill/decode phase: every step tries to bring
    ``num_computed_tokens`` up to ``num_tokens`` (prompt + output so far). A request with
    ``num_computed_tokens < num_tokens - 1`` after its scheduled chunk is mid-prefill and
    samples nothing that step.

    The seeded ``torch.Generator`` of a request lives in the worker, not here: this module is
    torch-free.

    Attributes:
        block_hashes: one hash per *full* block of ``all_token_ids`` (prefix caching), extended
            as tokens are appended (filled by the KV cache manager).
        stop_reason: the stop token id or stop string that ended the request, if any.
        kv_transfer_params: the connector's parameters from the client (a decode instance:
            where to read the prompt's KV; a prefill instance: ``do_remote_decode``).
        lora_request, lora_key: the LoRA adapter it runs with and the digest of its files
            (:func:`pagedserve.lora_request.adapter_digest`), None for the base model.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        deadline: Optional[float] = None,
        kv_transfer_params: Optional[dict] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
        lora_key: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.lora_key = lora_key  # the adapter's digest: part of the first block's hash
        self.deadline = deadline  # time.monotonic() past which it finishes as "timeout"
        # Prefill/decode disaggregation (see pagedserve.distributed.kv_transfer): what the
        # client sent, and what the connector hands back when the request finishes.
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_out: Optional[dict] = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission (tokens); -1 = not yet
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        # Tokens the worker holds for this request: those sent to it plus those it sampled.
        # The scheduler sends the rest (``CachedRequestData.new_token_ids``).
        self.num_tokens_on_worker = 0
        # The grammar matcher of a constrained request (structured output), set by the scheduler.
        self.grammar: Optional[object] = None
        # A thinking request (reasoning parser): the grammar starts after its end-of-thinking token.
        self.in_reasoning = sampling_params._reasoning_end_token_id is not None
        self.error: Optional[str] = None  # why it finished with FINISHED_ERROR
        # Prompt logprobs computed so far ((ids, logprobs, ranks) lists), sent with the first token.
        self.pending_prompt_logprobs: Optional[tuple[list, list, list]] = None
        # Timestamps (seconds, time.monotonic()) for metrics.
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = priority  # the priority policy runs smaller values first
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None

    def add_prompt_logprobs(self, chunk: tuple[list, list, list]) -> None:
        """Append the prompt logprobs of one chunk's positions (``ModelRunnerOutput.prompt_logprobs``)."""
        if self.pending_prompt_logprobs is None:
            self.pending_prompt_logprobs = ([], [], [])
        for acc, part in zip(self.pending_prompt_logprobs, chunk):
            acc.extend(part)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens  # type: ignore[return-value]

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
