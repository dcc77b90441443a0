"""Request shapes of the OpenAI-compatible API (pydantic), after vLLM's
``vllm/entrypoints/openai/protocol.py``; the responses are in :mod:`.protocol_responses`.

Unknown request fields are accepted and ignored, as vLLM does. Booleans and integers are strict
(``"stream": "yes"`` or ``"max_tokens": true`` is a 400, as OpenAI); floats take integers. Ranges are checked where
:class:`SamplingParams` is built (``to_sampling_params``), so every endpoint reports the same
:class:`RequestError`, its ``param`` the field (as vLLM's ``to_sampling_params`` raises its
validation error naming the parameter).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator, model_validator

from pagedserve.sampling_params import MAX_LOGPROBS, RequestError, RequestOutputKind, SamplingParams, StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's schema lets optional fields be null: null then means the field's default
        (``"n": null`` is ``n = 1``), field by field. A required field's null is refused."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {
                k: v for k, v in data.items() if not (v is None and k in fields and not fields[k].is_required() and fields[k].default is not None)
            }
        return data


def schema_only(**constraints: Any) -> Any:
    """JSON-schema constraints that only the OpenAPI schema states, so that it says what is
    accepted; the request's own checks refuse the same values with their messages."""
    return Field(json_schema_extra=constraints)


NonEmptyStr = Annotated[str, schema_only(minLength=1)]
TokenId = Annotated[StrictInt, schema_only(minimum=0)]


# -- errors -----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- shared pieces ----------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[StrictBool] = True
    continuous_usage_stats: Optional[StrictBool] = False


class SamplingExtras(OpenAIBaseModel):
    """Sampling and scheduling fields of vLLM's (and OpenAI's older) APIs that every generating
    endpoint takes: completions, chat completions and Responses."""

    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    cache_salt: Optional[str] = None
    timeout: Optional[float] = None  # seconds: past it the request ends with finish_reason "timeout"
    priority: StrictInt = 0  # vLLM's: with --scheduling-policy priority, smaller runs first


class _SamplingFields(SamplingExtras):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM)."""

    model: Optional[str] = None
    request_id: Optional[str] = None  # vLLM's: the response's id after its prefix (X-Request-Id wins)
    n: StrictInt = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: Optional[StrictInt] = None  # vLLM's: the top-k logprobs of every prompt position
    return_tokens_as_token_ids: Optional[StrictBool] = None  # vLLM's: logprob tokens as "token_id:<id>"
    return_token_ids: Optional[StrictBool] = None  # vLLM's: prompt and generated token ids beside the text
    truncate_prompt_tokens: Optional[StrictInt] = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    allowed_token_ids: Optional[list[StrictInt]] = None  # vLLM's: sample only among these
    bad_words: Optional[list[str]] = None  # vLLM's: words never generated
    kv_transfer_params: Optional[dict[str, Any]] = None  # prefill/decode disaggregation (vLLM's field)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older
    # guided_* fields (at most one of them).
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[Annotated[list[NonEmptyStr], schema_only(minItems=1)]] = None
    guided_grammar: Optional[str] = None

    def constraint_fields(self) -> list[str]:
        """The structured-output fields the request sets (at most one is allowed)."""
        given = []
        if self.response_format is not None and self.response_format.get("type") != "text":  # no type: a 400 below, as vLLM
            given.append("response_format")
        return given + [
            f for f in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(self, f) is not None
        ]

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The request's constraint, if any.

        Raises:
            RequestError: several constraints (``param`` the first), an unknown
                response_format type or structured_outputs key, a malformed json_schema.
        """
        given = self.constraint_fields()
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"{given[0]} and {given[1]} cannot both be set: give one structured output constraint.", param=given[0])
        field = given[0]
        if field == "response_format":
            kind = self.response_format.get("type")
            if kind == "json_object":
                return StructuredOutputsParams(json_object=True)
            if kind == "json_schema":
                spec = self.response_format.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise RequestError("response_format.json_schema must be an object with a 'schema' object.", param="response_format")
                return StructuredOutputsParams(json=spec["schema"])
            if kind is None:
                raise RequestError("response_format needs a type (text, json_object or json_schema).", param="response_format")
            raise RequestError(f"response_format of type {kind!r} is not supported (text, json_object or json_schema).", param="response_format")
        if field == "structured_outputs":
            so = self.structured_outputs
            unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise RequestError(
                    f"structured_outputs.{unknown[0]} is not supported (json, regex, choice, grammar, json_object).", param="structured_outputs"
                )
            kwargs = {k: v for k, v in so.items() if k != "json_object" and v is not None}
            return StructuredOutputsParams(json_object=bool(so.get("json_object")), **kwargs)
        return StructuredOutputsParams(**{field[len("guided_") :]: getattr(self, field)})

    def _base_params(
        self, max_tokens: int, logprobs: Optional[int], defaults: Optional[dict[str, Any]] = None, prompt_logprobs: Optional[int] = None
    ) -> SamplingParams:
        """``defaults``: the server's defaults for fields the request leaves unset
        (``--generation-config``), else vLLM's."""
        d = defaults or {}
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs is not available when stream is true.", param="prompt_logprobs")
        bias = None
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = float(v)
                except (TypeError, ValueError):
                    raise RequestError(f"logit_bias keys must be token ids (integers), got {k!r}.", param="logit_bias") from None
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:  # {} is no option (vLLM)
            raise RequestError("stream_options can only be set when stream is true.", param="stream_options")
        return SamplingParams(
            n=self.n,
            temperature=d.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", 0) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=d.get("repetition_penalty", 1.0) if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=self.structured_outputs_params(),
        )


