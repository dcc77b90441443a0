"""InputProcessor: the one place where a request is tokenized and validated before it reaches
the engine core (``LLM.generate``, the CLI and the HTTP server all go through it).

A request that passes becomes one :class:`EngineCoreRequest` per completion (``n > 1`` is
fanned out here into children ``{id}#{i}`` with seeds ``seed + i``), so the core only ever sees
valid token ids, a prompt that leaves room to generate, ``max_tokens`` filled in and sampling
parameters in range. Everything refused raises :class:`RequestError` (a ``ValueError``) whose
``param`` names the request field, set where the field is checked.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

from pagedserve.core.outputs import EngineCoreRequest
from pagedserve.core.structured_output import StructuredOutputManager
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import RequestError, SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]


# allowed_token_ids and bad-word token ids over all of one request's sequences (each carries a
# copy to the engine, which builds a [vocab] mask for each): 2**18 is five full-vocabulary lists
# of SmolLM2.
MAX_BAN_IDS_PER_REQUEST = 1 << 18


def check_text(text: str, param: str) -> None:
    """Reject strings that are not valid Unicode text (e.g. a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{param} is not valid UTF-8 text (it contains a lone surrogate).", param=param) from None


@dataclass
class ProcessedRequest:
    """A validated request: the parent the frontend reports on, and the core's children."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[EngineCoreRequest]


class InputProcessor:
    """Tokenizes and validates requests for one model.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_model_len: prompt + output limit (tokens), as resolved by the engine core.
        eos_token_ids: the model's EOS ids (generation config).
        scheduling_policy: the engine's (``EngineConfig.scheduling_policy``); under "fcfs" a
            request's priority must be 0.
        pooling: the engine makes embeddings (``runner="pooling"``): a prompt is an input to
            embed, at most max_model_len - 1 tokens, and is refused in those words.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: set[int], scheduling_policy: str = "fcfs", pooling: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = sorted(eos_token_ids)
        self.grammars = StructuredOutputManager(lambda: tokenizer, vocab_size, lambda _: self.eos_token_ids)
        self._counter = 0

    # -- tokens -----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        check_text(text, param)
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def truncate_prompt(self, ids: list[int], keep: Optional[int]) -> list[int]:
        """The last ``keep`` token ids (vLLM's ``truncate_prompt_tokens``: -1 = max_model_len;
        None = all). Raises RequestError when ``keep`` exceeds max_model_len."""
        if keep is None:
            return ids
        if isinstance(keep, bool) or not isinstance(keep, int) or not (keep == -1 or keep >= 1):
            raise RequestError(f"truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got {keep!r}.", param="truncate_prompt_tokens")
        if keep > self.max_model_len:
            raise RequestError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({self.max_model_len}). Please select a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    def check_token_ids(self, ids: list[int], what: str = "prompt", param: Optional[str] = "prompt") -> None:
        """Raises RequestError for an empty list or an id outside the vocabulary."""
        if not ids:
            raise RequestError(f"{what} must not be empty.", param=param)
        V = self.vocab_size
        for t in ids:
            if not 0 <= t < V:
                raise RequestError(f"{what} contains token id {t} outside the vocabulary [0, {V}).", param=param)

    def parse_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int], Optional[str]]:
        """``(text, token ids, cache_salt)`` of an offline prompt: a string, a list of ids, or a
        dict with ``prompt`` or ``prompt_token_ids`` (and optionally ``cache_salt``)."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt), None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._as_token_ids(prompt["prompt_token_ids"]), salt
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"]), salt
            raise RequestError("prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt")
        if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):  # also numpy arrays, tensors
            return None, self._as_token_ids(prompt.tolist() if hasattr(prompt, "tolist") else prompt), None
        raise RequestError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}", param="prompt")

    @staticmethod
    def _as_token_ids(ids) -> list[int]:
        try:
            return [operator.index(t) for t in ids]
        except TypeError:
            raise RequestError("prompt_token_ids must be a list of integers", param="prompt") from None

    # -- lengths ----------------------------------------------------------------------------
    def resolve_max_tokens(
        self, requested: Optional[int], prompt_len: int, field_name: str = "max_tokens", prompt_field: str = "prompt", strict: bool = True
    ) -> int:
        """``max_tokens`` for a prompt of ``prompt_len`` tokens (None = up to max_model_len).

        With ``strict`` (the OpenAI API), prompt + max_tokens over max_model_len is refused;
        without it (offline, as vLLM's LLM), the request is cut at max_model_len.

        Raises:
            RequestError: the prompt leaves no room, or (strict) the total is too long.
        """
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"{prompt_field} is {prompt_len} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}. Please shorten the {prompt_field}.",
                param=prompt_field,
            )
        if requested is None:
            return self.max_model_len - prompt_len
        if requested < 1:
            raise RequestError(f"{field_name} must be at least 1, got {requested}.", param=field_name)
        if strict and prompt_len + requested > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_field}, {requested} in {field_name}). "
                f"Please reduce the length of the {prompt_field} or {field_name}.",
                param=field_name,
            )
        return requested

    def check_embedding_input(self, input_len: int, field: str = "prompt") -> None:
        """Raises RequestError when an input to embed is over max_model_len - 1 tokens (nothing
        is generated: the limit is the pooling runner's, not room to generate)."""
        if input_len >= self.max_model_len:
            limit = self.max_model_len - 1
            raise RequestError(
                f"{field} is {input_len} tokens, longer than the {limit} tokens (max_model_len - 1, max_model_len={self.max_model_len}) "
                f"an input to embed can have. Please shorten it, or truncate it to its last tokens with "
                f"truncate_prompt_tokens (at most {limit}).",
                param=field,
            )

    def check_params(self, params: SamplingParams) -> None:
        """Raises RequestError for ids outside the vocabulary, an unsupported field, or a
        structured-output constraint that does not compile (checked here, in the frontend, so
        a malformed schema never reaches the engine core)."""
        params.verify_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            try:
                self.grammars.validate(params.structured_outputs)
            except RequestError:
                raise
            except ValueError as e:  # the compiler's words: "structured_outputs.<kind> is invalid: ..."
                raise RequestError(str(e), param="structured_outputs") from None
            except RecursionError:
                raise RequestError("structured_outputs is nested too deeply.", param="structured_outputs") from None
        for name in ("allowed_token_ids", "bad_words"):
            if getattr(params, name) and params.structured_outputs is not None:  # the two masks could leave nothing
                raise RequestError(f"{name} cannot be combined with a structured output constraint or a forced tool call.", param=name)
        params._bad_words_token_ids = self.bad_words_token_ids(params.bad_words or [])
        self.check_ban_budget(params)
        if params.allowed_token_ids:  # a bad word bans its last token only after its other tokens, which must be allowed
            allowed = set(params.allowed_token_ids)
            usable = allowed - {w[-1] for w in params._bad_words_token_ids if allowed.issuperset(w[:-1])}
            if not usable:
                raise RequestError(
                    "bad_words can ban every token of allowed_token_ids (after the words' other tokens): nothing could be sampled.", param="bad_words"
                )
            if params.min_tokens and usable <= set(self.eos_token_ids) | set(params.stop_token_ids):
                raise RequestError(
                    "allowed_token_ids holds only EOS and stop token ids (and bad words), which min_tokens bans: nothing could be sampled.",
                    param="allowed_token_ids",
                )

    def check_ban_budget(self, params: SamplingParams, num_prompts: int = 1) -> None:
        """Each sequence carries its own copy of ``allowed_token_ids`` and the bad words' ids to
        the engine, which builds a mask per sequence: their total over the request's sequences
        is capped (``MAX_BAN_IDS_PER_REQUEST``). Raises RequestError naming the field."""
        size = len(params.allowed_token_ids or ()) + sum(len(w) for w in params._bad_words_token_ids)
        if size * params.n * num_prompts > MAX_BAN_IDS_PER_REQUEST:
            name = "allowed_token_ids" if params.allowed_token_ids else "bad_words"
            raise RequestError(
                f"{name}: {size} token ids for each of {params.n * num_prompts} sequences exceed the "
                f"{MAX_BAN_IDS_PER_REQUEST:,} one request may carry; lower n or shorten the list.",
                param=name,
            )

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token ids of each bad word as it stands (leading spaces stripped) and after a
        space (mid-text spelling, kept where it differs), as vLLM's ``bad_words``."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if ids and ids not in out:
                    out.append(ids)
        return out

    def check_priority(self, priority: Any) -> int:
        """A request's priority (an int64; smaller runs first under the priority policy).

        Raises:
            RequestError: not an int64, or non-zero while the policy is "fcfs" (as vLLM).
        """
        try:
            value = operator.index(priority)  # an int, or a NumPy integer
        except TypeError:
            value = None
        if isinstance(priority, bool) or value is None or not -(2**63) <= value < 2**63:
            raise RequestError(f"priority must be an integer in [-2**63, 2**63), got {priority!r}.", param="priority")
        priority = value
        if priority != 0 and self.scheduling_policy != "priority":
            raise RequestError(
                f"priority {priority} needs priority scheduling, which is not enabled "
                '(start the engine with --scheduling-policy priority, or LLM(scheduling_policy="priority")).',
                param="priority",
            )
        return priority

    # -- requests ---------------------------------------------------------------------------
    def process(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
        lora: Optional[tuple[LoRARequest, str]] = None,
    ) -> ProcessedRequest:
        """Validate an offline prompt (any :data:`PromptType`) and fan it out.

        Raises:
            RequestError: naming the field (empty prompt, prompt too long, ids outside the
                vocabulary, invalid sampling parameters).
        """
        priority = self.check_priority(priority)
        text, ids, salt = self.parse_prompt(prompt)
        as_text = isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)
        self.check_token_ids(ids, "prompt" if as_text else "prompt_token_ids")
        params = (params or SamplingParams()).clone()
        ids = self.truncate_prompt(ids, params.truncate_prompt_tokens)
        if self.pooling:
            self.check_embedding_input(len(ids), "prompt" if as_text else "prompt_token_ids")
        params.max_tokens = self.resolve_max_tokens(params.max_tokens, len(ids), strict=False)
        self.check_params(params)
        return self.make_request(request_id, text, ids, params, arrival_time, salt if salt is not None else cache_salt, priority=priority, lora=lora)

    def make_request(
        self,
        request_id: Optional[str],
        prompt_text: Optional[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        timeout_s: Optional[float] = None,
        kv_transfer_params: Optional[dict] = None,
        priority: int = 0,
        lora: Optional[tuple[LoRARequest, str]] = None,
    ) -> ProcessedRequest:
        """Fan out checked token ids and params (``check_params`` passed, ``max_tokens`` set,
        ``priority`` checked) into the core's requests (each child carries
        ``kv_transfer_params``: siblings of one remote prefill share its load; ``lora``: the
        registered adapter and its digest, or None for the base model)."""
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        params._all_stop_token_ids = set(self.eos_token_ids) | set(params.stop_token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        deadline = arrival + timeout_s if timeout_s is not None else None
        children = []
        for i in range(params.n):
            child = params
            if params.n > 1:
                child = params.clone()
                child.n = 1
                if params.seed is not None:
                    child.seed = params.seed + i
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(
                EngineCoreRequest(
                    rid,
                    prompt_token_ids,
                    child,
                    self.eos_token_ids,
                    arrival,
                    cache_salt,
                    deadline,
                    kv_transfer_params,
                    priority,
                    lora[0] if lora else None,
                    lora[1] if lora else None,
                )
            )
        return ProcessedRequest(request_id, prompt_text, prompt_token_ids, params, children)
