"""Anthropic's Messages API as a translation of the chat endpoint: an
:class:`AnthropicMessagesRequest` becomes a :class:`ChatCompletionRequest` (the same template,
tools rendering, tool-call parser and constraints as ``/v1/chat/completions``).

* ``system`` (a string or text blocks) and ``system`` turns are system messages; ``user`` /
  ``assistant`` turns keep their role, consecutive turns of one role are combined into one (as
  Anthropic does), their text blocks joined with newlines (as chat joins text parts).
* ``tool_use`` blocks (assistant turns) are the turn's tool calls (``input`` as the
  arguments); ``tool_result`` blocks (user turns) are ``tool`` messages, before the turn's text,
  each answering a ``tool_use`` made before it; ``is_error`` results read ``Error: <content>``.
* ``thinking`` / ``redacted_thinking`` blocks of assistant turns are dropped (as Anthropic
  drops earlier turns' thinking); a final assistant turn is continued (prefill).
* ``tools`` (custom tools: ``name``, ``description``, ``input_schema``, which must be an object
  schema, ``"type": "object"``, as Anthropic requires) are chat's functions;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` is chat's ``auto`` / ``required`` /
  named function / ``none``, and ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``
  (at most one call).
* ``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` are chat's
  sampling fields; ``output_config.format`` (``json_schema``) is chat's ``response_format``.

Refused with a 400 naming the field: image, document and other non-text blocks, server tools
(``type`` other than ``custom``), ``strict`` tools under ``tool_choice`` auto, ``thinking`` other
than ``disabled`` or ``adaptive`` (no thinking is returned), ``container``, ``mcp_servers``,
``context_management``. Ignored (logged once): ``metadata``, ``service_tier``,
``cache_control``, ``output_config.effort`` and other fields this server does not know.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import ValidationError

from pagedserve.entrypoints.openai.http_common import APIError, random_id
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.protocol_anthropic import AnthropicCountTokensRequest, AnthropicMessagesRequest
from pagedserve.entrypoints.openai.serving_common import log_ignored

# Fields that would change what a request means and that this server does not implement.
REFUSED_FIELDS = {
    "container": "containers (code execution) are not supported by this server.",
    "mcp_servers": "MCP servers are not supported by this server.",
    "context_management": "context management is not supported by this server.",
}
# Blocks Anthropic takes that this server cannot render (text-only models): a clear 400.
_UNSUPPORTED_BLOCKS = frozenset(
    {
        "image",
        "document",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "container_upload",
        "tool_reference",
        "browser_state",
        "mcp_tool_use",
        "mcp_tool_result",
    }
)
_SUPPORTED = "text, tool_use (assistant turns), tool_result (user turns)"


def _refuse(field: str, why: str) -> APIError:
    return APIError(f"{field}: {why}", param=field.split("[")[0].split(".")[0])


def new_message_id() -> str:
    return random_id("msg_")


def new_tool_use_id() -> str:
    return random_id("toolu_")


def _block_kind(block: Any, field: str) -> str:
    if not isinstance(block, dict):
        raise _refuse(field, "must be a content block object.")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _refuse(f"{field}.type", "is required.")
    return kind


def text_of(content: Any, field: str) -> str:
    """A string, or the text of a list of text blocks joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(field, "must be a string or a list of text blocks.")
    parts = []
    for k, block in enumerate(content):
        kind = _block_kind(block, f"{field}[{k}]")
        if kind != "text":
            raise _refuse(f"{field}[{k}].type", f"only text blocks are supported here, got {kind!r}.")
        if not isinstance(block.get("text"), str):
            raise _refuse(f"{field}[{k}].text", "must be a string.")
        parts.append(block["text"])
    return "\n".join(parts)