# -- /v1/completions --------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: Union[
        Annotated[list[TokenId], schema_only(minItems=1)],
        Annotated[list[Annotated[list[TokenId], schema_only(minItems=1)]], schema_only(minItems=1)],
        NonEmptyStr,
        Annotated[list[NonEmptyStr], schema_only(minItems=1)],
    ]
    max_tokens: Optional[StrictInt] = 16  # as OpenAI's legacy API and vLLM
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    suffix: Optional[str] = None
    best_of: Optional[StrictInt] = None
    add_special_tokens: StrictBool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt

    def to_sampling_params(self, max_tokens: int, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        if self.suffix:
            raise RequestError("suffix is not supported.", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (only best_of == n).", param="best_of")
        # As vLLM: echo with logprobs scores the echoed prompt too.
        prompt_logprobs = self.logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs
        return self._base_params(max_tokens, self.logprobs, defaults, prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0 (vLLM's): the prompt back, and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0


# -- /v1/chat/completions ---------------------------------------------------------------------
# A message's content: a string or a list of {"type": "text", "text": ...} parts.
MessageContent = Union[str, list[dict[str, Any]]]


class SystemMessage(OpenAIBaseModel):
    role: Literal["system", "developer"]  # developer: OpenAI's newer name, rendered as system
    content: MessageContent
    name: Optional[str] = None


class UserMessage(OpenAIBaseModel):
    role: Literal["user"]
    content: MessageContent
    name: Optional[str] = None


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"]
    tool_calls: Optional[list[dict[str, Any]]] = None  # the tools it called
    content: Optional[MessageContent] = Field(default=None, validate_default=True)  # null only with tool_calls
    name: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and not info.data.get("tool_calls"):
            raise ValueError("an assistant message needs content or tool_calls")
        return content


class ToolMessage(OpenAIBaseModel):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str  # the assistant's call it answers
    name: Optional[str] = None


# The roles chat templates render (OpenAI's deprecated "function" role is not one): a 400
# names ``messages[i].role``.
ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], schema_only(minItems=1)]
    max_tokens: Optional[StrictInt] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: StrictBool = False  # vLLM's: the template already places the special tokens
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    include_reasoning: StrictBool = True  # vLLM's: with --reasoning-parser, false drops reasoning_content

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.", param="top_logprobs")
            if not self.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true.", param="continue_final_message")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._base_params(max_tokens, logprobs, defaults, self.prompt_logprobs)


# -- /tokenize, /detokenize ---------------------------------------------------------------
class TokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], schema_only(minItems=1)]] = None
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[StrictInt]
