"""Tools in chat requests, as chat templates take them: an assistant message's tool calls with
their arguments as dicts, and the ChatML + Hermes tool-call template used when the model's own
template does not render tools."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from pagedserve.engine.input_processor import RequestError


def tool_call_for_template(call: Any, i: int) -> dict:
    """An assistant message's tool call as chat templates expect it: arguments as a dict."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"messages[{i}].tool_calls: each call needs function.name.", param="messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(f"messages[{i}].tool_calls: function.arguments is not JSON.", param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def check_answers_a_call(call_id: str, call_ids: set[str], field: str, param: str, call: str) -> None:
    """A tool result must answer a call made before it (OpenAI's 400): ``call_ids`` holds the ids
    of the calls so far, ``field`` names the result's id in the message, ``call`` what a call is
    called in this API.

    Raises:
        RequestError: naming ``field``, with ``param``.
    """
    if call_id in call_ids:
        return
    if not call_ids:
        raise RequestError(f"{field}: no {call} comes before this tool result.", param=param)
    raise RequestError(f"{field}: no {call} with id {call_id!r} comes before it.", param=param)


@lru_cache(maxsize=1)
def tools_template() -> str:
    """ChatML with Hermes tool calls (``templates/chatml_hermes_tools.jinja``), used when tools are
    given and the chat template does not render them; with the template variable
    ``tool_call_format="json"`` (the json and llama3_json parsers) calls are bare JSON."""
    import importlib.resources

    return importlib.resources.files("pagedserve.entrypoints.openai").joinpath("templates/chatml_hermes_tools.jinja").read_text()
