"""Request shapes of Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, pydantic) and its error body, after Anthropic's API
reference: ``{"type": "error", "error": {"type", "message"}}``.

Only the top-level shape is checked here: ``model`` and ``messages`` are required (and
``max_tokens`` for a message), a turn's ``role`` is user, assistant or system, integers and
booleans are strict. Content blocks, tools, ``tool_choice``, ``thinking`` and
``output_config`` are read by :mod:`.messages_api`, which refuses what this server does not do
with a 400 naming the field. Other fields are accepted: those known to be harmless are ignored,
unknown ones are ignored and logged once (as on every route of this server).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from pagedserve.entrypoints.openai.protocol import schema_only

# A turn's content: a string, or a list of content blocks ({"type": "text", "text": ...}, ...).
BlockContent = Union[str, list[dict[str, Any]]]

# Anthropic's error type of each HTTP status (others: 4xx invalid_request_error, 5xx api_error).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_type(status_code: int, overloaded: bool = False) -> str:
    """Anthropic's ``error.type`` of an HTTP status; ``overloaded``: a 503 that asks to retry
    later (``Retry-After``), which Anthropic calls ``overloaded_error``."""
    if overloaded:
        return "overloaded_error"
    return ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "api_error")


def anthropic_error_body(message: str, status_code: int = 400, overloaded: bool = False) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status_code, overloaded), "message": message}}


class AnthropicBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicMessage(AnthropicBaseModel):
    """One turn of ``messages``. ``system`` turns (the 2.x SDK's ``SystemMessageParam``) take
    text only, as the top-level ``system``."""

    role: Literal["user", "assistant", "system"]
    content: BlockContent


class AnthropicCountTokensRequest(AnthropicBaseModel):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model: str
    messages: Annotated[list[AnthropicMessage], schema_only(minItems=1)]
    system: Optional[BlockContent] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    output_format: Optional[dict[str, Any]] = None  # the structured-outputs beta's name of output_config.format


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """``POST /v1/messages``. ``temperature``, ``top_p`` and ``top_k`` arrive as body fields
    (the 2.x SDK sends them through ``extra_body``)."""

    max_tokens: StrictInt
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    stream: Optional[StrictBool] = False
    metadata: Optional[dict[str, Any]] = None  # accepted, ignored (user_id is for Anthropic's abuse checks)
