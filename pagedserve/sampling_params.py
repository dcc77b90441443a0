"""Sampling parameters, named and defaulted as in vLLM / the OpenAI API."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Optional, Union

# Cap on logprobs / top_logprobs per token, as vLLM's default `max_logprobs`.
MAX_LOGPROBS = 20
# Most completions per request (one request must not be able to queue unbounded work).
MAX_N = 128
_INT64_MAX = 2**63 - 1
# Caps on list-like fields, each of which costs work per step (matching, masking, biasing).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # allowed_token_ids: a list longer than any vocabulary means nothing
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256


class RequestError(ValueError):
    """A request refused as invalid, naming the request field at fault in ``param`` (None when
    no single field is): raised where each field is checked (here, per field; by the input
    processor; by structured-output compilation), never guessed from the message afterwards.

    Attributes:
        message: what is wrong, in words a client can act on.
        param: the request field, as the request names it (``"top_p"``, ``"structured_outputs"``).
    """

    def __init__(self, message: str, *, param: Optional[str]) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # param is keyword-only: pickle rebuilds it with both
        return _rebuild_request_error, (type(self), self.message, self.param)


def _rebuild_request_error(cls: type, message: str, param: Optional[str]) -> "RequestError":
    return cls(message, param=param)


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a streaming request carries."""

    CUMULATIVE = 0  # all text / tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


# Most characters of one constraint (schema, regex, grammar, choices): compiling is work the
# server does for the client, so its size is capped like every amplifying parameter.
MAX_STRUCTURED_OUTPUT_CHARS = 64_000


@dataclass
class StructuredOutputsParams:
    """One constraint on the generated text, as vLLM's ``StructuredOutputsParams``. Exactly one
    field is set.

    Attributes:
        json: a JSON schema (a dict, or its JSON text) the output must validate against.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, Lark syntax (llguidance's) or GBNF (``::=`` rules).
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).

    Raises:
        RequestError: ``param="structured_outputs"``, when none or several are set, or one is
            empty or too big.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False

    def __post_init__(self) -> None:
        import json as _json

        if isinstance(self.json, dict):
            try:
                self.json = _json.dumps(self.json)  # key order kept: it is the order of the output
            except RecursionError:
                raise RequestError("structured_outputs.json is nested too deeply.", param="structured_outputs") from None
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise RequestError("structured_outputs.choice must be a list of non-empty strings.", param="structured_outputs")
            self.choice = list(self.choice)
        if not isinstance(self.json_object, bool):
            raise RequestError("structured_outputs.json_object must be true or false.", param="structured_outputs")
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None] + (["json_object"] if self.json_object else [])
        if len(set_) != 1:
            raise RequestError(
                f"structured_outputs must set exactly one of json, regex, choice, grammar or json_object, got {set_ or 'none'}.",
                param="structured_outputs",
            )
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise RequestError("structured_outputs.choice must be a list of non-empty strings.", param="structured_outputs")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise RequestError(f"structured_outputs.{name} must be a non-empty string.", param="structured_outputs")
        size = len(self.json or self.regex or self.grammar or "") + sum(len(c) for c in self.choice or ())
        if size > MAX_STRUCTURED_OUTPUT_CHARS:
            raise RequestError(
                f"structured_outputs is {size} characters, more than the {MAX_STRUCTURED_OUTPUT_CHARS} allowed.", param="structured_outputs"
            )

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    Defaults follow vLLM: ``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` (off; ``-1`` is
    accepted as off too), ``max_tokens=16``.  ``temperature == 0`` means greedy.

    Penalties follow their usual definitions: ``presence_penalty`` / ``frequency_penalty``
    (OpenAI, in [-2, 2]) subtract from the logits of tokens already generated;
    ``repetition_penalty`` (CTRL, Keskar et al. 2019; > 0, 1 = off) divides positive logits and
    multiplies negative ones of tokens seen in the prompt or output.

    ``logprobs=k`` returns, per generated token, its raw logprob and the top ``k``;
    ``prompt_logprobs=k`` does the same for every prompt token after the first
    (``RequestOutput.prompt_logprobs``; such a request skips the prefix cache, since cached
    positions have no logits). Both in [0, 20]. ``allowed_token_ids`` restricts sampling to
    those tokens (vLLM's; logprobs stay those of the raw distribution). ``bad_words`` (vLLM's)
    never generates those words: each is tokenized as it stands and after a space, and a
    word's last token is banned whenever the generated tokens end with the tokens before it.

    ``truncate_prompt_tokens=k`` keeps only the last ``k`` prompt tokens (vLLM's; -1 means
    ``max_model_len``); more than ``max_model_len`` is an error.

    Raises:
        RequestError: its ``param`` the field, when a value is out of range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None

    # Filled by the engine: the model's EOS ids (generation config) that end a request
    # unless ignore_eos is set. Not part of the user surface.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the input processor: the token ids of each bad word's spellings.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Set by a chat server with a reasoning parser for a request that starts thinking: its
    # structured-output constraint applies only after this token (``</think>``).
    _reasoning_end_token_id: Optional[int] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise RequestError(f"{name} {msg}", param=name)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            bad("n", f"must be at most {MAX_N}, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                bad(name, f"must be a finite number, got {getattr(self, name)}.")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - 1 - self.n:  # int64, as vLLM; n > 1 adds i
            bad("seed", f"must be in [-2**63, 2**63 - 1 - n], got {self.seed}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}.")
        if not self.temperature >= 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        for name in ("top_k", "max_tokens", "min_tokens"):  # they travel as int64
            value = getattr(self, name)
            if isinstance(value, int) and value > _INT64_MAX:
                bad(name, f"must be at most 2**63 - 1, got {value}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}.")
        if self.truncate_prompt_tokens is not None and (
            isinstance(self.truncate_prompt_tokens, bool)
            or not isinstance(self.truncate_prompt_tokens, int)
            or not (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)
        ):
            bad("truncate_prompt_tokens", f"must be -1 (max_model_len) or at least 1, got {self.truncate_prompt_tokens}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "must contain only non-empty strings.")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}.")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}.")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must contain only non-negative integers.")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            bad("logit_bias", "values must be in [-100, 100].")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, list) and len(ids) > MAX_ALLOWED_TOKEN_IDS:
                bad("allowed_token_ids", f"must hold at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(ids)}.")
            if not isinstance(ids, list) or not ids or set(map(type, ids)) != {int} or min(ids) < 0:  # no Python loop per id
                bad("allowed_token_ids", "must be a non-empty list of non-negative token ids.")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list) or any(not isinstance(w, str) or not w.strip() for w in words):
                bad("bad_words", "must be a list of strings that are not empty or whitespace.")
            try:
                "".join(words).encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate from a JSON escape
                bad("bad_words", "must be valid Unicode text.")
            if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_CHARS for w in words):
                bad("bad_words", f"must hold at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} characters.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary. Raises RequestError naming the field."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise RequestError(f"{name} contains token id {t} outside the vocabulary [0, {vocab_size}).", param=name)
        if self.allowed_token_ids and len(self.allowed_token_ids) > vocab_size:
            raise RequestError(
                f"allowed_token_ids must hold at most {vocab_size} ids (the vocabulary), got {len(self.allowed_token_ids)}.",
                param="allowed_token_ids",
            )

    def clone(self) -> "SamplingParams":
        """A deep copy that shares the long id lists (never changed once checked), so that n
        copies of a request cost little."""
        import copy

        shared = (self.allowed_token_ids, self.bad_words, self._bad_words_token_ids)
        return copy.deepcopy(self, {id(x): x for x in shared if x is not None})
