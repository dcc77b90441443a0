"""Messages across the engine's boundaries, as plain values (torch-free):

* worker -> core: :class:`ModelRunnerOutput` (sampled tokens, logprobs where asked);
* front -> core: :class:`EngineCoreRequest` (a validated, tokenized request with ``n == 1``);
* core -> front: :class:`EngineCoreOutputs` once per step (new tokens of each request that
  progressed, finish reasons, and the core's :class:`SchedulerStats`).

Each is a dataclass of ints, floats, strings, lists and dicts, so it can be encoded with
msgpack (:mod:`pagedserve.messages`) to cross a process boundary. :class:`EngineCoreInfo` is
the core's ready message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig

# (token ids, logprobs, rank of the sampled token): the sampled token first, then the top-k.
TokenLogprobs = tuple[list[int], list[float], int]
# Prompt logprobs of consecutive prompt positions: per position, the next prompt token then the
# top-k (token ids, logprobs), and the rank of that prompt token.
PromptLogprobs = tuple[list[list[int]], list[list[float]], list[int]]


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step.

    Attributes:
        sampled: request id -> sampled token id (only requests whose chunk reached the end of
            their known tokens).
        logprobs: request id -> one :data:`TokenLogprobs` per token it appended this step (the
            accepted drafts, then the sampled token), for requests that asked for logprobs.
        prompt_logprobs: request id -> :data:`PromptLogprobs` of the prompt positions this
            step's chunk computed, for requests that asked for prompt logprobs (each position
            once, in order, through chunking and preemption).
        num_accepted_tokens: for requests scheduled with draft tokens, how many of the drafts
            were kept (a leading run, 0 to all); ``sampled`` is then the token after them.
        pooled: the pooling runner: request id -> its pooled hidden state (little-endian float32
            bytes, ``[hidden_size]``), for requests whose prompt ended this step.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    kv_connector_output: Optional["KVConnectorOutput"] = None
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    pooled: dict[str, bytes] = field(default_factory=dict)


@dataclass
class KVConnectorOutput:
    """What the worker side of a KV connector finished since the last step.

    Attributes:
        finished_sending: producer: requests whose held blocks may be freed (the consumer read
            them and said so, or the lease ran out).
        finished_recving: consumer: requests whose blocks were loaded completely and checked.
        failed_recving: consumer: request id -> reason ("timeout", "handshake", "digest",
            "peer_error", "aborted", ...) for loads that ended without every block.
        sent_tokens, received_tokens: tokens whose KV was sent / received in this interval.
        transfer_seconds: wall time of each completed load (consumer), seconds.
        failures: reason -> count of failed transfers in this interval (either side).
    """

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: dict[str, str] = field(default_factory=dict)
    sent_tokens: int = 0
    received_tokens: int = 0
    transfer_seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.sent_tokens
            or self.received_tokens
            or self.transfer_seconds
            or self.failures
        )


@dataclass
class EngineCoreRequest:
    """One sequence for the core to generate (the frontend fans ``n > 1`` out).

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: validated token ids (inside the vocabulary, shorter than
            max_model_len).
        sampling_params: with ``max_tokens`` filled in and ``n == 1``.
        eos_token_ids: ids that end the request unless ``ignore_eos``.
        arrival_time: ``time.monotonic()`` seconds when the request reached the server (the
            monotonic clock is shared by the processes of one host).
        cache_salt: requests with different salts never share prefix-cache blocks.
        deadline: ``time.monotonic()`` after which the request is finished as "timeout"
            (its blocks freed), or None.
        kv_transfer_params: prefill/decode disaggregation parameters (see
            ``pagedserve.distributed.kv_transfer``), or None.
        priority: under ``scheduling_policy="priority"``, smaller values are scheduled first
            (0 otherwise).
        lora_request: the LoRA adapter the request runs with (None: the base model).
        lora_key: its digest as the front registered it (the core refuses a stale one).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    cache_salt: Optional[str] = None
    deadline: Optional[float] = None
    kv_transfer_params: Optional[dict] = None
    priority: int = 0
    lora_request: Optional[LoRARequest] = None
    lora_key: Optional[str] = None


