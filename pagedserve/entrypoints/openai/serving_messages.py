"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: an Anthropic request run
through the chat endpoint's stream (:mod:`.messages_api` translates the request), answered as a
``message`` or as Anthropic's stream of events: ``message_start`` (empty content, the input
tokens), ``ping``, then per content block ``content_block_start``, its deltas (``text_delta``,
or ``input_json_delta`` for a ``tool_use``) and ``content_block_stop``, then ``message_delta``
(``stop_reason``, ``stop_sequence``, the output tokens) and ``message_stop``. A request that
fails after its stream started ends with an ``error`` event in Anthropic's error shape.

The whole message is built from the same events, so its blocks are exactly the streamed ones.
``stop_reason``: ``tool_use`` when the answer calls tools, ``stop_sequence`` (with the matched
string) for a ``stop_sequences`` hit, ``max_tokens`` when cut by ``max_tokens`` (or by the
request's timeout), else ``end_turn``.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Optional

from pydantic_core import from_json

from pagedserve.engine.input_processor import RequestError
from pagedserve.entrypoints.openai.http_common import APIError, api_error
from pagedserve.entrypoints.openai.messages_api import new_tool_use_id, to_chat_request
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.protocol_anthropic import AnthropicCountTokensRequest, AnthropicMessagesRequest, anthropic_error_body
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import TokenizedPrompt
from pagedserve.entrypoints.openai.tools import ToolPlan, plan_tools
from pagedserve.sampling_params import SamplingParams

# Chat's names in refusals of a translated request: (chat's, Anthropic's); the first word of a
# message, or (the quoted tool choices and response_format) anywhere in it.
_CHAT_NAMES = (
    ("response_format.json_schema.schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    ("stop", "stop_sequences"),
)
_CHAT_WORDS = (
    ("tool_choice 'required'", "tool_choice 'any'"),
    ("tool_choice 'named'", "tool_choice 'tool'"),
    ("response_format", "output_config.format"),
)


@dataclass
class PreparedMessage:
    """A checked, rendered request: the chat request that computes it and what chat prepared."""

    chat_req: ChatCompletionRequest
    model: str
    conv: list[dict]
    prompt: TokenizedPrompt
    params: SamplingParams
    plan: ToolPlan


def _renamed(refused: Exception) -> APIError:
    """A chat refusal with the Anthropic request's field names."""
    e = api_error(refused)
    for chat_name, name in _CHAT_NAMES:
        if e.param == chat_name.split(".")[0] and e.message.startswith(chat_name):
            e.message = name + e.message[len(chat_name) :]
            e.param = name.split(".")[0]
    for chat_words, words in _CHAT_WORDS:
        e.message = e.message.replace(chat_words, words)
    if "messages[" in e.message:  # chat's turns are numbered otherwise than Anthropic's
        e.message, e.param = f"messages, as rendered into chat turns: {e.message}", "messages"
    return e


def sse_event(event: dict[str, Any]) -> str:
    """One Anthropic stream event: ``event: <type>`` and its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def stop_reason_of(finish_reason: Optional[str], stop_reason: Any, called: bool) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a chat choice that ended so."""
    if called and finish_reason in ("stop", "tool_calls"):  # a forced named call ends with "stop"
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason in ("length", "timeout"):
        return "max_tokens", None
    return "end_turn", None


def _partial_input(text: str) -> dict:
    """A tool call's ``input`` from its (maybe cut) JSON arguments: the object read so far, or
    ``{}`` when they are not (the start of) a JSON object; never raises."""
    if not text:
        return {}
    try:
        value = from_json(text, allow_partial=True)
    except ValueError:  # not JSON even when cut (a cut string at the top level, a bad token)
        return {}
    return value if isinstance(value, dict) else {}


class ContentBlocks:
    """Chat stream chunks in, Anthropic content-block events out (:meth:`feed`,
    :meth:`finish`); ``done`` holds the finished blocks. A new block starts whenever the kind of
    delta changes (text, a new tool call)."""

    def __init__(self) -> None:
        self.done: list[dict] = []
        self.cur: Optional[dict] = None
        self.parts: list[str] = []  # the current block's text, or its tool call's JSON
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.usage: Any = None

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.done) or (self.cur is not None and self.cur["type"] == "tool_use")

    def _close(self) -> list[dict]:
        if self.cur is None:
            return []
        block, text = self.cur, "".join(self.parts)
        if block["type"] == "text":
            block = {"type": "text", "text": text}
        else:  # arguments cut by max_tokens: what they hold so far, as the SDK reads a partial stream
            block = {**block, "input": _partial_input(text)}
        events = [{"type": "content_block_stop", "index": len(self.done)}]
        self.done.append(block)
        self.cur, self.parts = None, []
        return events

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.cur = block
        return events + [{"type": "content_block_start", "index": len(self.done), "content_block": block}]

    def feed(self, chunk: Any) -> list[dict]:
        """The events of one chat chunk (the usage chunk, last, has none)."""
        if not chunk.choices:
            self.usage = chunk.usage
        events: list[dict] = []
        for ch in chunk.choices:
            d = ch.delta
            if d.content:
                if self.cur is None or self.cur["type"] != "text":
                    events += self._open({"type": "text", "text": ""})
                self.parts.append(d.content)
                events.append({"type": "content_block_delta", "index": len(self.done), "delta": {"type": "text_delta", "text": d.content}})
            for tc in d.tool_calls or []:
                if tc.id is not None:  # a new call
                    events += self._open({"type": "tool_use", "id": new_tool_use_id(), "name": tc.function.name, "input": {}})
                if tc.function is not None and tc.function.arguments and self.cur is not None:
                    self.parts.append(tc.function.arguments)
                    delta = {"type": "input_json_delta", "partial_json": tc.function.arguments}
                    events.append({"type": "content_block_delta", "index": len(self.done), "delta": delta})
            if ch.finish_reason is not None:
                self.finish_reason, self.stop_reason = ch.finish_reason, ch.stop_reason
        return events

    def finish(self) -> list[dict]:
        return self._close()


class AnthropicServingMessages:
    """The Messages endpoints over the chat one (its template, tools and parser)."""

    def __init__(self, chats: OpenAIServingChat) -> None:
        self.chats = chats

    def prepare(self, req: AnthropicMessagesRequest) -> PreparedMessage:
        """Check, translate and render. Raises APIError naming the Anthropic field."""
        chat_req = to_chat_request(req)
        try:
            model, conv, prompt, params, plan = self.chats.prepare_chat(chat_req)
        except (APIError, RequestError) as refused:
            raise _renamed(refused) from None
        return PreparedMessage(chat_req, model, conv, prompt, params, plan)

    def count_tokens(self, req: AnthropicCountTokensRequest) -> dict[str, int]:
        """``{"input_tokens": N}``: the prompt the same message request would have (the same
        template and tools; the tool choice changes nothing there). Raises APIError."""
        chat_req = to_chat_request(req)
        try:
            self.chats.check_model(chat_req.model)
            plan_tools(chat_req.tools, "none", True, None)  # the tools' shape, as the message request checks it
            _, ids = self.chats.render_chat(
                chat_req.messages, chat_req.add_generation_prompt, chat_req.continue_final_message, None, None, chat_req.tools, False
            )
        except (APIError, RequestError) as refused:
            raise _renamed(refused) from None
        return {"input_tokens": len(ids)}

    async def _events(self, stream: bool, message_id: str, p: PreparedMessage, engine_id: str) -> AsyncGenerator[dict, None]:
        blocks = ContentBlocks()
        usage = {"input_tokens": len(p.prompt.token_ids), "output_tokens": 0}
        message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": p.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        yield {"type": "message_start", "message": message}
        yield {"type": "ping"}
        try:
            async with aclosing(self.chats.chat_chunks(p.chat_req, message_id, p.model, p.conv, p.prompt, p.params, p.plan, engine_id)) as chunks:  # type: ignore[type-var]
                async for c in chunks:
                    for event in blocks.feed(c):
                        yield event
        except (APIError, ValueError, RuntimeError) as failed:
            if not stream:
                raise
            err = api_error(failed)
            yield anthropic_error_body(err.message, err.status_code, "Retry-After" in err.headers)
            return
        for event in blocks.finish():
            yield event
        reason, sequence = stop_reason_of(blocks.finish_reason, blocks.stop_reason, blocks.called)
        output_tokens = blocks.usage.completion_tokens if blocks.usage is not None else 0
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": {"output_tokens": output_tokens}}
        yield {
            "type": "message_stop",
            "message": {
                **message,
                "content": blocks.done,
                "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": {**usage, "output_tokens": output_tokens},
            },
        }

    async def message_stream(self, message_id: str, p: PreparedMessage, engine_id: str) -> AsyncIterator[str]:
        """The SSE events of the message."""
        async with aclosing(self._events(True, message_id, p, engine_id)) as events:
            async for e in events:
                if e["type"] == "message_stop":
                    e = {"type": "message_stop"}  # the whole message is the non-streamed answer's
                yield sse_event(e)

    async def message_full(self, message_id: str, p: PreparedMessage, engine_id: str) -> dict:
        """The ``message``. Raises what the chat stream raises when the request fails."""
        last: dict = {}
        async with aclosing(self._events(False, message_id, p, engine_id)) as events:
            async for e in events:
                last = e
        return last["message"]