def _tool_result(block: dict, field: str, call_ids: set[str]) -> dict[str, Any]:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise _refuse(f"{field}.tool_use_id", "is required (the id of the tool_use it answers).")
    if use_id not in call_ids:
        raise _refuse(f"{field}.tool_use_id", f"no tool_use with id {use_id!r} comes before this tool_result.")
    content = block.get("content")
    text = "" if content is None else text_of(content, f"{field}.content")
    is_error = block.get("is_error")
    if is_error not in (None, True, False):
        raise _refuse(f"{field}.is_error", "must be a boolean.")
    return {"role": "tool", "tool_call_id": use_id, "content": f"Error: {text}" if is_error else text}


def _turn(i: int, role: str, content: Any, call_ids: set[str]) -> list[dict[str, Any]]:
    """The chat messages of ``messages[i]``: tool results first, then the text (and calls)."""
    where = f"messages[{i}]"
    if isinstance(content, str) or role == "system":
        return [{"role": role, "content": text_of(content, f"{where}.content")}]
    if not content:
        raise _refuse(f"{where}.content", "must hold at least one content block.")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        field = f"{where}.content[{k}]"
        kind = _block_kind(block, field)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _refuse(f"{field}.text", "must be a string.")
            texts.append(block["text"])
        elif kind == "tool_use":
            if role != "assistant":
                raise _refuse(f"{field}.type", "tool_use blocks belong in assistant turns.")
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise _refuse(field, "a tool_use block needs id and name (strings) and input (an object).")
            if block["id"] in call_ids:
                raise _refuse(f"{field}.id", f"{block['id']!r} is the id of an earlier tool_use.")
            call_ids.add(block["id"])
            args = json.dumps(block["input"], ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}})
        elif kind == "tool_result":
            if role != "user":
                raise _refuse(f"{field}.type", "tool_result blocks belong in user turns.")
            results.append(_tool_result(block, field, call_ids))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's thinking: dropped, as Anthropic does
        elif kind in _UNSUPPORTED_BLOCKS or kind in ("thinking", "redacted_thinking"):
            raise _refuse(f"{field}.type", f"{kind!r} blocks are not supported by this server ({_SUPPORTED}).")
        else:
            raise _refuse(f"{field}.type", f"unknown content block type {kind!r} ({_SUPPORTED}).")
    out = results
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out = out + [msg]
    return out