@dataclass
class EngineCoreOutput:
    """What changed for one request in one step.

    Attributes:
        new_token_ids: tokens sampled this step (one, several with speculative decoding, or
            none when only finishing).
        new_logprobs: logprobs of each new token (in the order of ``new_token_ids``), when asked.
        finish_reason: "stop" (EOS, a stop token id or a completed grammar), "length",
            "error" (the request's grammar could not be followed; ``error`` says why), or None.
        stop_reason: the stop token id that ended it (None for EOS or length).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission.
        first_scheduled_time: ``time.monotonic()`` of the request's first scheduling; sent
            with every output (a float), so the frontend needs no extra event.
        kv_transfer_params: on the final output of a prefill instance's request, where a
            decode instance can read its KV (``do_remote_prefill``, ``remote_host``, ...).
        new_prompt_logprobs: with the request's first token, when it asked for prompt
            logprobs: :data:`PromptLogprobs` of prompt positions 0 .. P - 2 (position ``i``
            scores prompt token ``i + 1``).
        pooled: the pooling runner's output of a finished request (see
            ``ModelRunnerOutput.pooled``).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, None] = None
    num_cached_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    error: Optional[str] = None
    kv_transfer_params: Optional[dict] = None
    new_prompt_logprobs: Optional[PromptLogprobs] = None
    pooled: Optional[bytes] = None


@dataclass
class SchedulerStats:
    """The core's counters, as of the end of a step (tokens, blocks, requests).

    Attributes:
        num_running, num_waiting: sequences in each queue.
        num_preemptions: cumulative preemptions.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / served from the
            prefix cache at first admission (cumulative). Resumes after preemption are not
            counted, as in vLLM.
        num_total_blocks, num_free_blocks: the KV block pool (free includes cached blocks no
            request holds).
        num_prompt_tokens, num_generation_tokens: cumulative, counted when each request's
            prefill completes (cached tokens included) and per sampled token.
        kv_transfer_sent_tokens, kv_transfer_received_tokens: cumulative tokens whose KV this
            instance sent / received over its KV connector.
        kv_transfer_failures: cumulative failed transfers by reason.
        kv_transfer_seconds: wall times (s) of the loads completed in the last step only.
        spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens:
            cumulative verified decodes that carried drafts, their drafts, and the drafts kept.
        spec_decode_num_accepted_tokens_per_pos: cumulative drafts kept at each draft position
            (key: the position from 0, as a string).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    kv_transfer_sent_tokens: int = 0
    kv_transfer_received_tokens: int = 0
    kv_transfer_failures: dict[str, int] = field(default_factory=dict)
    kv_transfer_seconds: list[float] = field(default_factory=list)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: dict[str, int] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks held by live requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class EngineCoreOutputs:
    """One step's outputs.

    Attributes:
        outputs: one entry per request that received a token or finished.
        timestamp: ``time.monotonic()`` when the step ended (token times of every output).
        scheduler_stats: the core's counters after the step.
        num_scheduled_tokens: tokens the step computed (0 for a report without a step).
        kv_events: with data parallelism, the prefix-cache changes since the last outputs:
            runs ``[kind, [16-byte block hash, ...]]``, kind "stored", "removed" or "cleared"
            (see ``BlockPool.take_kv_events``); None when off or unchanged.
        engine_index: the data-parallel replica that sent it (set by the front's DP client;
            0 with one engine).
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0
    scheduler_stats: Optional[SchedulerStats] = None
    num_scheduled_tokens: int = 0
    kv_events: Optional[list] = None
    engine_index: int = 0


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The server's counters over the replicas: numbers summed, counts by key summed, per-step
    lists joined."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SchedulerStats):
        values = [getattr(s, f.name) for s in stats]
        if values and isinstance(values[0], dict):
            merged: dict = {}
            for v in values:
                for k, x in v.items():
                    merged[k] = merged.get(k, 0) + x
            out[f.name] = merged
        elif values and isinstance(values[0], list):
            out[f.name] = [x for v in values for x in v]
        else:
            out[f.name] = sum(values)
    return SchedulerStats(**out)


@dataclass
class EngineCoreInfo:
    """What the frontend needs to know of a started core (sent in its ready message).

    Attributes:
        config: the resolved config (max_model_len and the token budget filled in).
        num_blocks, block_bytes: the KV pool (blocks, bytes per block).
        dtype, device: as strings ("bfloat16", "cpu").
        model_dir: the resolved HF-style model directory (tokenizer and config live there).
        block_hash_seed: the prefix cache's hash seed (16 bytes, from the model identity), so
            a data-parallel front hashes requests' blocks exactly as this core does.
        weights_type: the weights' kind: a float dtype name ("bfloat16") or the quantized
            types joined by "+" ("Q4_1+Q8_0").
        weight_bytes: bytes the weights take in memory (quantized values, scales and float
            parameters).
        loras: the LoRA adapters registered at start (``--lora-modules``), as ``[LoRARequest,
            digest]`` pairs.
    """

    config: "EngineConfig"
    num_blocks: int
    block_bytes: int
    dtype: str
    device: str
    model_dir: str
    block_hash_seed: bytes = b""
    weights_type: str = ""
    weight_bytes: int = 0
    loras: list = field(default_factory=list)
