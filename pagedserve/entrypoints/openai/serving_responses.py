"""``POST /v1/responses``: a Responses request run through the chat endpoint
(:mod:`.responses_api` translates both ways), whole or as OpenAI's stream of typed events:
``response.created``, ``response.in_progress``, then per output item ``output_item.added``,
its deltas (``reasoning_text``, ``output_text`` inside a ``content_part``,
``function_call_arguments``) and ``output_item.done``, and last ``response.completed`` (or
``response.incomplete`` when cut by ``max_output_tokens``; ``error`` + ``response.failed``
when the request fails after it started). Every event carries a ``sequence_number``."""
from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.engine.input_processor import RequestError
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.responses_api import (
    ResponsesRequest, function_call_item, message_item, new_id, now, reasoning_item, response_object, sse_event, status_of,
    to_chat_request, usage_object,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import TokenizedPrompt, check_extra_fields, log_ignored
from pagedserve.entrypoints.openai.tools import ToolPlan
from pagedserve.sampling_params import SamplingParams


def reasoning_tokens(token_ids: list[int], params: SamplingParams) -> int:
    """Output tokens spent thinking: up to and with ``</think>`` (all of them if it never came)."""
    end = params._reasoning_end_token_id
    if end is None:
        return 0
    return token_ids.index(end) + 1 if end in token_ids else len(token_ids)


class OpenAIServingResponses:
    """The Responses endpoint over the chat one (its template, tools, reasoning parser)."""

    def __init__(self, chats: OpenAIServingChat) -> None:
        self.chats = chats

    def prepare(self, req: ResponsesRequest) -> tuple[ChatCompletionRequest, str, list[dict], TokenizedPrompt, SamplingParams, ToolPlan]:
        """Check and render; raises RequestError (HTTP 400) naming the field."""
        check_extra_fields(req)
        for name in ("store", "reasoning", "include"):
            if getattr(req, name):
                log_ignored(name)  # nothing is stored; effort and encrypted reasoning have no meaning here
        chat_req = to_chat_request(req, req.stream)
        model, conv, prompt, params, plan = self.chats.prepare_chat(chat_req)
        return chat_req, model, conv, prompt, params, plan

    async def response_full(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, response_id: str, model: str, conv: list[dict],
                            prompt: TokenizedPrompt, params: SamplingParams, plan: ToolPlan, engine_id: Optional[str] = None) -> dict:
        created = now()
        r = await self.chats.chat_full(chat_req, response_id, model, conv, prompt, params, plan, engine_id)
        choice = r.choices[0]
        msg = choice.message
        output = []
        if msg.reasoning_content:
            output.append(reasoning_item(new_id("rs"), msg.reasoning_content))
        if msg.content or not (output or msg.tool_calls):
            output.append(message_item(new_id("msg"), msg.content or ""))
        for call in msg.tool_calls or []:
            output.append(function_call_item(new_id("fc"), call.id, call.function.name, call.function.arguments))
        status, incomplete = status_of(choice.finish_reason)
        details = r.usage.prompt_tokens_details
        usage = usage_object(r.usage.prompt_tokens, details.cached_tokens if details else 0, r.usage.completion_tokens,
                             reasoning_tokens(choice.token_ids or [], params))
        return response_object(req, response_id, model, created, status, output, usage, incomplete)

    async def response_stream(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, response_id: str, model: str, conv: list[dict],
                              prompt: TokenizedPrompt, params: SamplingParams, plan: ToolPlan,
                              engine_id: Optional[str] = None) -> AsyncIterator[str]:
        created = now()
        seq = 0
        done: list[dict] = []  # finished output items
        cur: Optional[dict] = None  # the item being streamed: {"item": ..., "text": [...]}
        token_ids: list[int] = []
        finish = usage = None

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return sse_event({"type": kind, "sequence_number": seq - 1, **fields})

        def response(status: str, **kw: Any) -> dict:
            return response_object(req, response_id, model, created, status, list(done), **kw)

        def close() -> list[str]:
            """The events that end the current item; it joins ``done``."""
            nonlocal cur
            if cur is None:
                return []
            item, text, index = cur["item"], "".join(cur["text"]), len(done)
            events = []
            if item["type"] == "reasoning":
                item = reasoning_item(item["id"], text)
                events.append(event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text))
            elif item["type"] == "message":
                item = message_item(item["id"], text)
                part = item["content"][0]
                events.append(event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text, logprobs=[]))
                events.append(event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part))
            else:
                item = function_call_item(item["id"], item["call_id"], item["name"], text)
                events.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"], arguments=text))
            events.append(event("response.output_item.done", output_index=index, item=item))
            done.append(item)
            cur = None
            return events

        def open_item(item: dict) -> list[str]:
            nonlocal cur
            events = close()
            cur = {"item": item, "text": []}
            events.append(event("response.output_item.added", output_index=len(done), item=item))
            if item["type"] == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(event("response.content_part.added", item_id=item["id"], output_index=len(done), content_index=0, part=part))
            return events

        def add(kind: str, delta: str) -> str:
            cur["text"].append(delta)
            index = len(done)
            if kind == "reasoning":
                return event("response.reasoning_text.delta", item_id=cur["item"]["id"], output_index=index, content_index=0, delta=delta)
            if kind == "message":
                return event("response.output_text.delta", item_id=cur["item"]["id"], output_index=index, content_index=0, delta=delta, logprobs=[])
            return event("response.function_call_arguments.delta", item_id=cur["item"]["id"], output_index=index, delta=delta)

        yield event("response.created", response=response("in_progress"))
        yield event("response.in_progress", response=response("in_progress"))
        try:
            async with aclosing(self.chats.chat_chunks(chat_req, response_id, model, conv, prompt, params, plan, engine_id)) as chunks:
                async for c in chunks:
                    if not c.choices:  # the usage chunk, last
                        usage = c.usage
                    for ch in c.choices:
                        token_ids += getattr(ch, "token_ids", None) or []
                        d = ch.delta
                        if d.reasoning_content:
                            if cur is None or cur["item"]["type"] != "reasoning":
                                for e in open_item({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}):
                                    yield e
                            yield add("reasoning", d.reasoning_content)
                        if d.content:
                            if cur is None or cur["item"]["type"] != "message":
                                for e in open_item(message_item(new_id("msg"), "", status="in_progress")):
                                    yield e
                            yield add("message", d.content)
                        for tc in d.tool_calls or []:
                            if tc.id is not None:  # a new call
                                for e in open_item(function_call_item(new_id("fc"), tc.id, tc.function.name, "", status="in_progress")):
                                    yield e
                            if tc.function is not None and tc.function.arguments:
                                yield add("function_call", tc.function.arguments)
                        finish = ch.finish_reason or finish
            if cur is None and not done:  # nothing was generated: one empty message, as the whole answer has
                for e in open_item(message_item(new_id("msg"), "", status="in_progress")):
                    yield e
            for e in close():
                yield e
            status, incomplete = status_of(finish)
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            final = response(status, usage=usage_object(usage.prompt_tokens, cached, usage.completion_tokens, reasoning_tokens(token_ids, params)),
                             incomplete=incomplete)
            yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
        except (ValueError, RuntimeError) as e:
            code = "server_error" if isinstance(e, EngineDeadError) or not isinstance(e, ValueError) else "invalid_request_error"
            param = e.param if isinstance(e, RequestError) else None
            yield event("error", code=code, message=str(e), param=param)
            yield event("response.failed", response=response("failed", error={"code": code, "message": str(e)}))
