"""Response shapes of the OpenAI-compatible API (pydantic), after vLLM's
``vllm/entrypoints/openai/protocol.py``: completions, chat completions (whole and streamed
chunks), logprobs, tool calls, models, tokenizer and version."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import Field, model_serializer

from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its logprob entry.
PromptLogprobsJSON = list[Optional[dict[int, "PromptLogprob"]]]


class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class _DropNone(OpenAIBaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # a delta carries only what changed, as OpenAI's
        return {k: v for k, v in handler(self).items() if v is not None}


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobsJSON] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids (vLLM's)
    token_ids: Optional[list[int]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: Optional[dict[str, Any]] = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


# Stream chunks of return_token_ids requests (vLLM's) are subclasses, so that other chunks
# neither carry the fields nor pay for leaving them out.
class CompletionResponseStreamChoiceIds(CompletionResponseStreamChoice):
    prompt_token_ids: Optional[list[int]] = None  # the first chunk of a choice
    token_ids: list[int] = Field(default_factory=list)


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionStreamResponseIds(CompletionStreamResponse):
    choices: list[CompletionResponseStreamChoiceIds]


class ChatLogProbEntry(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogProbContent(ChatLogProbEntry):
    top_logprobs: list[ChatLogProbEntry] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatLogProbContent]] = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_DropNone):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_DropNone):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # vLLM's (--reasoning-parser), and its newer name:
    reasoning: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # return_token_ids (vLLM's)


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobsJSON] = None
    prompt_token_ids: Optional[list[int]] = None  # return_token_ids (vLLM's)
    kv_transfer_params: Optional[dict[str, Any]] = None


class DeltaMessage(_DropNone):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponseStreamChoiceIds(ChatCompletionResponseStreamChoice):
    token_ids: list[int] = Field(default_factory=list)


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


class ChatCompletionStreamResponseIds(ChatCompletionStreamResponse):
    choices: list[ChatCompletionResponseStreamChoiceIds]  # (pydantic writes the declared type's fields)
    prompt_token_ids: Optional[list[int]] = None  # the stream's first chunk


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
