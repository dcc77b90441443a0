"""What the engine hands back, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    """Log probability (natural log, raw model distribution) of one token, its rank (1 = most
    likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    Attributes:
        text: generated text (all of it, or only the new part for DELTA output).
        token_ids: generated token ids (likewise).
        logprobs: per generated token, {token_id: Logprob} holding the sampled token and the
            top ``logprobs`` tokens; None when not requested.
        finish_reason: "stop", "length", "abort", "error" (its structured-output grammar
            failed), or None while running.
        stop_reason: the stop string or stop token id that ended it (None for EOS or length);
            for "error", the error message.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps in seconds (time.monotonic()) of one request."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """Output of one request (all its completions).

    Attributes:
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, per prompt token
            {token_id: Logprob} holding that token and the top ``prompt_logprobs`` tokens at its
            position (None for the first token, which nothing predicts); in the first output of
            a DELTA request and in every output otherwise, once the first token is out.
        kv_transfer_params: a prefill instance's ``do_remote_decode`` request, finished: where
            a decode instance reads its KV (see ``pagedserve.distributed.kv_transfer``).
        pooled: the pooling runner's raw pooled hidden state of the finished request
            (little-endian float32 bytes, ``[hidden_size]``, before truncation and
            normalization; ``LLM.embed`` and ``/v1/embeddings`` turn it into the embedding).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    extra: dict = field(default_factory=dict)
    kv_transfer_params: Optional[dict] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    pooled: Optional[bytes] = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``): ``embedding`` holds
    ``hidden_size`` floats (or the requested ``dimensions``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
