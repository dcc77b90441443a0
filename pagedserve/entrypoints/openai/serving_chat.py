"""/v1/chat/completions: a conversation rendered with the chat template, to one response or an
SSE stream (the role first, then content and tool-call deltas, as OpenAI sends them). Tools and
tool_choice: see :mod:`pagedserve.entrypoints.openai.tools`."""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from pagedserve.engine.input_processor import RequestError, check_text
from pagedserve.entrypoints.openai.chat_template import TemplateLimitError, render_untrusted
from pagedserve.entrypoints.openai.http_common import APIError
from pagedserve.entrypoints.openai.protocol import AssistantMessage, ChatCompletionRequest, ChatMessage, ToolMessage
from pagedserve.entrypoints.openai.protocol_responses import (
    ChatChoiceLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionResponseStreamChoiceIds,
    ChatCompletionStreamResponse,
    ChatCompletionStreamResponseIds,
    ChatLogProbContent,
    ChatLogProbEntry,
    ChatResponseMessage,
    DeltaMessage,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    UsageInfo,
)
from pagedserve.entrypoints.openai.reasoning import ReasoningStream
from pagedserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    TokenizedPrompt,
    raise_if_failed,
    sse,
    stream_error,
)
from pagedserve.entrypoints.openai.token_strings import finite_logprob, prompt_logprobs_json
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedserve.entrypoints.openai.tools import (
    ToolCallStream,
    ToolPlan,
    check_answers_a_call,
    plan_tools,
    tool_call_for_template,
    tools_template,
)
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import SamplingParams