def chat_messages(req: AnthropicCountTokensRequest) -> tuple[list[dict[str, Any]], bool]:
    """The chat messages of ``system`` and ``messages``, and whether the last (an assistant
    turn) is continued. Raises APIError naming the field."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = text_of(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    call_ids: set[str] = set()
    for i, m in enumerate(req.messages):
        for msg in _turn(i, m.role, m.content, call_ids):
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == msg["role"] and msg["role"] in ("user", "assistant") and not prev.get("tool_calls"):
                prev["content"] = "\n".join(t for t in (prev["content"], msg["content"]) if t)  # one turn, as Anthropic combines them
                if msg.get("tool_calls"):
                    prev["tool_calls"] = msg["tool_calls"]
            else:
                out.append(msg)
    if not any(m["role"] != "system" for m in out):
        raise _refuse("messages", "must hold at least one user or assistant turn.")
    last = out[-1]
    if last["role"] == "assistant" and last.get("tool_calls"):
        raise _refuse("messages", "the last turn holds a tool_use: answer it with a user turn holding its tool_result.")
    return out, last["role"] == "assistant"


def chat_tools(tools: Optional[list[dict[str, Any]]], strict_ok: bool) -> Optional[list[dict[str, Any]]]:
    """Custom tools as chat's ``{"type": "function", "function": {...}}``."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _refuse(f"tools[{i}]", "must be an object with name, description and input_schema.")
        if t.get("type") not in (None, "custom"):
            raise _refuse(f"tools[{i}].type", f"server tool {t.get('type')!r} is not supported: only custom tools (name, description, input_schema).")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _refuse(f"tools[{i}].name", "must be a non-empty string.")
        if not isinstance(t.get("input_schema"), dict):
            raise _refuse(f"tools[{i}].input_schema", "is required: a JSON schema object.")
        if t["input_schema"].get("type") != "object":  # Anthropic's rule: a tool's input is an object
            raise _refuse(
                f"tools[{i}].input_schema.type",
                f'tool {t["name"]!r}: input_schema must be a JSON schema of an object ("type": "object"), got {t["input_schema"].get("type", "no type")!r}.',
            )
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise _refuse(f"tools[{i}].description", "must be a string.")
        if t.get("strict") and not strict_ok:
            raise _refuse(f"tools[{i}].strict", 'is only guaranteed here under tool_choice "any" or "tool" (a grammar forces the input).')
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Optional[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> tuple[Union[str, dict, None], Optional[bool]]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    disable = choice.get("disable_parallel_tool_use")
    if disable not in (None, True, False):
        raise _refuse("tool_choice.disable_parallel_tool_use", "must be a boolean.")
    parallel = False if disable else None
    names = [t["function"]["name"] for t in tools or []]
    if kind in ("auto", "none"):
        return (kind if names else None), parallel
    if kind not in ("any", "tool"):
        raise _refuse("tool_choice.type", f'must be "auto", "any", "tool" or "none", got {kind!r}.')
    if not names:
        raise _refuse("tool_choice", f"{kind!r} needs tools.")
    if kind == "any":
        return "required", parallel
    name = choice.get("name")
    if not isinstance(name, str):
        raise _refuse("tool_choice.name", 'is required with type "tool".')
    if name not in names:
        raise _refuse("tool_choice.name", f"{name!r} is not one of the tools ({', '.join(names)}).")
    return {"type": "function", "function": {"name": name}}, parallel


def chat_response_format(req: AnthropicCountTokensRequest) -> Optional[dict[str, Any]]:
    """``output_config.format`` (or the beta's ``output_format``) as chat's ``response_format``."""
    config = req.output_config or {}
    for key in config:
        if key != "format":
            log_ignored(f"output_config.{key}")  # effort: how hard a Claude model thinks
    fmt, field = config.get("format"), "output_config.format"
    if req.output_format is not None:
        if fmt is not None:
            raise _refuse("output_format", "and output_config.format cannot both be set.")
        fmt, field = req.output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _refuse(field, 'must be {"type": "json_schema", "schema": {...}}.')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def check_fields(req: AnthropicCountTokensRequest) -> None:
    """Refuse what would change the answer and is not done here; log what is ignored."""
    for name, value in (req.model_extra or {}).items():
        if name in REFUSED_FIELDS and value is not None:
            raise _refuse(name, REFUSED_FIELDS[name])
        if name not in REFUSED_FIELDS:
            log_ignored(name)  # service_tier, cache_control, inference_geo, speed, ...
    if getattr(req, "metadata", None):
        log_ignored("metadata")
    thinking = req.thinking or {"type": "disabled"}
    kind = thinking.get("type")
    if kind == "adaptive":
        log_ignored("thinking")  # the model decides; no thinking block is returned
    elif kind != "disabled":
        raise _refuse("thinking", f'extended thinking ({kind!r}) is not supported by this server: omit it or set {{"type": "disabled"}}.')


def to_chat_request(req: AnthropicCountTokensRequest) -> ChatCompletionRequest:
    """The streamed chat request (with usage) that computes this message; a count_tokens
    request gets the same messages and tools. Raises APIError naming the Anthropic field."""
    check_fields(req)
    messages, continued = chat_messages(req)
    choice = req.tool_choice
    tools = chat_tools(req.tools, strict_ok=isinstance(choice, dict) and choice.get("type") in ("any", "tool"))
    tool_choice, parallel = chat_tool_choice(choice, tools)
    fields: dict[str, Any] = dict(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=chat_response_format(req),
        add_generation_prompt=not continued,
        continue_final_message=continued,
        include_reasoning=False,  # no thinking blocks: thinking is off
        stream=True,
        stream_options={"include_usage": True},
    )
    if isinstance(req, AnthropicMessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # cannot happen for what chat_messages builds; named anyway
        raise APIError(f"messages could not be read: {e.errors()[0]['msg']}", param="messages") from None
