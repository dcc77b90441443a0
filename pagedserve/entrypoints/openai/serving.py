"""The work behind /v1/completions and /v1/chat/completions: validate and tokenize the
request, hand it to :class:`AsyncLLM` with ``RequestOutputKind.DELTA``, and turn the deltas
into one response or a stream of SSE chunks.

Every request is checked here before anything reaches the engine (model name, prompt length,
``prompt + max_tokens <= max_model_len``, token ids inside the vocabulary, sampling ranges), so
a bad request is answered with HTTP 400 and leaves the engine untouched.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, AsyncIterator, Optional, Union

from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.entrypoints.openai.protocol import (
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProbContent,
    ChatLogProbEntry,
    ChatMessage,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
)

logger = logging.getLogger("pagedserve")


class RequestError(ValueError):
    """A request the server refuses; becomes an OpenAI error body with this status."""

    def __init__(self, message: str, param: Optional[str] = None, status_code: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type


_KNOWN_PARAMS = {
    "prompt", "prompt_token_ids", "messages", "model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "max_tokens", "max_completion_tokens", "min_tokens", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "best_of",
    "stream_options", "response_format", "request_id", "tokens", "continue_final_message",
}


def param_of(message: str) -> Optional[str]:
    """The request field an engine/SamplingParams ValueError names (its first word), if any."""
    m = re.match(r"[`'\"]?([A-Za-z_]+)", message)
    if m and m.group(1) in _KNOWN_PARAMS:
        return "prompt" if m.group(1) == "prompt_token_ids" else m.group(1)
    return None


def error_body(message: str, status_code: int = 400, err_type: str = "BadRequestError", param: Optional[str] = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status_code)).model_dump()


def _finite(x: float) -> float:
    return max(x, -9999.0) if x == x else -9999.0  # -inf / NaN are not JSON


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-unicode table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenStrings:
    """Per-token text and UTF-8 bytes for logprobs, cached by token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        raw = self._bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> bytes:
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if raw is None:
            return b""
        m = _BYTE_FALLBACK.match(raw)
        if m:
            return bytes([int(m.group(1), 16)])
        if raw and all(c in _BYTE_DECODER for c in raw) and not (raw.startswith("<") and raw.endswith(">")):
            return bytes(_BYTE_DECODER[c] for c in raw)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(i, item)`` from several async iterators as items arrive. Closing (or cancelling)
    the merged iterator cancels every source, so each aborts its request."""
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as it:  # type: ignore[type-var]
            async for item in it:
                yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending.keys(), return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()  # the source's finally runs in that task and aborts its request


@dataclass
class _Choice:
    """Accumulated state of one choice (prompt i, completion j)."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    text_offset: int = 0
    started: bool = False

    def add(self, o: CompletionOutput) -> None:
        """Fold in one delta output of this choice (ignored once the choice has finished)."""
        if self.finish_reason is not None:
            return
        self.text.append(o.text)
        self.token_ids.extend(o.token_ids)
        if o.logprobs:
            self.logprobs.extend(o.logprobs)
        self.finish_reason, self.stop_reason = o.finish_reason, o.stop_reason


