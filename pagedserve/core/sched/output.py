"""The message the scheduler hands the worker each step: plain values, no live objects.

After vLLM v1's ``vllm/v1/core/sched/output.py``. Requests scheduled for the first time (or
resumed after preemption) travel in full as :class:`NewRequestData`; requests the worker
already holds travel as diffs in :class:`CachedRequestData` (block tables only grow, so only
new block ids). The worker keeps its own per-request state (token ids, block-table rows,
sampling tensors, seeded generators) and updates it from these diffs, so the same message can
go to a worker in another process, to several tensor-parallel workers, or across a
prefill/decode split. Nothing here holds a ``Request``; the module is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker does not hold yet (first scheduled, or resumed after preemption).

    Attributes:
        req_id: request id (unique among live requests).
        prompt_token_ids: the prompt.
        output_token_ids: tokens generated before a preemption (empty for a new request); the
            worker treats prompt + output as the sequence to compute.
        sampling_params: the request's sampling parameters (``n == 1``; the frontend fans
            ``n > 1`` out into separate requests).
        eos_token_ids: the model's EOS ids (``min_tokens`` masks them).
        block_ids: the request's whole block table after this step's allocation.
        num_computed_tokens: tokens whose K/V is already in the cache before this step
            (prefix-cache hit).
        lora_request: the request's LoRA adapter (None: the base model).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Optional[LoRARequest] = None


@dataclass
class CachedRequestData:
    """Diffs of requests the worker already holds, as parallel lists (one entry per request).

    Attributes:
        req_ids: request ids.
        new_block_ids: blocks appended to each block table this step (often empty).
        num_computed_tokens: tokens in the cache before this step.
        new_token_ids: tokens appended to the request that the worker did not sample itself
            (empty when the worker sampled every token it needs).
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled_new_reqs: requests sent in full.
        scheduled_cached_reqs: requests sent as diffs.
        num_scheduled_tokens: request id -> tokens computed this step, positions
            ``[num_computed_tokens, num_computed_tokens + n)``; insertion order is the
            scheduling order.
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens``.
        finished_req_ids: requests that finished or were aborted since the last step: the
            worker drops all their state.
        preempted_req_ids: requests preempted in this step: the worker drops their block table
            and batch row but keeps their seeded generator (they come back as new requests).
        structured_output_request_ids: constrained requests that sample this step, in the
            order of the rows of ``grammar_bitmask`` (a request with k drafts: k + 1 times in a
            row, one per position it samples).
        grammar_bitmask: ``[len(structured_output_request_ids), ceil(vocab_size / 32)]`` int32
            as little-endian bytes: bit t of row i set = token t allowed; None when no
            constrained request samples.
        kv_connector_metadata: what the KV connector's scheduler side planned this step
            (``pagedserve.distributed.kv_transfer.base.KVConnectorMetadata``), or None.
        scheduled_spec_decode_tokens: request id -> draft tokens (speculative decoding): the
            request's ``num_scheduled_tokens`` are its last token then these, at the positions
            after its known tokens; the worker verifies them.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Optional[bytes] = None
    kv_connector_metadata: Optional[Any] = None
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
