"""What every tool-call parser shares: the parsed call, the streamed pieces of a call, and the
incremental machine the ``qwen3_coder``, ``mistral`` and ``pythonic`` parsers are built on.

A parser has ``extract(text, tools)`` (a finished answer: ``(content or None, calls)``) and
``streaming(tools)``, a stream with ``feed(text)`` and ``finish()``, each giving ``(content to
send now, calls)``. A stream's calls are :class:`ParsedToolCall` (a whole call) or
:class:`ToolCallDelta` pieces: a piece with a name starts a new call, one without adds to the
arguments of the call started last. Concatenating a call's pieces gives its arguments JSON.

:class:`CallTextStream` (the incremental parsers' base) streams each call's arguments one
argument at a time, as normalized JSON (``json.dumps`` of the arguments dict): ``{"a": 1`` with
the first argument, ``, "b": 2`` with each next one, ``}`` at the end (``{}`` for none). A call
appears once its name and first argument (or the end of an empty argument list) have parsed:

* a call that goes wrong before that is text: from its first character the text is read again
  as content (later calls in it still count);
* a call that goes wrong after that (or is cut off) keeps its arguments so far, closed, and the
  rest is read again as content.

The extract of a whole answer is the same machine fed all at once, so a stream, however it is
cut, concatenates to the end-of-request parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: with ``name``, a new call and the start of its arguments;
    without, more of the last call's arguments."""

    name: Optional[str]
    arguments: str = ""


StreamCall = Union[ParsedToolCall, ToolCallDelta]


class ToolCallTextStream(Protocol):
    def feed(self, text: str) -> tuple[str, list[Any]]: ...

    def finish(self) -> tuple[str, list[Any]]: ...


class ToolParser(Protocol):
    name: str
    template_format: str  # the tool_call_format the fallback chat template renders calls in
    keeps_special_tokens: bool  # its markers are special tokens: the answer is decoded with them

    def extract(self, text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[ParsedToolCall]]: ...

    def streaming(self, tools: Optional[list] = None) -> ToolCallTextStream: ...

    def new_call_id(self) -> str: ...


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def assemble(pieces: list[StreamCall]) -> list[ParsedToolCall]:
    """Whole calls from a stream's calls and pieces."""
    calls: list[ParsedToolCall] = []
    for p in pieces:
        if isinstance(p, ParsedToolCall):
            calls.append(ParsedToolCall(p.name, p.arguments))
        elif p.name is not None:
            calls.append(ParsedToolCall(p.name, p.arguments))
        elif calls:
            calls[-1].arguments += p.arguments
    return calls