def check_text(text: str, param: str) -> None:
    """Reject strings that are not valid Unicode text (e.g. a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{param} is not valid UTF-8 text (it contains a lone surrogate).", param=param) from None


@dataclass
class _Prompt:
    text: Optional[str]
    token_ids: list[int]


def sse(obj: Any) -> str:
    if hasattr(obj, "model_dump_json"):
        data = obj.model_dump_json(exclude={"usage"} if getattr(obj, "usage", 1) is None else None)
    else:
        data = json.dumps(obj)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """Completions and chat completions over one :class:`AsyncLLM`."""

    # Most sequences (prompts x n) one HTTP request may start: a single request must not be
    # able to queue unbounded work or memory.
    MAX_SEQUENCES_PER_REQUEST = 256

    def __init__(self, llm: AsyncLLM, served_model_names: list[str], trust_request_chat_template: bool = False) -> None:
        self.llm = llm
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = llm.tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.vocab_size
        self.tokens = TokenStrings(self.tokenizer)

    # -- validation ------------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> str:
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        raise RequestError(f"The model `{model}` does not exist. Served: {', '.join(self.served_model_names)}.", param="model")

    def _check_ids(self, ids: list[int], what: str = "prompt") -> None:
        if not ids:
            raise RequestError(f"{what} must not be empty.", param="prompt" if what == "prompt" else what)
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise RequestError(f"{what} contains token id {t} outside the vocabulary [0, {self.vocab_size}).", param="prompt" if what == "prompt" else what)

    def _max_tokens(self, requested: Optional[int], prompt_len: int, field_name: str, prompt_field: str = "prompt") -> int:
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"{prompt_field} is {prompt_len} tokens, which leaves no room to generate within max_model_len={self.max_model_len}. "
                f"Please shorten the {prompt_field}.", param=prompt_field,
            )
        if requested is None:
            return self.max_model_len - prompt_len
        if requested < 1:
            raise RequestError(f"{field_name} must be at least 1, got {requested}.", param=field_name)
        if prompt_len + requested > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in {field_name}). "
                f"Please reduce the length of the prompt or {field_name}.",
                param=field_name,
            )
        return requested

    def _params(self, req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int) -> SamplingParams:
        try:
            params = req.to_sampling_params(max_tokens)
            params.verify_vocab(self.vocab_size)
        except RequestError:
            raise
        except ValueError as e:
            raise RequestError(str(e), param=param_of(str(e))) from None
        return params

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        check_text(text, param)
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _check_num_sequences(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.MAX_SEQUENCES_PER_REQUEST:
            raise RequestError(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
                f"at most {self.MAX_SEQUENCES_PER_REQUEST} are allowed per request.", param="n",
            )

    def _prompts(self, prompt: Any) -> list[_Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt must not be empty.", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise RequestError("prompt must not be empty.", param="prompt")
                ids = self._encode(p, True, "prompt")
                out.append(_Prompt(p, ids))
            else:
                ids = list(p)
                self._check_ids(ids)
                out.append(_Prompt(None, ids))
            self._check_ids(out[-1].token_ids)
        return out

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template: Optional[str] = None, chat_template_kwargs: Optional[dict] = None,
                    tools: Optional[list] = None) -> tuple[list[dict], list[int]]:
        if not messages:
            raise RequestError("messages must not be empty.", param="messages")
        if chat_template is not None and not self.trust_request_chat_template:
            raise RequestError(
                "chat_template in the request is not allowed: a template is code that runs in the server. "
                "Start the server with --trust-request-chat-template to allow it.", param="chat_template",
            )
        conv = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise RequestError(f"messages[{i}].content: only text parts are supported, got type {part.get('type')!r}.", param="messages")
                    parts.append(part["text"])
                content = "\n".join(parts)
            if isinstance(content, str):
                check_text(content, "messages")
            msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
            if m.name:
                msg["name"] = m.name
            conv.append(msg)
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template, **kwargs,
            )
        except Exception as e:  # jinja errors, a template that refuses the roles, ...
            raise RequestError(f"messages could not be rendered with the chat template: {e}", param="messages") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise RequestError("messages rendered to an empty prompt.", param="messages")
        return conv, ids

    # -- completions ---------------------------------------------------------------------------
    def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[_Prompt], list[SamplingParams]]:
        model = self.check_model(req.model)
        if isinstance(req.prompt, list) and req.prompt and not all(isinstance(p, int) for p in req.prompt):
            self._check_num_sequences(len(req.prompt), req.n or 1)
        else:
            self._check_num_sequences(1, req.n or 1)
        prompts = self._prompts(req.prompt)
        params = [self._params(req, self._max_tokens(req.max_tokens, len(p.token_ids), "max_tokens")) for p in prompts]
        return model, prompts, params

    async def _run(self, request_id: str, prompts: list[_Prompt], params: list[SamplingParams], cache_salt: Optional[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per prompt; yield ``(prompt index, delta output)``. However this
        ends (finished, client gone, cancelled, error), no request is left running."""
        rids = [f"{request_id}-{i}" if len(prompts) > 1 else request_id for i in range(len(prompts))]
        gens = [
            self.llm.generate({"prompt": p.text, "prompt_token_ids": p.token_ids}, sp, rid, cache_salt)
            for rid, p, sp in zip(rids, prompts, params)
        ]
        unfinished = set(rids)
        try:
            async with aclosing(merge_async_iterators(*gens)) as merged:
                async for pi, out in merged:
                    if out.finished:
                        unfinished.discard(rids[pi])
                    yield pi, out
        finally:
            for rid in unfinished:
                self.llm.abort(rid)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], ch: _Choice) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for tid, entry in zip(token_ids, logprobs):
            tok = self.tokens.text(tid)
            lp = entry.get(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(_finite(lp.logprob) if lp is not None else None)
            out.top_logprobs.append({self.tokens.text(t): _finite(v.logprob) for t, v in entry.items()})
            out.text_offset.append(ch.text_offset)
            ch.text_offset += len(tok)
        return out

    async def completion_full(self, req: CompletionRequest, request_id: str, model: str, prompts: list[_Prompt], params: list[SamplingParams]) -> CompletionResponse:
        n = params[0].n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        cached = 0
        async with aclosing(self._run(request_id, prompts, params, req.cache_salt)) as stream:
            async for pi, out in stream:
                cached = cached + out.num_cached_tokens if out.finished else cached
                for o in out.outputs:
                    choices[pi * n + o.index].add(o)
        result = []
        for idx, ch in enumerate(choices):
            p = prompts[idx // n]
            prefix = ""
            if req.echo:
                prefix = p.text if p.text is not None else self.tokenizer.decode(p.token_ids)
            ch.text_offset = len(prefix)
            lps = self._completion_logprobs(ch.token_ids, ch.logprobs, ch) if req.logprobs is not None else None
            result.append(CompletionResponseChoice(index=idx, text=prefix + "".join(ch.text), logprobs=lps, finish_reason=ch.finish_reason, stop_reason=ch.stop_reason))
        num_prompt = sum(len(p.token_ids) for p in prompts)
        num_gen = sum(len(ch.token_ids) for ch in choices)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen, total_tokens=num_prompt + num_gen,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        return CompletionResponse(id=request_id, model=model, choices=result, usage=usage)

    async def completion_stream(self, req: CompletionRequest, request_id: str, model: str, prompts: list[_Prompt], params: list[SamplingParams]) -> AsyncIterator[str]:
        n = params[0].n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        created = int(time.time())
        try:
            async with aclosing(self._run(request_id, prompts, params, req.cache_salt)) as stream:
                async for pi, out in stream:
                    for o in out.outputs:
                        idx = pi * n + o.index
                        ch = choices[idx]
                        if ch.finish_reason is not None:
                            continue
                        text = o.text
                        if not ch.started:
                            ch.started = True
                            if req.echo:
                                p = prompts[pi]
                                prefix = p.text if p.text is not None else self.tokenizer.decode(p.token_ids)
                                text = prefix + text
                                ch.text_offset = len(prefix)
                        ch.num_tokens += len(o.token_ids)
                        ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
                        if not text and o.finish_reason is None and not o.token_ids:
                            continue
                        lps = self._completion_logprobs(o.token_ids, o.logprobs or [], ch) if req.logprobs is not None else None
                        chunk = CompletionStreamResponse(
                            id=request_id, model=model, created=created,
                            choices=[CompletionResponseStreamChoice(index=idx, text=text, logprobs=lps, finish_reason=o.finish_reason, stop_reason=o.stop_reason)],
                        )
                        if continuous:
                            gen = sum(c.num_tokens for c in choices)
                            chunk.usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=gen, total_tokens=num_prompt + gen)
                        yield sse(chunk)
            if include_usage:
                gen = sum(c.num_tokens for c in choices)
                yield sse(CompletionStreamResponse(id=request_id, model=model, created=created, choices=[], usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=gen, total_tokens=num_prompt + gen)))
        except (ValueError, RuntimeError) as e:  # refused late or engine died: report in-band
            status = 400 if isinstance(e, ValueError) else 500
            yield sse(error_body(str(e), status, "BadRequestError" if status == 400 else "InternalServerError", param_of(str(e))))
        yield SSE_DONE

    # -- chat ----------------------------------------------------------------------------------
    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[str, list[dict], _Prompt, SamplingParams]:
        model = self.check_model(req.model)
        self._check_num_sequences(1, req.n or 1)
        conv, ids = self.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template, req.chat_template_kwargs, req.tools)
        self._check_ids(ids)
        field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self._params(req, self._max_tokens(req.requested_max_tokens, len(ids), field_name, "messages"))
        return model, conv, _Prompt(None, ids), params

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> ChatChoiceLogProbs:
        content = []
        for tid, entry in zip(token_ids, logprobs):
            lp = entry.get(tid)
            tops = sorted(((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top_n), key=lambda tv: tv[1].rank)
            content.append(
                ChatLogProbContent(
                    token=self.tokens.text(tid), logprob=_finite(lp.logprob) if lp is not None else -9999.0, bytes=list(self.tokens.bytes(tid)),
                    top_logprobs=[ChatLogProbEntry(token=self.tokens.text(t), logprob=_finite(v.logprob), bytes=list(self.tokens.bytes(t))) for t, v in tops[:top_n]],
                )
            )
        return ChatChoiceLogProbs(content=content)

    @staticmethod
    def _echo_text(req: ChatCompletionRequest, conv: list[dict]) -> str:
        if req.echo and conv and conv[-1].get("role") == "assistant":
            return conv[-1].get("content") or ""
        return ""

    async def chat_full(self, req: ChatCompletionRequest, request_id: str, model: str, conv: list[dict], prompt: _Prompt, params: SamplingParams) -> ChatCompletionResponse:
        choices = [_Choice() for _ in range(params.n)]
        cached = 0
        async with aclosing(self._run(request_id, [prompt], [params], req.cache_salt)) as stream:
            async for _, out in stream:
                if out.finished:
                    cached = out.num_cached_tokens
                for o in out.outputs:
                    choices[o.index].add(o)
        echo = self._echo_text(req, conv)
        top_n = req.top_logprobs or 0
        result = [
            ChatCompletionResponseChoice(
                index=i,
                message=ChatResponseMessage(role="assistant", content=echo + "".join(ch.text)),
                logprobs=self._chat_logprobs(ch.token_ids, ch.logprobs, top_n) if req.logprobs else None,
                finish_reason=ch.finish_reason, stop_reason=ch.stop_reason,
            )
            for i, ch in enumerate(choices)
        ]
        num_gen = sum(len(ch.token_ids) for ch in choices)
        usage = UsageInfo(prompt_tokens=len(prompt.token_ids), completion_tokens=num_gen, total_tokens=len(prompt.token_ids) + num_gen,
                          prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
        return ChatCompletionResponse(id=request_id, model=model, choices=result, usage=usage)

    async def chat_stream(self, req: ChatCompletionRequest, request_id: str, model: str, conv: list[dict], prompt: _Prompt, params: SamplingParams) -> AsyncIterator[str]:
        choices = [_Choice() for _ in range(params.n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        num_prompt = len(prompt.token_ids)
        top_n = req.top_logprobs or 0
        echo = self._echo_text(req, conv)
        created = int(time.time())

        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            c = ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[choice])
            if continuous:
                gen = sum(x.num_tokens for x in choices)
                c.usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=gen, total_tokens=num_prompt + gen)
            return sse(c)

        try:
            for i in range(params.n):  # the role comes first, as OpenAI sends it
                yield chunk(ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None))
            if echo:
                for i in range(params.n):
                    yield chunk(ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=echo)))
            async with aclosing(self._run(request_id, [prompt], [params], req.cache_salt)) as stream:
                async for _, out in stream:
                    for o in out.outputs:
                        ch = choices[o.index]
                        if ch.finish_reason is not None:
                            continue
                        ch.num_tokens += len(o.token_ids)
                        ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
                        if not o.text and o.finish_reason is None and not o.token_ids:
                            continue
                        lps = self._chat_logprobs(o.token_ids, o.logprobs or [], top_n) if req.logprobs else None
                        yield chunk(ChatCompletionResponseStreamChoice(
                            index=o.index, delta=DeltaMessage(content=o.text) if (o.text or o.finish_reason is None) else DeltaMessage(),
                            logprobs=lps, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                        ))
            if include_usage:
                gen = sum(x.num_tokens for x in choices)
                yield sse(ChatCompletionStreamResponse(id=request_id, model=model, created=created, choices=[], usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=gen, total_tokens=num_prompt + gen)))
        except (ValueError, RuntimeError) as e:
            status = 400 if isinstance(e, ValueError) else 500
            yield sse(error_body(str(e), status, "BadRequestError" if status == 400 else "InternalServerError", param_of(str(e))))
        yield SSE_DONE
