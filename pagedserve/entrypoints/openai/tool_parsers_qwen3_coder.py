"""The ``qwen3_coder`` tool-call parser (vLLM's name): Qwen3-Coder's XML-style calls.

    Some text first (the content).
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Several ``<tool_call>`` blocks (or several functions in one block) are several calls (the
spaces between blocks are not content); a
``<function=...>`` without the ``<tool_call>`` around it counts too. A value is the text between
``<parameter=NAME>`` and ``</parameter>`` (a ``<parameter=``, ``</function>`` or ``</tool_call>``
also ends it), less one newline at each end, converted to the type the request's tool declares
for that parameter (:func:`convert_value`). Text outside the blocks is content; a block that does
not parse is content (see :mod:`tool_parser_base` for calls that go wrong part-way). Calls stream
one argument at a time, each once its ``</parameter>`` is in.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from pagedserve.entrypoints.openai.http_common import random_id
from pagedserve.entrypoints.openai.tool_parser_base import (
    CallTextStream,
    ParsedToolCall,
    extract_by_streaming,
    schema_types,
    tool_properties,
)
from pagedserve.entrypoints.openai.tool_parsers_pythonic import python_literal

_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _number(text: str, integer: bool) -> Any:
    if _INT.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # over Python's 4,300-digit limit: does not fit, stays text
            return None
    if not integer and _FLOAT.fullmatch(text):
        x = float(text)
        if math.isfinite(x):
            return int(x) if x.is_integer() and "e" not in text.lower() and abs(x) < 2**53 else x
    return None


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text as the type its schema declares: ``string`` (or no type, or a
    parameter the tool does not declare) stays text; ``integer`` / ``number`` as numbers,
    ``boolean`` from true/false (any case), ``object`` / ``array`` from JSON (or a Python
    literal); ``null`` / ``None`` is null for any type but string. Text that is none of the
    declared types stays text, as the model wrote it."""
    types = schema_types(schema)
    if not types and isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        for member in schema["enum"]:  # an enum without a type: the member the text names
            if not isinstance(member, str) and json.dumps(member) == text.strip():
                return member
        return text
    if not types or "string" in types:
        return text
    s = text.strip()
    if s.lower() in ("null", "none"):
        return None
    for t in ("integer", "number", "boolean", "object", "array"):
        if t not in types:
            continue
        if t in ("integer", "number"):
            value = _number(s, t == "integer")
            if value is not None:
                return value
        elif t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        elif t in ("object", "array"):
            want = dict if t == "object" else list
            try:
                value = json.loads(s, parse_constant=_no_constant)
            except (ValueError, RecursionError):
                value = python_literal(s)
            if isinstance(value, want):
                return value
    return text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_NAME = re.compile(r"[^<>\n]+")


class Qwen3CoderToolParser:
    """``<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>``."""

    name = "qwen3_coder"
    template_format = "qwen3_coder"
    keeps_special_tokens = False

    def extract(self, text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[ParsedToolCall]]:
        return extract_by_streaming(self.streaming(tools), text)

    def streaming(self, tools: Optional[list] = None) -> "_Qwen3CoderStream":
        return _Qwen3CoderStream(tools)

    def new_call_id(self) -> str:
        return random_id("chatcmpl-tool-")


class _Qwen3CoderStream(CallTextStream):
    BLOCK, OPEN, CLOSE = "<tool_call>", "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"

    def __init__(self, tools: Optional[list]) -> None:
        super().__init__()
        self.tools = tools
        self.props: dict = {}
        self.param = ""
        self.searched = 0  # how much of a value was searched for its end already

    def step(self, final: bool) -> bool:
        st = self.state
        if st == self.TEXT:
            tag = self.text_until((self.OPEN, self.FUNCTION), final)
            if tag is None:
                return False
            self.state = "block" if tag == self.OPEN else "function_name"
            return True
        if st == "block":  # inside <tool_call>: a function, or the block's end
            i = self.skip_space()
            tag = self.expect(i, (self.FUNCTION, self.CLOSE))
            if not tag:
                return self.more(final) if tag is None else self._bad()
            self.take(i + len(tag))
            if tag == self.CLOSE:
                self.commit()
                self.state = "between"
            else:
                self.state = "function_name"
            return True
        if st in ("function_name", "param_name"):
            j = self.buf.find(">")
            if j < 0:  # fail now only if no ">" to come can make a name (as the whole text would)
                return self._bad() if "<" in self.buf or "\n" in self.buf.strip() else self.more(final)
            name = self.buf[:j].strip()
            if not _NAME.fullmatch(name):
                return self._bad()
            self.take(j + 1)
            if st == "function_name":
                self.name(name)
                self.props = tool_properties(self.tools, name)
                self.state = "params"
            else:
                self.param, self.searched, self.state = name, 0, "value"
            return True
        if st == "params":  # between parameters: the next, or the function's end
            i = self.skip_space()
            tag = self.expect(i, (self.PARAM, self.FUNCTION_END, self.CLOSE))
            if not tag:
                return self.more(final) if tag is None else self._bad()
            self.take(i + len(tag))
            if tag == self.PARAM:
                self.state = "param_name"
                return True
            self.close_call()
            self.state = "after_function" if tag == self.FUNCTION_END else "between"
            return True
        if st == "value":
            return self._value(final)
        if st == "after_function":  # another function in the block, or its end
            i = self.skip_space()
            tag = self.expect(i, (self.CLOSE, self.FUNCTION))
            if tag is None and not final:
                return False
            if not tag:  # the block was not closed: what follows is text
                self.raw, self.state = "", self.TEXT
                return True
            self.commit()  # the call before is complete: from here, the next one's text
            self.take(i + len(tag))
            if tag == self.CLOSE:
                self.commit()
            self.state = "between" if tag == self.CLOSE else "function_name"
            return True
        if st == "between":  # after a block: spaces before the next one are not content
            i = self.skip_space()
            tag = self.expect(i, (self.OPEN, self.FUNCTION))
            if tag is None and not final:
                return False
            if not tag:
                self.state = self.TEXT
                return True
            self.take(i + len(tag))
            self.state = "block" if tag == self.OPEN else "function_name"
            return True
        raise AssertionError(st)

    def _value(self, final: bool) -> bool:
        ends = [(j, t) for t in (self.PARAM_END, self.PARAM, self.FUNCTION_END, self.CLOSE) if (j := self.buf.find(t, self.searched)) >= 0]
        if not ends:
            self.searched = max(0, len(self.buf) - len(self.FUNCTION_END))
            return self.more(final)
        j, tag = min(ends)
        text = self.buf[:j]
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        if not self.argument(self.param, convert_value(text, self.props.get(self.param))):
            return self._bad()
        self.buf = self.buf[j + len(tag) if tag == self.PARAM_END else j :]
        self.state = "params"
        return True

    def _bad(self) -> bool:
        self.bad()
        return True