# apply_chat_template's own arguments: not the template's to take from a request.
_RENDER_ARGS = frozenset(
    {
        "conversation",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "documents",
    }
)


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint."""

    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[str, list[dict], TokenizedPrompt, SamplingParams, ToolPlan]:
        """Validate and render. Raises RequestError (the input processor's) or APIError (what
        needs the tools or the template), naming the field."""
        model, lora = self.check_request(req)
        self.check_num_sequences(1, req.n or 1)
        plan = plan_tools(req.tools, req.tool_choice, self.enable_auto_tool_choice, self.tool_call_parser, req.parallel_tool_calls)
        if plan.constraint is not None and req.constraint_fields():
            raise APIError(f"tool_choice {plan.mode!r} and {req.constraint_fields()[0]} cannot both be set.", param="tool_choice")
        conv, ids = self.render_chat(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template,
            req.chat_template_kwargs,
            req.tools,
            req.add_special_tokens,
        )
        ids = self.input_processor.truncate_prompt(ids, req.truncate_prompt_tokens)
        self.input_processor.check_token_ids(ids)
        field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.input_processor.resolve_max_tokens(self.requested_max_tokens(req.requested_max_tokens), len(ids), field_name, "messages")
        params = self.sampling_params(req, max_tokens)
        if plan.keeps_special_tokens:  # the parser's markers are special tokens ([TOOL_CALLS])
            params.skip_special_tokens = False
        self.check_prompt_logprobs([len(ids)], params)
        if self.reasoning is not None and self.reasoning.thinks(ids, req.chat_template_kwargs):
            params._reasoning_end_token_id = self.reasoning.end_id  # constraints wait for </think>
        if plan.constraint is not None:  # required / named tool choice: the grammar of the calls
            params.structured_outputs = plan.constraint
            try:
                self.input_processor.check_params(params)
            except RequestError as e:
                if e.param not in (None, "structured_outputs"):  # allowed_token_ids, which a tool call's grammar excludes
                    raise
                raise APIError(e.message.replace("structured_outputs.json", "a tool's parameters schema"), param="tools") from None
        return model, conv, TokenizedPrompt(None, ids, lora), params, plan

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: Optional[str] = None,
        chat_template_kwargs: Optional[dict] = None,
        tools: Optional[list] = None,
        add_special_tokens: bool = False,
    ) -> tuple[list[dict], list[int]]:
        """The conversation as the template sees it, and its token ids. ``chat_template_kwargs``
        go to the template and override the named arguments (``add_generation_prompt``, ``tools``,
        ``chat_template``...), as vLLM; the tokenizer's own arguments cannot be set there."""
        if not messages:
            raise APIError("messages must not be empty.", param="messages")
        kwargs = dict(chat_template_kwargs or {})
        bad = sorted(set(kwargs) & _RENDER_ARGS)
        if bad:
            raise APIError(f"chat_template_kwargs.{bad[0]} cannot be set.", param="chat_template_kwargs")
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
        continue_final_message = bool(kwargs.pop("continue_final_message", continue_final_message))
        chat_template = kwargs.pop("chat_template", chat_template)
        tools = kwargs.pop("tools", tools)
        if chat_template is not None and not isinstance(chat_template, str):
            raise APIError("chat_template must be a string.", param="chat_template")
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                "chat_template in the request is not allowed: a template is code that runs in the server. "
                "Start the server with --trust-request-chat-template to allow it.",
                param="chat_template",
            )
        conv = []
        call_ids: set[str] = set()  # of the assistant tool calls so far: each tool message answers one
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(f"messages[{i}].content: only text parts are supported, got type {part.get('type')!r}.", param="messages")
                    parts.append(part["text"])
                content = "\n".join(parts)
            if isinstance(content, str):
                check_text(content, "messages")
            role = "system" if m.role == "developer" else m.role  # as Responses: templates know system
            msg: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
            if m.name:
                msg["name"] = m.name
            if isinstance(m, AssistantMessage) and m.tool_calls:
                msg["tool_calls"] = [tool_call_for_template(c, i) for c in m.tool_calls]
                call_ids.update(c["id"] for c in msg["tool_calls"] if isinstance(c["id"], str))
            if isinstance(m, ToolMessage):
                check_answers_a_call(m.tool_call_id, call_ids, f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id", "assistant tool call")
                msg["tool_call_id"] = m.tool_call_id
            conv.append(msg)
        server_template = self.chat_template
        if tools:
            kwargs["tools"] = tools
        # A history with calls needs a template that shows them, tools given or not.
        model_template = self.tokenizer.chat_template or ""
        if isinstance(model_template, dict):  # named templates: "tool_use" is the one for tools
            model_template = " ".join(model_template.values())
        if (tools or any(m.get("tool_calls") for m in conv)) and server_template is None and "tools" not in model_template:
            server_template = tools_template()  # the model's template would drop the tools and the calls
            parser = TOOL_PARSERS.get(self.tool_call_parser or "")
            kwargs.setdefault("tool_call_format", parser.template_format if parser is not None else "hermes")
        try:
            if chat_template is not None:  # a client's program: sandboxed, with bounds on loops and output
                text = render_untrusted(chat_template, conv, self.tokenizer, add_generation_prompt, continue_final_message, **kwargs)
            else:
                text = self.tokenizer.apply_chat_template(
                    conv,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=server_template,
                    **kwargs,
                )
        except TemplateLimitError as e:
            raise APIError(str(e), param="chat_template") from None
        except Exception as e:  # jinja errors, a template that refuses the roles, ...
            raise APIError(f"messages could not be rendered with the chat template: {e}", param="messages") from None
        if tools:  # a lone surrogate in a tool's description, then in a call of the history
            check_text(json.dumps(tools, ensure_ascii=False), "tools")
        check_text(text, "messages")
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise APIError("messages rendered to an empty prompt.", param="messages")
        return conv, ids

    def _message(self, plan: ToolPlan, text: str, single_call: bool) -> tuple[ChatResponseMessage, bool]:
        """The assistant message of a finished choice, and whether it called tools."""
        if not plan.parses_calls:
            return ChatResponseMessage(role="assistant", content=text), False
        content, calls = plan.calls_from_text(text)
        if single_call:
            calls = calls[:1]
        tool_calls = [ToolCall(id=plan.new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        return ChatResponseMessage(role="assistant", content=content, tool_calls=tool_calls), bool(tool_calls)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int, name) -> ChatChoiceLogProbs:
        """``name``: token id -> the token's name in the answer (``token_name``)."""
        content = []
        for tid, entry in zip(token_ids, logprobs):
            lp = entry.get(tid)
            tops = sorted(((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top_n), key=lambda tv: tv[1].rank)
            content.append(
                ChatLogProbContent(
                    token=name(tid),
                    logprob=finite_logprob(lp.logprob) if lp is not None else -9999.0,
                    bytes=list(self.tokens.bytes(tid)),
                    top_logprobs=[
                        ChatLogProbEntry(token=name(t), logprob=finite_logprob(v.logprob), bytes=list(self.tokens.bytes(t))) for t, v in tops[:top_n]
                    ],
                )
            )
        return ChatChoiceLogProbs(content=content)

    def thinking(self, req: ChatCompletionRequest, prompt: TokenizedPrompt) -> Optional[bool]:
        """Where the answer starts (:meth:`ReasoningParser.thinking`); False without a parser."""
        return False if self.reasoning is None else self.reasoning.thinking(prompt.token_ids, req.chat_template_kwargs)

    @staticmethod
    def _echo_text(req: ChatCompletionRequest, conv: list[dict]) -> str:
        if req.echo and conv and conv[-1].get("role") == "assistant":
            return conv[-1].get("content") or ""
        return ""

    async def chat_full(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        conv: list[dict],
        prompt: TokenizedPrompt,
        params: SamplingParams,
        plan: ToolPlan,
        engine_id: str,
    ) -> ChatCompletionResponse:
        choices = [ChoiceState() for _ in range(params.n)]
        cached = 0
        kv_params = prompt_lps = None
        async with aclosing(
            self.run(engine_id, [prompt], [params], req.cache_salt, self.timeout_of(req), req.kv_transfer_params, req.priority)
        ) as stream:
            async for _, out in stream:
                prompt_lps = out.prompt_logprobs or prompt_lps
                if out.finished:
                    cached = out.num_cached_tokens
                    kv_params = out.kv_transfer_params
                for o in out.outputs:
                    choices[o.index].add(o)
        echo = "" if plan.parses_calls else self._echo_text(req, conv)  # echoed text is not a tool's arguments
        top_n = req.top_logprobs or 0
        thinking = self.thinking(req, prompt)
        result = []
        for i, ch in enumerate(choices):
            reasoning, content = self.reasoning.split("".join(ch.text), thinking) if thinking is not False else (None, "".join(ch.text))
            message, called = self._message(plan, echo + (content or ""), req.parallel_tool_calls is False)
            if content is None and not echo and not message.tool_calls:
                message.content = None  # it only thought (cut by max_tokens), as vLLM
            if req.include_reasoning:
                message.reasoning_content = message.reasoning = reasoning
            called = called and ch.finish_reason == "stop"  # cut by length: the calls may be incomplete
            result.append(
                ChatCompletionResponseChoice(
                    index=i,
                    message=message,
                    logprobs=self._chat_logprobs(ch.token_ids, ch.logprobs, top_n, self.token_name(req)) if req.logprobs else None,
                    finish_reason=plan.calls_finish_reason if called else ch.finish_reason,
                    stop_reason=None if called else ch.stop_reason,
                    token_ids=ch.token_ids if req.return_token_ids else None,
                )
            )
        num_gen = sum(len(ch.token_ids) for ch in choices)
        usage = UsageInfo(
            prompt_tokens=len(prompt.token_ids),
            completion_tokens=num_gen,
            total_tokens=len(prompt.token_ids) + num_gen,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=result,
            usage=usage,
            kv_transfer_params=kv_params,
            prompt_logprobs=prompt_logprobs_json(self.tokens, prompt_lps),
            prompt_token_ids=prompt.token_ids if req.return_token_ids else None,
        )

    async def chat_stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        conv: list[dict],
        prompt: TokenizedPrompt,
        params: SamplingParams,
        plan: ToolPlan,
        engine_id: str,
    ) -> AsyncIterator[str]:
        """The SSE stream of :meth:`chat_chunks`; an error ends it with an error event."""
        try:
            async with aclosing(self.chat_chunks(req, request_id, model, conv, prompt, params, plan, engine_id)) as chunks:
                async for c in chunks:
                    yield sse(c)
        except (APIError, ValueError, RuntimeError) as e:
            yield stream_error(e)
        yield SSE_DONE

    async def chat_chunks(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        model: str,
        conv: list[dict],
        prompt: TokenizedPrompt,
        params: SamplingParams,
        plan: ToolPlan,
        engine_id: str,
    ) -> AsyncIterator[Any]:
        """The chunks of a streamed answer (``ChatCompletionStreamResponse``, or its ``Ids``
        variant), the role first, the usage last when asked. Raises APIError / ValueError /
        RuntimeError (:func:`api_error` maps them) when the request fails after it started."""
        choices = [ChoiceState() for _ in range(params.n)]
        streams = [ToolCallStream(plan, single_call=req.parallel_tool_calls is False) for _ in range(params.n)]
        thinking = [ReasoningStream(self.thinking(req, prompt)) for _ in range(params.n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        num_prompt = len(prompt.token_ids)
        top_n = req.top_logprobs or 0
        echo = "" if plan.parses_calls else self._echo_text(req, conv)
        created = int(time.time())
        cached = 0

        def chunk(prompt_token_ids: Optional[list[int]] = None, token_ids: Optional[list[int]] = None, **fields) -> str:
            """One choice's chunk; with return_token_ids it carries the ids (the prompt's: once)."""
            if req.return_token_ids:
                c = ChatCompletionStreamResponseIds(
                    id=request_id,
                    model=model,
                    created=created,
                    prompt_token_ids=prompt_token_ids,
                    choices=[ChatCompletionResponseStreamChoiceIds(**fields, token_ids=token_ids or [])],
                )
            else:
                c = ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[ChatCompletionResponseStreamChoice(**fields)])
            if continuous:  # this choice's tokens so far, as vLLM counts them
                gen = choices[fields["index"]].num_tokens
                c.usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=gen, total_tokens=num_prompt + gen)
            return c

        for i in range(params.n):  # the role comes first, as OpenAI sends it (and the prompt's ids, vLLM's return_token_ids)
            yield chunk(prompt.token_ids if i == 0 else None, index=i, delta=DeltaMessage(role="assistant", content=""))
        if echo:
            for i in range(params.n):
                yield chunk(index=i, delta=DeltaMessage(content=echo))
        async with aclosing(
            self.run(engine_id, [prompt], [params], req.cache_salt, self.timeout_of(req), req.kv_transfer_params, req.priority)
        ) as stream:
            async for _, out in stream:
                cached = out.num_cached_tokens
                for o in out.outputs:
                    ch = choices[o.index]
                    if ch.finish_reason is not None:
                        continue
                    ch.num_tokens += len(o.token_ids)
                    raise_if_failed(o)
                    ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
                    if not o.text and o.finish_reason is None and not o.token_ids:
                        continue
                    lps = self._chat_logprobs(o.token_ids, o.logprobs or [], top_n, self.token_name(req)) if req.logprobs else None
                    tools = streams[o.index]
                    reasoning, content = thinking[o.index].feed(o.text)
                    if o.finish_reason is not None:
                        held = thinking[o.index].finish()
                        reasoning, content = reasoning + held[0], content + held[1]
                    deltas = tools.feed(content) + (tools.finish() if o.finish_reason is not None else [])
                    if reasoning and req.include_reasoning:
                        deltas.insert(0, DeltaMessage(reasoning_content=reasoning, reasoning=reasoning))
                    if not deltas and (lps is not None or o.finish_reason is not None or (req.return_token_ids and o.token_ids)):
                        deltas = [DeltaMessage() if o.finish_reason is not None else DeltaMessage(content="")]
                    for k, delta in enumerate(deltas):
                        last = k == len(deltas) - 1
                        called = tools.called and o.finish_reason == "stop"
                        finish = (plan.calls_finish_reason if called else o.finish_reason) if last else None
                        yield chunk(
                            token_ids=list(o.token_ids) if k == 0 else None,
                            index=o.index,
                            delta=delta,
                            logprobs=lps if k == 0 else None,
                            finish_reason=finish,
                            stop_reason=(None if called else o.stop_reason) if last else None,
                        )
        if include_usage:
            gen = sum(x.num_tokens for x in choices)
            yield ChatCompletionStreamResponse(
                id=request_id,
                model=model,
                created=created,
                choices=[],
                usage=UsageInfo(
                    prompt_tokens=num_prompt,
                    completion_tokens=gen,
                    total_tokens=num_prompt + gen,
                    prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                ),
            )
