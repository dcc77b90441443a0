"""/v1/completions: prompts (text, token ids, or lists of them) to one response or an SSE stream."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator, Optional

from pagedserve.entrypoints.openai.http_common import APIError
from pagedserve.entrypoints.openai.protocol import CompletionRequest
from pagedserve.entrypoints.openai.protocol_responses import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionResponseStreamChoiceIds,
    CompletionStreamResponse,
    CompletionStreamResponseIds,
    PromptTokensDetails,
    UsageInfo,
)
from pagedserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    TokenizedPrompt,
    raise_if_failed,
    sse,
    stream_error,
)
from pagedserve.entrypoints.openai.token_strings import TokenPieces, finite_logprob, prompt_logprobs_json
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint."""

    def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[TokenizedPrompt], list[SamplingParams]]:
        """Validate and tokenize. Raises RequestError (the input processor's) or APIError (the
        front's), naming the field."""
        model, lora = self.check_request(req)
        if isinstance(req.prompt, list) and req.prompt and not all(isinstance(p, int) for p in req.prompt):
            self.check_num_sequences(len(req.prompt), req.n or 1)
        else:
            self.check_num_sequences(1, req.n or 1)
        prompts = self.tokenized_prompts(req.prompt, req.add_special_tokens)
        if req.truncate_prompt_tokens is not None:  # the last k tokens (the text is then theirs, for echo)
            cut = [self.input_processor.truncate_prompt(p.token_ids, req.truncate_prompt_tokens) for p in prompts]
            prompts = [p if len(c) == len(p.token_ids) else TokenizedPrompt(None, c) for p, c in zip(prompts, cut)]
        for p in prompts:
            p.lora = lora  # the adapter ``model`` names, or None
        resolve = self.input_processor.resolve_max_tokens
        requested = 1 if req.echo_only else self.requested_max_tokens(req.max_tokens)  # echo_only drops its one token
        params = [self.sampling_params(req, resolve(requested, len(p.token_ids), "max_tokens")) for p in prompts]
        self.check_prompt_logprobs([len(p.token_ids) for p in prompts], params[0])
        self.input_processor.check_ban_budget(params[0], len(prompts))
        return model, prompts, params

    @staticmethod
    def kv_params_of(req: CompletionRequest, prompts: list[TokenizedPrompt]):
        """The request's kv_transfer_params; a prefill of several prompts holds nothing (one
        ``kv_transfer_params`` in the answer cannot name several holds), so the decode side
        computes them itself."""
        params = req.kv_transfer_params
        if len(prompts) > 1 and isinstance(params, dict) and params.get("do_remote_decode") is True:
            return None
        return params

    def tokenized_prompts(self, prompt, add_special_tokens: bool = True) -> list[TokenizedPrompt]:
        """A text, a list of ids, or a list of either, as checked token ids (texts with the
        tokenizer's special tokens unless ``add_special_tokens`` is false)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if all(isinstance(p, int) for p in prompt):  # [] too: the input processor refuses it empty
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:  # the schema's minLength 1 (with a BOS it would tokenize to something)
                    raise APIError("prompt must not be empty.", param="prompt")
                out.append(TokenizedPrompt(p, self.input_processor.tokenize(p, add_special_tokens, "prompt")))
            else:
                out.append(TokenizedPrompt(None, list(p)))
            self.input_processor.check_token_ids(out[-1].token_ids)
        return out

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[Optional[dict[int, Logprob]]], pieces: list[str], ch: ChoiceState, req: CompletionRequest
    ) -> CompletionLogProbs:
        """OpenAI's legacy logprobs of ``token_ids``, each token named by its piece of the text
        (:class:`TokenPieces`: they join to the text, ``text_offset`` indexes it) or with
        ``return_tokens_as_token_ids`` by id; top_logprobs name the others by their own text.
        An entry None (an echoed prompt's first token) has a null logprob and top_logprobs."""
        out = CompletionLogProbs()
        name = self.token_name(req)
        for tid, entry, piece in zip(token_ids, logprobs, pieces):
            tok = name(tid) if req.return_tokens_as_token_ids else piece
            lp = entry.get(tid) if entry is not None else None
            out.tokens.append(tok)
            out.token_logprobs.append(finite_logprob(lp.logprob) if lp is not None else None)
            out.top_logprobs.append(
                {(tok if t == tid else name(t)): finite_logprob(v.logprob) for t, v in entry.items()} if entry is not None else None
            )
            out.text_offset.append(ch.text_offset)
            ch.text_offset += len(piece)
        return out

    async def completion_full(
        self, req: CompletionRequest, request_id: str, model: str, prompts: list[TokenizedPrompt], params: list[SamplingParams], engine_id: str
    ) -> CompletionResponse:
        n = params[0].n
        choices = [ChoiceState() for _ in range(len(prompts) * n)]
        cached = 0
        kv_params = None
        prompt_lps: list = [None] * len(prompts)
        async with aclosing(
            self.run(engine_id, prompts, params, req.cache_salt, self.timeout_of(req), self.kv_params_of(req, prompts), req.priority)
        ) as stream:
            async for pi, out in stream:
                cached = cached + out.num_cached_tokens if out.finished else cached
                kv_params = out.kv_transfer_params or kv_params
                prompt_lps[pi] = out.prompt_logprobs or prompt_lps[pi]
                for o in out.outputs:
                    choices[pi * n + o.index].add(o)
        result = []
        for idx, ch in enumerate(choices):
            pi = idx // n
            if req.echo_only and ch.finish_reason not in ("timeout", "error"):  # its one token is dropped
                ch.text, ch.token_ids, ch.logprobs, ch.finish_reason, ch.stop_reason = [], [], [], "length", None
            text, lps, p = "".join(ch.text), None, prompts[pi]
            pieces = TokenPieces(self.tokenizer, p.token_ids, params[pi]).feed(ch.token_ids, text, True) if req.logprobs is not None else []
            if req.echo:
                echoed = p.text if p.text is not None else self.tokenizer.decode(p.token_ids)
                text = echoed + text
                if req.logprobs is not None:  # null entries where the prompt was never scored (timed out first)
                    plp = prompt_lps[pi] or [None] * len(p.token_ids)
                    pieces = TokenPieces.of_prompt(self.tokenizer, p.token_ids, echoed) + pieces
                    lps = self._completion_logprobs(p.token_ids + ch.token_ids, plp + ch.logprobs, pieces, ch, req)
            elif req.logprobs is not None:
                lps = self._completion_logprobs(ch.token_ids, ch.logprobs, pieces, ch, req)
            result.append(
                CompletionResponseChoice(
                    index=idx,
                    text=text,
                    logprobs=lps,
                    finish_reason=ch.finish_reason,
                    stop_reason=ch.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(self.tokens, prompt_lps[pi]),
                    prompt_token_ids=prompts[pi].token_ids if req.return_token_ids else None,
                    token_ids=ch.token_ids if req.return_token_ids else None,
                )
            )
        num_prompt = sum(len(p.token_ids) for p in prompts)
        num_gen = sum(len(ch.token_ids) for ch in choices)
        usage = UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_gen,
            total_tokens=num_prompt + num_gen,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        return CompletionResponse(id=request_id, model=model, choices=result, usage=usage, kv_transfer_params=kv_params)

    async def completion_stream(
        self, req: CompletionRequest, request_id: str, model: str, prompts: list[TokenizedPrompt], params: list[SamplingParams], engine_id: str
    ) -> AsyncIterator[str]:
        n = params[0].n
        choices = [ChoiceState() for _ in range(len(prompts) * n)]
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        created = int(time.time())
        cached = 0
        prompt_lps: list = [None] * len(prompts)
        pieces = (
            [TokenPieces(self.tokenizer, prompts[i // n].token_ids, params[i // n]) for i in range(len(choices))] if req.logprobs is not None else []
        )
        try:
            async with aclosing(
                self.run(engine_id, prompts, params, req.cache_salt, self.timeout_of(req), self.kv_params_of(req, prompts), req.priority)
            ) as stream:
                async for pi, out in stream:
                    cached = cached + out.num_cached_tokens if out.finished else cached
                    prompt_lps[pi] = out.prompt_logprobs or prompt_lps[pi]  # with the first tokens of any choice
                    for o in out.outputs:
                        idx = pi * n + o.index
                        ch = choices[idx]
                        if ch.finish_reason is not None:
                            continue
                        token_ids, entries = ([], []) if req.echo_only else (o.token_ids, o.logprobs or [])
                        new_ids, first_chunk = list(token_ids), not ch.started
                        text = "" if req.echo_only else o.text
                        texts = pieces[idx].feed(token_ids, text, o.finish_reason is not None) if req.logprobs is not None else []
                        if not ch.started:
                            ch.started = True
                            if req.echo:  # the prompt, and its logprobs, before the first tokens
                                p = prompts[pi]
                                echoed = p.text if p.text is not None else self.tokenizer.decode(p.token_ids)
                                text = echoed + text
                                token_ids, entries = p.token_ids + token_ids, (prompt_lps[pi] or [None] * len(p.token_ids)) + entries
                                if req.logprobs is not None:
                                    texts = TokenPieces.of_prompt(self.tokenizer, p.token_ids, echoed) + texts
                        ch.num_tokens += 0 if req.echo_only else len(o.token_ids)
                        raise_if_failed(o)
                        ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
                        if req.echo_only and o.finish_reason not in (None, "timeout", "error"):
                            ch.finish_reason, ch.stop_reason = "length", None
                        if not text and o.finish_reason is None and not token_ids:
                            continue
                        lps = self._completion_logprobs(token_ids, entries, texts, ch, req) if req.logprobs is not None else None
                        fields = dict(index=idx, text=text, logprobs=lps, finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)
                        if req.return_token_ids:
                            choice = CompletionResponseStreamChoiceIds(
                                **fields, token_ids=new_ids, prompt_token_ids=prompts[pi].token_ids if first_chunk else None
                            )
                            chunk = CompletionStreamResponseIds(id=request_id, model=model, created=created, choices=[choice])
                        else:
                            chunk = CompletionStreamResponse(
                                id=request_id, model=model, created=created, choices=[CompletionResponseStreamChoice(**fields)]
                            )
                        if continuous:  # this choice's prompt and tokens so far, as vLLM counts them
                            pt = len(prompts[pi].token_ids)
                            chunk.usage = UsageInfo(prompt_tokens=pt, completion_tokens=ch.num_tokens, total_tokens=pt + ch.num_tokens)
                        yield sse(chunk)
            if include_usage:
                gen = sum(c.num_tokens for c in choices)
                yield sse(
                    CompletionStreamResponse(
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
                )
        except (APIError, ValueError, RuntimeError) as e:  # refused late or engine died: report in-band
            yield stream_error(e)
        yield SSE_DONE
