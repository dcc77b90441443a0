"""OpenAI's Responses API (``POST /v1/responses``), stateless, as a translation of the chat
endpoint: the request becomes a :class:`ChatCompletionRequest` (instructions as the system
message, input items as turns, function tools and ``text.format`` in chat's shapes), and the
chat answer becomes output items (``reasoning``, ``message`` with ``output_text``,
``function_call``). Shapes after OpenAI's API reference and vLLM's
``vllm/entrypoints/openai/responses``.

Nothing is stored, as vLLM without its response store: ``store`` is ignored (logged once),
``previous_response_id``, ``conversation``, ``prompt`` (a stored template), ``background``,
built-in tools and non-text inputs are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Optional, Union

from pydantic import ConfigDict, StrictBool, StrictInt, ValidationError

from pagedserve.entrypoints.openai.http_common import APIError, random_id
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, SamplingExtras, schema_only
from pagedserve.entrypoints.openai.serving_common import check_extra_fields, log_ignored
from pagedserve.entrypoints.openai.tools import check_answers_a_call

_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields that keep their meaning from the Responses request to the chat one.
_SAME_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "chat_template_kwargs", *SamplingExtras.model_fields)
# Chat or completions fields a client may send here by mistake: each would change the answer,
# so each is a 400 saying what to use (unless it holds its "off" value).
_CHAT_ONLY = {
    "max_tokens": ("is chat's name; use max_output_tokens", (None,)),
    "max_completion_tokens": ("is chat's name; use max_output_tokens", (None,)),
    "n": ("must be 1: one response per request", (None, 1)),
    "response_format": ("is chat's name; use text.format", (None,)),
    "structured_outputs": ("use text.format", (None,)),
    "guided_json": ("use text.format", (None,)),
    "guided_regex": ("is not supported here", (None,)),
    "guided_choice": ("is not supported here", (None,)),
    "guided_grammar": ("is not supported here", (None,)),
    "logprobs": ('is chat\'s; use include: ["message.output_text.logprobs"] and top_logprobs', (None, False, 0)),
    "prompt_logprobs": ("is not supported here", (None,)),
    "echo": ("is not supported here", (None, False)),
    "kv_transfer_params": ("is not supported here", (None,)),
}


def _input_required(schema: dict[str, Any]) -> None:
    """In the schema ``input`` is required and not null: this server refuses both, with a hint."""
    schema.setdefault("required", []).append("input")
    prop = schema["properties"]["input"]
    prop["anyOf"] = [t for t in prop["anyOf"] if t != {"type": "null"}]
    prop.pop("default", None)


class ResponsesRequest(SamplingExtras):  # vLLM's sampling extras, as on chat completions
    model_config = ConfigDict(json_schema_extra=_input_required)

    input: Optional[Union[str, Annotated[list[dict[str, Any]], schema_only(minItems=1)]]] = None
    model: Optional[str] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[StrictInt] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[dict[str, Any]] = None
    stream: StrictBool = False
    metadata: Optional[dict[str, str]] = None
    include: Optional[list[str]] = None  # "message.output_text.logprobs": logprobs of the text
    top_logprobs: Optional[StrictInt] = None  # with those logprobs: the k most likely tokens at each position
    store: Optional[StrictBool] = None  # nothing is stored; logged once when true
    previous_response_id: Optional[str] = None
    background: Optional[StrictBool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None  # a stored prompt template's id
    reasoning: Optional[dict[str, Any]] = None
    truncation: Optional[str] = None
    user: Optional[str] = None  # echoed
    request_id: Optional[str] = None  # vLLM's: the response id after ``resp_``
    chat_template_kwargs: Optional[dict[str, Any]] = None


def _refuse(field: str, why: str) -> APIError:
    return APIError(f"{field}: {why}", param=field.split("[")[0].split(".")[0])


def _text_of(content: Any, field: str) -> str:
    """A string, or the text of a list of text parts; ``field`` names it in errors."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(field, "must be a string or a list of text parts.")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS:
            raise _refuse(f"{field}[{k}]", f"only text parts (input_text, output_text) are supported, got {kind!r}.")
        if not isinstance(part.get("text"), str):
            raise _refuse(f"{field}[{k}].text", "must be a string.")
        parts.append(part["text"])
    return "\n".join(parts)  # as chat joins its text parts


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Chat messages from ``instructions`` and ``input``: message items keep their role
    (``developer`` is ``system``), ``function_call`` items join the assistant turn before them
    (or start one) as ``tool_calls``, a ``function_call_output`` a ``tool`` turn; ``reasoning`` items
    are dropped (the template would not show them). Raises APIError naming the item."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if req.input is None:
        raise _refuse("input", "is required: this server keeps no conversation or prompt to answer.")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise _refuse("input", "must not be empty.")
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse(where, "must be an object.")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _refuse(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}.")
            messages.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _refuse(where, "a function_call needs call_id, name and arguments (strings).")
            if item["call_id"] in call_ids:
                raise _refuse(f"{where}.call_id", f"{item['call_id']!r} is the call_id of an earlier function_call.")
            call_ids.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text and its calls are one chat turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise _refuse(where, "a function_call_output needs call_id and output.")
            check_answers_a_call(item["call_id"], call_ids, f"{where}.call_id", "input", "function_call")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(output, f"{where}.output")})
        elif kind != "reasoning":
            raise _refuse(f"{where}.type", f"{kind!r} is not supported (message, function_call, function_call_output, reasoning).")
    if len(messages) == (1 if req.instructions else 0):
        raise _refuse("input", "holds no message, function call or function call output.")
    return messages


