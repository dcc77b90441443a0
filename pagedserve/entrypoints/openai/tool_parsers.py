"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser``, vLLM's flag): they turn
a model's text into ``(content, tool calls)``, at the end of a request or as it streams.

* ``hermes``: calls inside ``<tool_call>...</tool_call>`` tags, each a JSON object
  ``{"name": ..., "arguments": {...}}`` (the NousResearch Hermes / Qwen format); the text outside
  the tags is the content.
* ``json``: the whole answer is one JSON object ``{"name": ..., "arguments" | "parameters": {...}}``
  or a JSON list of them (Llama 3's JSON tool format); anything else is content.
* ``llama3_json`` (vLLM's name for Llama 3.1-3.3): the same objects, optionally after
  ``<|python_tag|>``, several separated by ``;``.
* ``qwen3_coder``, ``mistral``, ``pythonic``: in their own modules
  (:mod:`tool_parsers_qwen3_coder`, :mod:`tool_parsers_mistral`, :mod:`tool_parsers_pythonic`);
  they stream each call's arguments as they parse (:mod:`tool_parser_base`).

A streaming parser emits content as soon as it cannot be the start of a tool call, and each
tool call whole once it is complete (the three above) or piece by piece, so the concatenated
stream equals the end-of-request parse. JSON that Python cannot read (an integer over its
4,300-digit limit, nesting too deep) is not a call: that text is content. ``TOOL_PARSERS`` holds
them all, by name.
"""

from __future__ import annotations

import json
from typing import Optional

from pagedserve.entrypoints.openai.http_common import random_id
from pagedserve.entrypoints.openai.tool_parser_base import ParsedToolCall, ToolParser, partial_suffix
from pagedserve.entrypoints.openai.tool_parsers_mistral import MistralToolParser
from pagedserve.entrypoints.openai.tool_parsers_pythonic import PythonicToolParser
from pagedserve.entrypoints.openai.tool_parsers_qwen3_coder import Qwen3CoderToolParser

_partial_suffix = partial_suffix  # its old name here (the reasoning parser's streams use it)

__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolParser", "HermesToolParser", "JsonToolParser", "Llama3JsonToolParser"]


# What json.loads raises for text that is not JSON it can read: JSONDecodeError (a ValueError),
# the ValueError of an integer over Python's 4,300-digit limit, RecursionError for deep nesting.
_NOT_JSON = (ValueError, RecursionError)


def _call_from(obj) -> Optional[ParsedToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except _NOT_JSON:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks."""

    name = "hermes"
    template_format = "hermes"
    keeps_special_tokens = False
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def new_call_id(self) -> str:
        return random_id("chatcmpl-tool-")

    def extract(self, text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[ParsedToolCall]]:
        """(content or None, calls) of a whole answer. A block that is not a valid call (or not
        closed and not valid JSON) stays in the content."""
        stream = self.streaming()
        content, calls = stream.feed(text)
        more_content, more_calls = stream.finish()
        content += more_content
        calls += more_calls
        return (content if content.strip() or not calls else None), calls

    def streaming(self, tools: Optional[list] = None) -> "_HermesStream":
        return _HermesStream(self.OPEN, self.CLOSE)


class _HermesStream:
    def __init__(self, open_tag: str, close_tag: str) -> None:
        self.open, self.close = open_tag, close_tag
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """New text in; (content to emit now, complete calls)."""
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                i = self.buffer.find(self.open)
                if i < 0:
                    keep = partial_suffix(self.buffer, self.open)  # may still become the tag
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return content, calls
                content += self.buffer[:i]
                self.buffer = self.buffer[i + len(self.open) :]
                self.in_call = True
            j = self.buffer.find(self.close)
            if j < 0:
                return content, calls
            body, self.buffer = self.buffer[:j], self.buffer[j + len(self.close) :]
            self.in_call = False
            call = _parse_json_call(body)
            if call is None:
                content += self.open + body + self.close
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """End of the answer: an unclosed block that parses is a call, else content."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        call = _parse_json_call(rest)
        return ("", [call]) if call is not None else (self.open + rest, [])


def _parse_json_call(body: str) -> Optional[ParsedToolCall]:
    try:
        return _call_from(json.loads(body))
    except _NOT_JSON:
        return None


class JsonToolParser:
    """The whole answer is a JSON call or a JSON list of calls."""

    name = "json"
    template_format = "json"
    keeps_special_tokens = False

    def new_call_id(self) -> str:
        return random_id("chatcmpl-tool-")

    def extract(self, text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[ParsedToolCall]]:
        stripped = text.strip()
        if stripped[:1] in ("{", "["):
            try:
                obj = json.loads(stripped)
            except _NOT_JSON:
                return text, []
            items = obj if isinstance(obj, list) else [obj]
            calls = [_call_from(o) for o in items]
            if items and all(c is not None for c in calls):
                return None, calls  # type: ignore[return-value]
        return text, []

    def streaming(self, tools: Optional[list] = None) -> "_JsonStream":
        return _JsonStream(self)


class _JsonStream:
    """Text that starts with ``{`` or ``[`` is held to the end (it may be a call); other text
    streams as content."""

    def __init__(self, parser: JsonToolParser, starts: tuple[str, ...] = ("{", "[")) -> None:
        self.parser = parser
        self.starts = starts  # text that may begin a call
        self.buffer = ""
        self.decided: Optional[bool] = None  # True: could be calls, held back

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self.decided is False:
            return text, []
        self.buffer += text
        head = self.buffer.lstrip()
        if not head:
            return "", []
        if any(s.startswith(head) for s in self.starts if len(head) < len(s)):
            return "", []  # too short to tell (a tag's first characters)
        self.decided = head.startswith(self.starts)
        if self.decided:
            return "", []
        out, self.buffer = self.buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buffer = self.buffer, ""
        if not rest:
            return "", []
        content, calls = self.parser.extract(rest)
        return (content or "", calls)


class Llama3JsonToolParser(JsonToolParser):
    """``[<|python_tag|>]{call}[; {call}...]`` or a JSON list: all calls, or none and the text is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[ParsedToolCall]]:
        body = text.strip()
        body = body[len(self.TAG) :].lstrip() if body.startswith(self.TAG) else body
        if body.startswith("["):
            calls = super().extract(body)[1]
            return (None, calls) if calls else (text, [])
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except _NOT_JSON:
                return text, []
            call = _call_from(obj)
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
        return (None, calls) if calls else (text, [])

    def streaming(self, tools: Optional[list] = None) -> "_JsonStream":
        return _JsonStream(self, starts=("{", "[", self.TAG))


TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p
    for p in (
        HermesToolParser(),
        JsonToolParser(),
        Llama3JsonToolParser(),
        Qwen3CoderToolParser(),
        MistralToolParser(),
        PythonicToolParser(),
    )
}
