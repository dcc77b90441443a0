"""The ``pythonic`` tool-call parser (vLLM's name): calls as a Python list of function calls with
keyword arguments, as Llama 3.2 and Llama 4 write them.

    [get_weather(city="Paris", unit="c"), get_time(zone='Europe/Paris')]

The list must start the answer (after spaces), or follow Llama 4's ``<|python_start|>`` (text
before the tag is content; a ``<|python_end|>`` after the list is dropped). Each argument value
is read with :mod:`ast` (``ast.parse``, never ``eval``) and must be a literal
(:func:`python_literal`): strings, numbers, True / False / None, lists, tuples and dicts with
string keys of those; JSON's true / false / null are taken too. A positional argument, a name,
an expression or a call inside an argument is not a tool call: that text is content (see
:mod:`tool_parser_base` for calls that go wrong part-way). Text after the list is content.
Calls stream one argument at a time.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any, Optional, Union

from pagedserve.entrypoints.openai.http_common import random_id
from pagedserve.entrypoints.openai.tool_parser_base import CallTextStream, ParsedToolCall, extract_by_streaming

_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (str, bool, int)) or isinstance(v, float) and math.isfinite(v):
            return v
        raise _NotLiteral(repr(v))  # bytes, complex, Ellipsis, infinities
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
        v = node.operand.value
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, item in zip(node.keys, node.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral("dict keys must be strings")
            out[key.value] = _literal(item)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral(type(node).__name__)


NOT_LITERAL: Any = object()  # what python_literal gives for text that is not a literal


def python_literal(text: str) -> Any:
    """The value of the Python literal ``text`` (see the module's doc), or :data:`NOT_LITERAL`."""
    try:
        return _literal(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError, TypeError):
        return NOT_LITERAL


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_KEYWORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)")
_PARTIAL_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*")
_CLOSING = {")": "(", "]": "[", "}": "{"}


class ValueEnd:
    """Finds where an argument value ends: the index of the ``,`` or ``)`` after it, outside
    brackets and strings. Resumable: the text may grow between calls (a long string value is
    scanned once, not again at every token)."""

    _STRING_STOP = {q: re.compile(r"[\\\n" + q + "]") for q in ("'", '"')}

    def __init__(self, start: int) -> None:
        self.start = start  # where the value starts in the text
        self.k = start  # scanned up to here
        self.stack: list[str] = []
        self.quote = ""  # inside a string: its quote

    def scan(self, s: str) -> Union[int, bool, None]:
        """The end's index; None if ``s`` ends first; False on a bracket that does not match, a
        newline in a one-line string, or a comment."""
        n, k = len(s), self.k
        while k < n:
            if self.quote:  # inside a string: jump to the next backslash, newline or quote
                m = self._STRING_STOP[self.quote[0]].search(s, k)
                if m is None:
                    k = n
                    break
                k = m.start()
                c = s[k]
                if c == "\\":
                    if k + 1 >= n:
                        break  # the escaped character is not there yet
                    k += 2
                elif c == "\n":
                    if len(self.quote) == 1:
                        return False
                    k += 1
                elif s.startswith(self.quote, k):
                    k += len(self.quote)
                    self.quote = ""
                elif len(self.quote) == 3 and k + 3 > n and self.quote.startswith(s[k:]):
                    break  # maybe the closing triple quote, cut
                else:
                    k += 1
                continue
            c = s[k]
            if c in "\"'":
                if s.startswith(c * 3, k):
                    self.quote = c * 3
                elif k + 2 >= n and s[k:] in (c, c * 2):
                    break  # "" or the start of """: wait
                else:
                    self.quote = c
                k += len(self.quote)
                continue
            if c == "#":
                return False
            if c in "([{":
                self.stack.append(c)
            elif c in ")]}":
                if not self.stack:
                    return k if c == ")" else False
                if self.stack.pop() != _CLOSING[c]:
                    return False
            elif c == "," and not self.stack:
                return k
            k += 1
        self.k = k
        return None