def extract_by_streaming(stream: ToolCallTextStream, text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
    """(content or None, calls) of a whole answer fed to ``stream`` at once: content of only
    whitespace around calls is None."""
    content, pieces = stream.feed(text)
    more_content, more_pieces = stream.finish()
    content += more_content
    calls = assemble(pieces + more_pieces)
    return (content if content.strip() or not calls else None), calls


def to_json(value: Any) -> str:
    """``value`` as the arguments JSON writes it. Raises ValueError for NaN and infinities."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (``type`` as a name or a list, and those of
    ``anyOf`` / ``oneOf`` branches); empty when it says none."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    out = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            out |= schema_types(branch)
    return out


def tool_properties(tools: Optional[list], name: str) -> dict:
    """The ``properties`` of the function ``name`` among a request's ``tools`` ({} if unknown)."""
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


MORE = None  # a step that needs more text
_SPACE = re.compile(r"\s*")


class CallTextStream:
    """An incremental parser: ``buf`` holds the text not decided yet, ``raw`` what a call in
    progress has consumed of it but not sent (given back as content if the call goes wrong).

    A subclass sets ``state`` and implements :meth:`step`, which handles the start of ``buf`` in
    the current state and returns True when it moved on, False when it needs more text (in
    ``final`` mode it must move on: :meth:`more` turns a wait into a failure there).
    """

    TEXT = "text"  # the state text is read in again after a failure

    def __init__(self) -> None:
        self.state = self.TEXT
        self.buf = ""
        self.raw = ""
        self.content = ""
        self.pieces: list[StreamCall] = []
        self.pending: Optional[str] = None  # a call's name, before its first argument
        self.open = False  # a call is out and its arguments are open
        self.keys: set[str] = set()

    # -- the stream --------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[StreamCall]]:
        self.buf += text
        return self._run(False)

    def finish(self) -> tuple[str, list[StreamCall]]:
        out = self._run(True)
        if self.open or self.pending is not None:  # cannot happen: a failure closes the call
            self.bad()
            out = (out[0] + self.content, out[1] + self.pieces)
        return out

    def _run(self, final: bool) -> tuple[str, list[StreamCall]]:
        while (self.buf or final and (self.raw or self.state != self.TEXT)) and self.step(final):
            pass
        merged: list[StreamCall] = []
        for p in self.pieces:  # one piece per call and feed
            if isinstance(p, ToolCallDelta) and p.name is None and merged and isinstance(merged[-1], ToolCallDelta):
                merged[-1] = ToolCallDelta(merged[-1].name, merged[-1].arguments + p.arguments)
            else:
                merged.append(p)
        out = (self.content, merged)
        self.content, self.pieces = "", []
        return out

    def step(self, final: bool) -> bool:
        raise NotImplementedError

    # -- helpers of the steps ----------------------------------------------------------------

    def more(self, final: bool) -> bool:
        """Wait for more text; at the end of the answer, the call has gone wrong."""
        if final:
            self.bad()
            return True
        return False

    def take(self, n: int) -> str:
        """Consume ``n`` characters into the call's raw text."""
        out, self.buf = self.buf[:n], self.buf[n:]
        self.raw += out
        return out

    def skip_space(self, j: int = 0) -> int:
        """Index of the first non-space character of ``buf`` from ``j`` (its length if none)."""
        return _SPACE.match(self.buf, j).end()  # type: ignore[union-attr]

    def expect(self, i: int, tokens: tuple[str, ...]) -> Optional[str]:
        """Which of ``tokens`` starts ``buf`` at ``i``; MORE (None) if ``buf`` ends in one's
        beginning; "" if none can."""
        rest = self.buf[i:]
        for t in tokens:
            if rest.startswith(t):
                return t
        if any(t.startswith(rest) for t in tokens):
            return MORE
        return ""

    def emit_content(self, n: int) -> None:
        self.content += self.buf[:n]
        self.buf = self.buf[n:]

    def text_until(self, tags: tuple[str, ...], final: bool) -> Optional[str]:
        """TEXT state: send the content before the first of ``tags`` and consume the tag (into
        ``raw``); returns it, or None when no tag starts yet (the end of the text that may begin
        one is kept, unless ``final``)."""
        hits = [(i, t) for t in tags if (i := self.buf.find(t)) >= 0]
        if hits:
            i, tag = min(hits)
            self.emit_content(i)
            self.raw = ""
            self.take(len(tag))
            return tag
        keep = 0 if final else max(partial_suffix(self.buf, t) for t in tags)
        self.emit_content(len(self.buf) - keep)
        return None

    def name(self, name: str) -> None:
        """A call's name has parsed; it goes out with its first argument."""
        self.pending, self.keys = name, set()

    def argument(self, key: str, value: Any) -> bool:
        """An argument has parsed (a key seen before is dropped: the first one counts). False,
        and nothing sent, when the value has no JSON form (NaN, infinities)."""
        if key in self.keys:
            self.raw = ""
            return True
        try:
            piece = ("{" if not self.keys else ", ") + to_json(key) + ": " + to_json(value)
        except (ValueError, TypeError, RecursionError):
            return False
        self.keys.add(key)
        if self.pending is not None:
            self.pieces.append(ToolCallDelta(self.pending, piece))
            self.pending, self.open = None, True
        else:
            self.pieces.append(ToolCallDelta(None, piece))
        self.raw = ""
        return True

    def close_call(self) -> None:
        """The end of a call's arguments."""
        if self.pending is not None:
            self.pieces.append(ToolCallDelta(self.pending, "{}"))
        elif self.open:
            self.pieces.append(ToolCallDelta(None, "}"))
        self.pending, self.open = None, False
        self.raw = ""

    def commit(self) -> None:
        """What was consumed belongs to the calls (tags between them): never content."""
        self.raw = ""

    def bad(self) -> None:
        """The text does not go on as a call: close a call that is out, and read everything not
        sent yet again as text, from its second character (its first is content)."""
        rest = self.raw + self.buf
        if self.open:
            self.close_call()
        self.pending, self.open = None, False
        self.buf, self.raw = rest, ""
        self.emit_content(1)
        self.state = self.TEXT
