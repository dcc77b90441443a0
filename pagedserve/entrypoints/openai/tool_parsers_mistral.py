"""The ``mistral`` tool-call parser (vLLM's name): calls after Mistral's ``[TOOL_CALLS]`` token,
in either of the two styles Mistral models write:

    Some text first.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is Mistral 7B v0.3's (a JSON list of ``{"name", "arguments"}``, arguments an object or
a JSON string of one; other keys such as ``id`` are ignored); the second is tokenizer v11's and
later (Mistral Small 3.2, Devstral, Magistral): a name, ``[ARGS]`` (or nothing) and the arguments
object, several calls each after ``[TOOL_CALLS]`` or one after the other; a ``[CALL_ID]id``
before ``[ARGS]`` is skipped. Text before the first ``[TOOL_CALLS]`` is content, and so is text
that does not parse as a call (see :mod:`tool_parser_base` for calls that go wrong part-way).
Arguments stream one top-level argument at a time, each once it is complete JSON.

``[TOOL_CALLS]`` is a special token of Mistral's tokenizers: with this parser and tools, the answer
is decoded with special tokens kept (``skip_special_tokens`` off), as vLLM does. Call ids are 9
letters and digits, the only ids Mistral's chat templates take back in the history.
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any, Optional

from pagedserve.entrypoints.openai.tool_parser_base import CallTextStream, ParsedToolCall, extract_by_streaming

_ALNUM = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_CALL_ID = re.compile(r"[A-Za-z0-9]*")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


class MistralToolParser:
    """``[TOOL_CALLS]`` then a JSON list of calls, or ``name[ARGS]{arguments}`` calls."""

    name = "mistral"
    template_format = "mistral"
    keeps_special_tokens = True

    def extract(self, text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[ParsedToolCall]]:
        return extract_by_streaming(self.streaming(tools), text)

    def streaming(self, tools: Optional[list] = None) -> "_MistralStream":
        return _MistralStream()

    def new_call_id(self) -> str:
        return "".join(random.choices(_ALNUM, k=9))


class _MistralStream(CallTextStream):
    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self) -> None:
        super().__init__()
        self.item: dict[str, Any] = {}  # the list style: the item's name and arguments so far
        self.args_return = ""  # the state after an arguments object

    def step(self, final: bool) -> bool:
        st = self.state
        if st == self.TEXT:
            if self.text_until((self.BOT,), final) is None:
                return False
            self.state = "after_bot"
            return True
        i = self.skip_space()
        if st in ("after_bot", "after_call"):
            if i == len(self.buf):
                return self.more(final) if st == "after_bot" else self._end_of_calls(final)
            if st == "after_call" and self.buf.startswith(self.BOT[: len(self.buf) - i], i):
                if len(self.buf) - i < len(self.BOT):
                    return self._end_of_calls(final)
                self.commit()  # the call before is complete: from here, this one's text
                self.take(i + len(self.BOT))
                self.state = "after_bot"
                return True
            if st == "after_bot" and self.buf[i] == "[":
                self.take(i + 1)
                self.state, self.item = "list", {}
                return True
            if _NAME.match(self.buf[i]):
                if st == "after_call":  # the spaces before it are content if it is none
                    self.commit()
                self.take(i)
                self.state = "name"
                return True
            return self._bad() if st == "after_bot" else self._not_a_call()
        if st == "name":  # name, optional [CALL_ID]id, optional [ARGS], then "{"
            m = _NAME.match(self.buf)
            if m is None:
                return self._bad()
            j = m.end()
            tag = self.expect(j, (self.ARGS, "{", self.CALL_ID))
            if tag == self.CALL_ID:
                j = _CALL_ID.match(self.buf, j + len(tag)).end()  # type: ignore[union-attr]
                tag = self.expect(j, (self.ARGS, "{"))
            if not tag:
                return self.more(final) if tag is None else self._bad()
            if tag == self.ARGS:
                j = self.skip_space(j + len(tag))
                if j == len(self.buf):
                    return self.more(final)
                if self.buf[j] != "{":
                    return self._bad()
            self.name(m.group())
            self.take(j + 1)
            self.state, self.args_return = "args", "after_call"
            return True
        if st == "args":  # inside an arguments object: the next "key": value, or "}"
            return self._argument(i, final)
        if st == "list":  # the list style: the next item, or the list's end
            if i == len(self.buf):
                return self.more(final)
            c = self.buf[i]
            if c == "{":
                self.take(i + 1)
                self.item, self.state = {}, "item"
                return True
            if c in ",]" and self.item.get("done"):
                self.take(i + 1)
                self.commit()
                self.state = "list" if c == "," else "after_call"
                self.item = {} if c == "," else self.item
                return True
            return self._bad()
        if st == "item":
            return self._item_key(i, final)
        if st == "item_rest":  # after an item's streamed arguments: "," and more keys, or "}"
            tag = self.expect(i, (",", "}"))
            if not tag:
                return self.more(final) if tag is None else self._bad()
            self.take(i + (tag == ","))
            self.state = "item"
            return True
        raise AssertionError(st)

    def _end_of_calls(self, final: bool) -> bool:
        """After a call, the text ends or may still be [TOOL_CALLS]: wait; at the end, the
        spaces left are content."""
        if not final:
            return False
        return self._not_a_call()

    def _not_a_call(self) -> bool:
        """After a complete call: the rest is text."""
        self.commit()
        self.state = self.TEXT
        return True

    def _decode(self, i: int) -> Optional[tuple[Any, int]]:
        """The JSON value at ``i`` and the index after it, if followed by ``,`` or ``}``."""
        try:
            value, end = _DECODER.raw_decode(self.buf, i)
        except (json.JSONDecodeError, ValueError, RecursionError):
            return None
        k = self.skip_space(end)
        if k == len(self.buf) or self.buf[k] not in ",}":
            return None
        return value, k

    def _key(self, i: int) -> Optional[tuple[str, int]]:
        """``"key":`` at ``i``, and the index of its value."""
        if self.buf[i] != '"':
            return None
        try:
            key, end = _DECODER.raw_decode(self.buf, i)
        except (json.JSONDecodeError, ValueError):
            return None
        k = self.skip_space(end)
        if k == len(self.buf) or self.buf[k] != ":":
            return None
        return key, self.skip_space(k + 1)

    def _argument(self, i: int, final: bool) -> bool:
        if i == len(self.buf):
            return self.more(final)
        if self.buf[i] == "}":
            self.take(i + 1)
            self.close_call()
            self.state = self.args_return
            return True
        key = self._key(i)
        found = self._decode(key[1]) if key else None
        if key is None or found is None:
            return self.more(final)  # incomplete, or not JSON: decided at the end
        value, k = found
        if not self.argument(key[0], value):
            return self._bad()
        self.buf = self.buf[k + 1 if self.buf[k] == "," else k :]
        return True

    def _item_key(self, i: int, final: bool) -> bool:
        """One ``"key": value`` of a list item, or its ``}``: the name, then the arguments as
        they come (an arguments object before the name is sent whole once the name is in)."""
        if i == len(self.buf):
            return self.more(final)
        item = self.item
        if self.buf[i] == "}":
            if not isinstance(item.get("name"), str):
                return self._bad()
            self.take(i + 1)
            if not item.get("sent"):
                self.name(item["name"])
                for k, v in (item.get("arguments") or {}).items():
                    self.argument(k, v)
                self.close_call()
            item["done"] = True
            self.state = "list"
            return True
        key = self._key(i)
        if key is None:
            return self.more(final)
        k = key[1]
        if key[0] == "arguments" and isinstance(item.get("name"), str) and k < len(self.buf) and self.buf[k] == "{":
            self.take(k + 1)
            self.name(item["name"])
            item["sent"], item["arguments"] = True, {}
            self.state, self.args_return = "args", "item_rest"
            return True
        found = self._decode(k)
        if found is None:
            return self.more(final)
        value, end = found
        if key[0] == "name" and not isinstance(value, str) or key[0] == "arguments" and not isinstance(_object(value), dict):
            return self._bad()
        if key[0] in ("name", "arguments") and key[0] not in item:
            item[key[0]] = value if key[0] == "name" else _object(value)
        self.take(end + 1 if self.buf[end] == "," else end)
        return True

    def _bad(self) -> bool:
        self.bad()
        return True


def _object(value: Any) -> Any:
    """Arguments as an object: a JSON string of one is decoded."""
    if isinstance(value, str):
        try:
            return json.loads(value, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
    return value