class PythonicToolParser:
    """``[name(arg=literal, ...), ...]``, optionally inside ``<|python_start|>...<|python_end|>``."""

    name = "pythonic"
    template_format = "pythonic"
    keeps_special_tokens = False

    def extract(self, text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[ParsedToolCall]]:
        return extract_by_streaming(self.streaming(tools), text)

    def streaming(self, tools: Optional[list] = None) -> "_PythonicStream":
        return _PythonicStream()

    def new_call_id(self) -> str:
        return random_id("chatcmpl-tool-")


class _PythonicStream(CallTextStream):
    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"
        self.calls_in_list = 0
        self.value: Optional[ValueEnd] = None  # the scan of the argument value in progress

    def step(self, final: bool) -> bool:
        st = self.state
        i = self.skip_space()
        if st == "start":  # the answer's beginning: a list, the tag, or text
            tag = self.expect(i, ("[", self.START))
            if tag is None and not final:
                return False
            if not tag:
                self.state = self.TEXT
                return True
            self.take(i + len(tag))
            self.state = "call" if tag == "[" else "list"
            self.calls_in_list = 0
            return True
        if st == self.TEXT:
            if self.text_until((self.START,), final) is None:
                return False
            self.state = "list"
            return True
        if st == "list":  # after the tag: the list
            tag = self.expect(i, ("[",))
            if not tag:
                return self.more(final) if tag is None else self._bad()
            self.take(i + 1)
            self.state, self.calls_in_list = "call", 0
            return True
        if st == "call":  # a call's name and its "("; or "]" after a trailing comma
            if self.buf[i : i + 1] == "]" and self.calls_in_list:
                self.take(i + 1)
                self.commit()
                self.state = "end"
                return True
            m = _IDENT.match(self.buf, i)
            if m is None or m.end() == len(self.buf):
                return self.more(final) if m is not None or i == len(self.buf) else self._bad()
            j = self.skip_space(m.end())
            if j == len(self.buf):
                return self.more(final)
            if self.buf[j] != "(":
                return self._bad()
            self.take(j + 1)
            self.name(m.group())
            self.state = "args"
            return True
        if st == "args":  # the next keyword argument, or ")"
            if i == len(self.buf):
                return self.more(final)
            if self.buf[i] == ")":
                self.take(i + 1)
                self.close_call()
                self.state = "after_call"
                self.calls_in_list += 1
                return True
            m = _KEYWORD.match(self.buf, i)
            if m is None:
                return self.more(final) if _PARTIAL_KEYWORD.fullmatch(self.buf, i) else self._bad()
            if self.value is None or self.value.start != m.end():
                self.value = ValueEnd(m.end())
            end = self.value.scan(self.buf)
            if end is not None:
                self.value = None
            if end is None:
                return self.more(final)
            if end is False:
                return self._bad()
            assert isinstance(end, int)
            value = python_literal(self.buf[m.end() : end])
            if value is NOT_LITERAL or not self.argument(m.group(1), value):
                return self._bad()
            self.buf = self.buf[end + 1 if self.buf[end] == "," else end :]
            return True
        if st == "after_call":  # "," and the next call, or "]"
            tag = self.expect(i, (",", "]"))
            if not tag:
                return self.more(final) if tag is None else self._bad()
            self.take(i + 1)
            self.commit()  # the call before is complete: from here, the next one's text
            self.state = "call" if tag == "," else "end"
            return True
        if st == "end":  # after the list: an optional <|python_end|>, then text
            tag = self.expect(i, (self.END,))
            if tag is None and not final:
                return False
            if tag:
                self.take(i + len(tag))
            self.commit()
            self.state = self.TEXT
            return True
        raise AssertionError(st)

    def bad(self) -> None:
        super().bad()
        self.value = None

    def _bad(self) -> bool:
        self.bad()
        return True
