"""``POST /v1/responses``: a Responses request run through the chat endpoint's stream
(:mod:`.responses_api` translates both ways), whole or as OpenAI's stream of typed events:
``response.created``, ``response.in_progress``, then per output item ``output_item.added``,
its deltas (``reasoning_text``, ``output_text`` inside a ``content_part``,
``function_call_arguments``) and ``output_item.done``, and last ``response.completed`` (or
``response.incomplete`` when cut by ``max_output_tokens``; ``error`` + ``response.failed``
when the request fails after it started). Every event carries a ``sequence_number``.

The whole answer is built by the same :class:`OutputItems` from the same chat chunks, so its
items are exactly the streamed ones (text between tool calls is a message item of its own)."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from pagedserve.engine.input_processor import RequestError
from pagedserve.entrypoints.openai.http_common import APIError, api_error
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.responses_api import (
    ResponsesRequest,
    check_responses_fields,
    function_call_item,
    message_item,
    new_id,
    now,
    reasoning_item,
    response_object,
    sse_event,
    status_of,
    to_chat_request,
    usage_object,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import TokenizedPrompt
from pagedserve.entrypoints.openai.tools import ToolPlan
from pagedserve.sampling_params import SamplingParams

# Chat's names in messages about a Responses request: (chat param, Responses param).
_CHAT_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def _logprobs(lps: Any) -> list[dict]:
    """Chat's logprobs of a chunk in the Responses shape (``token``, ``logprob``, ``bytes``,
    ``top_logprobs``)."""
    if lps is None or not lps.content:
        return []
    return [
        {
            "token": c.token,
            "logprob": c.logprob,
            "bytes": c.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in c.top_logprobs],
        }
        for c in lps.content
    ]


class OutputItems:
    """Chat stream chunks in, Responses events out (:meth:`feed`, :meth:`finish`); ``done``
    holds the finished output items. A new item starts whenever the kind of delta changes
    (reasoning, text, a new tool call)."""

    def __init__(self) -> None:
        self.done: list[dict] = []
        self.cur: Optional[dict] = None  # the item being streamed
        self.text: list[str] = []
        self.logprobs: list[dict] = []  # the current message's, with include message.output_text.logprobs
        self.seq = 0
        self.token_ids: list[int] = []
        self.finish_reason: Optional[str] = None
        self.usage: Any = None

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _close(self, status: str = "completed") -> list[dict]:
        item, text, index = self.cur, "".join(self.text), len(self.done)
        if item is None:
            return []
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            item = reasoning_item(item["id"], text)
            events = [self.event("response.reasoning_text.done", **ids, content_index=0, text=text)]
        elif item["type"] == "message":
            item = message_item(item["id"], text, logprobs=self.logprobs)
            events = [
                self.event("response.output_text.done", **ids, content_index=0, text=text, logprobs=self.logprobs),
                self.event("response.content_part.done", **ids, content_index=0, part=item["content"][0]),
            ]
        else:
            item = function_call_item(item["id"], item["call_id"], item["name"], text)
            events = [self.event("response.function_call_arguments.done", **ids, name=item["name"], arguments=text)]
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.done.append(item)
        self.cur, self.text, self.logprobs = None, [], []
        return events

    def _open(self, item: dict) -> list[dict]:
        events = self._close()
        self.cur = item
        events.append(self.event("response.output_item.added", output_index=len(self.done), item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.done), content_index=0, part=part))
        return events

    def _delta(self, kind: str, delta: str, logprobs: Optional[list] = None) -> list[dict]:
        """One text delta of the current item; reasoning and text open their item when the
        kind changes (a call's item was opened by its id)."""
        events = []
        if kind != "function_call" and (self.cur is None or self.cur["type"] != kind):
            item = (
                {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
                if kind == "reasoning"
                else message_item(new_id("msg"), "", status="in_progress")
            )
            events = self._open(item)
        self.text.append(delta)
        ids = {"item_id": self.cur["id"], "output_index": len(self.done)}
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **ids, content_index=0, delta=delta))
        elif kind == "message":
            self.logprobs += logprobs or []
            events.append(self.event("response.output_text.delta", **ids, content_index=0, delta=delta, logprobs=logprobs or []))
        else:
            events.append(self.event("response.function_call_arguments.delta", **ids, delta=delta))
        return events

    def feed(self, chunk: Any) -> list[dict]:
        """The events of one chat chunk (the usage chunk, last, has none)."""
        if not chunk.choices:
            self.usage = chunk.usage
        events = []
        for ch in chunk.choices:
            self.token_ids += getattr(ch, "token_ids", None) or []
            d = ch.delta
            if d.reasoning_content:
                events += self._delta("reasoning", d.reasoning_content)
            if d.content:
                events += self._delta("message", d.content, _logprobs(ch.logprobs))
            for tc in d.tool_calls or []:
                if tc.id is not None:  # a new call
                    events += self._open(function_call_item(new_id("fc"), tc.id, tc.function.name, "", status="in_progress"))
                if tc.function is not None and tc.function.arguments:
                    events += self._delta("function_call", tc.function.arguments)
            self.finish_reason = ch.finish_reason or self.finish_reason
        return events

    def finish(self) -> list[dict]:
        """The events that close the last item (an empty message when nothing came); an answer
        cut short leaves that item ``incomplete``, as OpenAI marks it."""
        events = [] if self.cur or self.done else self._open(message_item(new_id("msg"), "", status="in_progress"))
        return events + self._close(status_of(self.finish_reason)[0])