def chat_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Responses' flat function tools in chat's ``{"type": "function", "function": {...}}``."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _refuse(f"tools[{i}].type", f"only function tools are supported, got {kind!r}.")
        if not isinstance(t.get("name"), str) or not t["name"]:
            hint = ' (Responses tools are flat: {"type": "function", "name", "description", "parameters"})' if "function" in t else ""
            raise _refuse(f"tools[{i}].name", f"must be a non-empty string{hint}.")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
    return out


def chat_tool_choice(choice: Union[str, dict, None]) -> Union[str, dict, None]:
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise _refuse("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", "name": ...}}, got {choice!r}.')
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}.')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``text.format`` as chat's ``response_format``."""
    if text is None or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict):
        raise _refuse("text.format", 'must be an object such as {"type": "json_schema", "name": ..., "schema": {...}}.')
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _refuse("text.format.schema", "must be a JSON schema object.")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "schema", "schema": fmt.get("schema")}}
    raise _refuse("text.format.type", f"must be text, json_object or json_schema, got {fmt.get('type')!r}.")


def check_responses_fields(req: ResponsesRequest) -> None:
    """Refuse what needs a response store or background runs, chat's own fields, and numbers
    that cannot be echoed as JSON; log once what is ignored. Raises APIError naming the field."""
    for name, (hint, off) in _CHAT_ONLY.items():
        if name in (req.model_extra or {}) and req.model_extra[name] not in off:
            raise _refuse(name, hint + ".")
    check_extra_fields(req)
    for name in ("store", "reasoning", "include"):
        if getattr(req, name):
            log_ignored(name)  # nothing is stored; effort and encrypted reasoning mean nothing here
    if isinstance(req.text, dict) and req.text.get("verbosity") is not None:
        log_ignored("text.verbosity")
    for name in ("tools", "tool_choice", "text", "reasoning", "metadata", "user"):
        try:  # these are echoed in the answer: they must be valid JSON text
            json.dumps(getattr(req, name), allow_nan=False, ensure_ascii=False).encode("utf-8")
        except ValueError:  # UnicodeEncodeError too
            raise _refuse(name, "must not hold NaN, infinite numbers or lone surrogates.") from None
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise _refuse("metadata", "at most 16 pairs, keys of at most 64 characters and values of at most 512 (as OpenAI).")
    for field in ("previous_response_id", "conversation"):
        if getattr(req, field) is not None:
            raise _refuse(field, "this server keeps no responses; send the whole conversation as input.")
    if req.prompt is not None:
        raise _refuse("prompt", "this server keeps no prompt templates; send instructions and input.")
    if req.background:
        raise _refuse("background", "background responses are not supported.")
    if req.truncation not in (None, "disabled"):
        raise _refuse("truncation", 'only "disabled" is supported.')


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The streamed chat request that computes this response (with usage, and
    ``return_token_ids`` so reasoning tokens can be counted). Raises APIError naming the
    Responses field."""
    fields = {k: getattr(req, k) for k in _SAME_FIELDS if getattr(req, k) is not None}
    fields.update(
        messages=input_messages(req),
        max_completion_tokens=req.max_output_tokens,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        response_format=chat_response_format(req.text),
    )
    if wants_logprobs(req):
        fields.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    try:
        return ChatCompletionRequest(return_token_ids=True, stream=True, stream_options={"include_usage": True}, **fields)
    except ValidationError as e:  # a message of the wrong shape (content an object, ...)
        raise APIError(f"input could not be read: {e.errors()[0]['msg']}", param="input") from None


def wants_logprobs(req: ResponsesRequest) -> bool:
    """``include: ["message.output_text.logprobs"]``, or a ``top_logprobs`` other than 0."""
    return (bool(req.include) and "message.output_text.logprobs" in req.include) or req.top_logprobs not in (None, 0)


def new_id(prefix: str) -> str:
    return random_id(prefix + "_")


def status_of(finish_reason: Optional[str]) -> tuple[str, Optional[dict]]:
    """(status, incomplete_details) of a response whose one choice ended so."""
    if finish_reason in (None, "stop", "tool_calls"):
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if finish_reason == "length" else finish_reason}


def response_object(
    req: ResponsesRequest,
    params: Any,
    response_id: str,
    model: str,
    created_at: int,
    status: str,
    output: list[dict],
    usage: Optional[dict] = None,
    incomplete: Optional[dict] = None,
    error: Optional[dict] = None,
) -> dict[str, Any]:
    """The ``response`` object, echoing the request's settings as OpenAI does (temperature and
    top_p as sampled: ``params`` is the request's SamplingParams)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": status,
        "output": output,
        "usage": usage,
        "incomplete_details": incomplete,
        "error": error,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "max_output_tokens": req.max_output_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_logprobs": req.top_logprobs,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": req.text or {"format": {"type": "text"}},
        "previous_response_id": None,
        "reasoning": req.reasoning,
        "store": False,
        "truncation": "disabled",
        "background": False,
        "user": req.user,
    }


def usage_object(prompt_tokens: int, cached: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(item_id: str, text: str, status: str = "completed", logprobs: Optional[list] = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def sse_event(event: dict[str, Any]) -> str:
    """One Responses stream event: ``event: <type>`` and its JSON, as OpenAI sends them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())