class OpenAIServingResponses:
    """The Responses endpoint over the chat one (its template, tools, reasoning parser)."""

    def __init__(self, chats: OpenAIServingChat) -> None:
        self.chats = chats

    def prepare(self, req: ResponsesRequest) -> tuple[ChatCompletionRequest, str, list[dict], TokenizedPrompt, SamplingParams, ToolPlan]:
        """Check and render. Raises APIError naming the Responses field (a refusal of the chat
        request, RequestError or APIError, renamed)."""
        check_responses_fields(req)
        chat_req = to_chat_request(req)
        try:
            model, conv, prompt, params, plan = self.chats.prepare_chat(chat_req)
        except (APIError, RequestError) as refused:  # name the Responses fields, not the chat ones
            e = api_error(refused)
            e.message = e.message.replace("messages[", "chat turn [").replace("messages", "input")
            if e.param is not None and e.param.startswith("messages"):
                e.message, e.param = f"input, as rendered into chat turns: {e.message}", "input"
            for chat_name, name in _CHAT_NAMES:
                e.message = e.message.replace(chat_name, name)
                if e.param is not None and e.param.startswith(chat_name.split(".")[0]):
                    e.param = name.split(".")[0]
            if e is refused:
                raise
            raise e from None
        return chat_req, model, conv, prompt, params, plan

    def _reasoning_tokens(self, chat_req: ChatCompletionRequest, prompt: TokenizedPrompt, token_ids: list[int]) -> int:
        thinking = self.chats.thinking(chat_req, prompt)
        return 0 if thinking is False else self.chats.reasoning.reasoning_tokens(token_ids, thinking)

    async def _events(
        self,
        stream: bool,
        req: ResponsesRequest,
        chat_req: ChatCompletionRequest,
        response_id: str,
        model: str,
        conv: list[dict],
        prompt: TokenizedPrompt,
        params: SamplingParams,
        plan: ToolPlan,
        engine_id: str,
    ) -> AsyncIterator[dict]:
        created = now()
        items = OutputItems()

        def response(status: str, **kw: Any) -> dict:
            return response_object(req, params, response_id, model, created, status, list(items.done), **kw)

        yield items.event("response.created", response=response("in_progress"))
        yield items.event("response.in_progress", response=response("in_progress"))
        try:
            async with aclosing(self.chats.chat_chunks(chat_req, response_id, model, conv, prompt, params, plan, engine_id)) as chunks:
                async for c in chunks:
                    for e in items.feed(c):
                        yield e
            for e in items.finish():
                yield e
            status, incomplete = status_of(items.finish_reason)
            u = items.usage
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            usage = usage_object(u.prompt_tokens, cached, u.completion_tokens, self._reasoning_tokens(chat_req, prompt, items.token_ids))
            yield items.event(
                "response.completed" if status == "completed" else "response.incomplete",
                response=response(status, usage=usage, incomplete=incomplete),
            )
        except (APIError, ValueError, RuntimeError) as e:
            if not stream:
                raise
            err = api_error(e)
            code = "server_error" if isinstance(e, RuntimeError) else "invalid_request_error"  # a dead engine, a bug
            yield items.event("error", code=code, message=err.message, param=err.param)
            yield items.event("response.failed", response=response("failed", error={"code": code, "message": err.message}))

    async def response_stream(self, *args: Any) -> AsyncIterator[str]:
        """The SSE events; ``args`` as :meth:`response_full`'s."""
        async with aclosing(self._events(True, *args)) as events:
            async for e in events:
                yield sse_event(e)

    async def response_full(self, *args: Any) -> dict:
        """The ``response`` object of the last event. Raises what the chat stream raises when
        the request fails (APIError, RequestError, EngineDeadError)."""
        last = None
        async with aclosing(self._events(False, *args)) as events:
            async for e in events:
                last = e
        return last["response"]
