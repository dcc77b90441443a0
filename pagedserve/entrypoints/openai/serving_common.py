"""What /v1/completions and /v1/chat/completions share: the model check, sampling parameters,
chat rendering, running one engine request per prompt with ``RequestOutputKind.DELTA``, the
server's side of prefill/decode disaggregation (``kv_transfer_params``), and the SSE / logprob
helpers.

Validation and tokenization are the :class:`InputProcessor`'s (the engine's one place for
them), whose :class:`RequestError` names the field; what only the front can check (unknown
fields, the served model, the deadline, ``kv_transfer_params``, per-response caps) raises the
front's :class:`APIError`. Either way a bad request never reaches the engine core.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from pagedserve.distributed.kv_transfer import params as kvp
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.input_processor import RequestError
from pagedserve.entrypoints.openai.http_common import (
    APIError,
    api_error,
    error_body,  # noqa: F401 (the PD proxy takes it from here)
    prompt_request_ids,
)
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.reasoning import ReasoningParser
from pagedserve.entrypoints.openai.token_strings import TokenStrings
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import MAX_N, SamplingParams

logger = logging.getLogger("pagedserve")

LoRAEntry = tuple[LoRARequest, str]  # a registered adapter and the digest of its files


def stream_error(e: Exception) -> str:
    """An SSE event with the error body of a request that failed after its stream started, as
    :func:`api_error` maps it (a refusal 4xx / 503, an engine that died 503, a bug 500)."""
    return sse(api_error(e).body())


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
class ChoiceState:
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
        """Fold in one delta output of this choice (ignored once the choice has finished).

        Raises:
            APIError: the choice failed (its grammar could not be followed).
        """
        if self.finish_reason is not None:
            return
        raise_if_failed(o)
        self.text.append(o.text)
        self.token_ids.extend(o.token_ids)
        if o.logprobs:
            self.logprobs.extend(o.logprobs)
        self.finish_reason, self.stop_reason = o.finish_reason, o.stop_reason


def raise_if_failed(o: CompletionOutput) -> None:
    """A sequence that finished with "error" fails the whole request, as a 400: it was the
    request's constraint that could not be followed (the engine is fine)."""
    if o.finish_reason == "error":
        if str(o.stop_reason).startswith("KV transfer"):  # kv_load_failure_policy "fail": not the client's fault
            raise APIError(f"{o.stop_reason}; retry the request.", status_code=503, err_type="ServiceUnavailableError")
        raise APIError(f"{o.stop_reason}. Simplify the schema, regex or grammar.", param=None)


@dataclass
class TokenizedPrompt:
    """A prompt as the engine runs it: its text (when the client sent text), its token ids, and
    the LoRA adapter the request named (``(LoRARequest, digest)`` as ``AsyncLLM.loras`` holds
    it; None: the base model)."""

    text: Optional[str]
    token_ids: list[int]
    lora: Optional[LoRAEntry] = None


def sse(obj: Any) -> str:
    if hasattr(obj, "model_dump_json"):
        data = obj.model_dump_json(exclude={"usage"} if getattr(obj, "usage", 1) is None else None)
    else:
        data = json.dumps(obj)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# Fields of OpenAI's or vLLM's API that would change what a request means and that this server
# does not implement: refused with a 400 naming them (unless set to their "off" value).
UNSUPPORTED_FIELDS = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "functions": (None,),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "guided_whitespace_pattern": (None,),
    "logits_processors": (None,),
    "vllm_xargs": (None,),
    "prompt_embeds": (None,),
    "mm_processor_kwargs": (None,),
}
_ignored_logged: set[str] = set()
MAX_TIMEOUT_S = 86400.0


def check_extra_fields(req: Any) -> None:
    """Refuse a field from ``UNSUPPORTED_FIELDS``; any other unknown field is ignored, as vLLM
    does, and logged once per field name so the operator sees it.

    Raises:
        APIError: naming the unsupported field.
    """
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED_FIELDS:
            if value not in UNSUPPORTED_FIELDS[name]:
                raise APIError(f"{name} is not supported by this server.", param=name)
        else:
            log_ignored(name)


def log_ignored(name: str) -> None:
    """Log once per field name that a request field is ignored."""
    if name not in _ignored_logged:
        _ignored_logged.add(name)
        logger.warning("request field %r is not used by this server and is ignored (logged once)", name)


class OpenAIServing:
    """The model check, parameters, chat rendering and engine requests of one server."""

    # Most sequences (prompts x n) one HTTP request may start: a single request must not be
    # able to queue unbounded work or memory.
    MAX_SEQUENCES_PER_REQUEST = 256

    def __init__(
        self,
        llm: AsyncLLM,
        served_model_names: list[str],
        trust_request_chat_template: bool = False,
        chat_template: Optional[str] = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: Optional[str] = None,
        default_sampling: Optional[dict[str, Any]] = None,
        log_requests: bool = False,
        request_timeout: Optional[float] = None,
        reasoning_parser: Optional[str] = None,
    ) -> None:
        self.llm = llm
        self.input_processor = llm.input_processor
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = llm.tokenizer
        self.served_model_names = served_model_names
        self.tokens = TokenStrings(self.tokenizer)
        self.chat_template = chat_template  # the server's --chat-template (text), else the model's
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.reasoning = ReasoningParser.load(reasoning_parser, self.tokenizer) if reasoning_parser else None
        self.default_sampling = dict(default_sampling or {})
        self.log_requests = log_requests
        self.request_timeout = request_timeout

    def check_request(self, req: Any) -> tuple[str, Optional[LoRAEntry]]:
        """The model check, the unknown-field check and the deadline of a request; the name to
        report and the LoRA adapter ``model`` names (None: a base model name). A pooling engine
        (``--runner pooling``) refuses every generating request here."""
        if self.llm.config.runner == "pooling":
            raise APIError("This server runs --runner pooling: it makes embeddings (/v1/embeddings), not text.", param="model")
        check_extra_fields(req)
        if req.timeout is not None and not 0 < req.timeout <= MAX_TIMEOUT_S:
            raise APIError(f"timeout must be in (0, {MAX_TIMEOUT_S}] seconds, got {req.timeout}.", param="timeout")
        if req.kv_transfer_params is not None:
            check_kv_transfer_params(self.llm.config, req.kv_transfer_params)
        self.input_processor.check_priority(req.priority)
        return self.resolve_model(req.model)

    def timeout_of(self, req: Any) -> Optional[float]:
        """The request's deadline in seconds from arrival: its ``timeout``, else the server's."""
        return req.timeout if req.timeout is not None else self.request_timeout

    def token_name(self, req: Any):
        """How logprobs name a token id: its text, or with ``return_tokens_as_token_ids``
        ``"token_id:<id>"`` (vLLM's; unambiguous where partial UTF-8 tokens all read as U+FFFD)."""
        return (lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids else self.tokens.text

    def check_model(self, model: Optional[str]) -> str:
        """The name to report: a served model name or a registered LoRA adapter's (None: the
        first served name). Raises APIError 404 (``NotFoundError``, as OpenAI and vLLM answer)
        for a model this server does not serve."""
        return self.resolve_model(model)[0]

    def resolve_model(self, model: Optional[str]) -> tuple[str, Optional[LoRAEntry]]:
        """The name to report and, when ``model`` names a registered LoRA adapter (not a served
        model name), the adapter and its digest. Raises APIError 404 as :meth:`check_model`."""
        if model is None or model in self.served_model_names:
            return (self.served_model_names[0] if model is None else model), None
        lora = self.llm.loras.get(model)
        if lora is not None:
            return model, lora
        raise not_found(model, self.served_model_names)

    def log_request(self, request_id: str, req: Any, prompt_lens: list[int], params: list[SamplingParams]) -> None:
        """``--enable-log-requests``: one line per request (never the prompt text)."""
        if self.log_requests:
            logger.info("request %s: %s prompt tokens, stream=%s, params=%s", request_id, prompt_lens, bool(getattr(req, "stream", False)), params[0])

    def sampling_params(self, req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int) -> SamplingParams:
        """The request's SamplingParams, checked (a structured-output constraint is compiled).

        Raises:
            RequestError: naming the field (for a constraint, the field that carried it).
            APIError: prompt logprobs asked of a decode instance.
        """
        try:
            params = req.to_sampling_params(max_tokens, self.default_sampling)
            self.input_processor.check_params(params)
        except RequestError as e:
            if e.param != "structured_outputs" or not req.constraint_fields():
                raise
            param, msg = req.constraint_fields()[0], e.message
            if param != "structured_outputs":  # name the field the client sent, not ours
                msg = re.sub(r"structured_outputs\.\w+", "response_format.json_schema.schema" if param == "response_format" else param, msg)
            raise RequestError(msg, param=param) from None
        if params.prompt_logprobs is not None and req.kv_transfer_params is not None:
            # A decode instance loads the prompt's KV: its positions are never scored here.
            field = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"  # echo + logprobs scores the prompt
            raise APIError(f"{'echo with logprobs' if field == 'echo' else field} cannot be combined with kv_transfer_params.", param=field)
        return params

    def requested_max_tokens(self, requested: Optional[int]) -> Optional[int]:
        """The request's max_tokens, capped by the generation config's ``max_new_tokens`` when
        there is one (as vLLM takes the smaller of the two); None: up to max_model_len."""
        default = self.default_sampling.get("max_tokens")
        if requested is None or default is None:
            return requested if requested is not None else default
        return min(requested, default)

    # Most prompt-logprob entries (prompt tokens x (k + 1) x choices) one response may carry:
    # about 100 MB of JSON (an 8k-token prompt at k = 20 allows n = 5).
    MAX_PROMPT_LOGPROB_ENTRIES = 1_000_000

    def check_prompt_logprobs(self, prompt_lens: list[int], params: SamplingParams) -> None:
        """Raises APIError when the prompt logprobs asked would exceed the cap (each choice
        scores and carries them)."""
        k = params.prompt_logprobs
        if k is not None and sum(prompt_lens) * (k + 1) * params.n > self.MAX_PROMPT_LOGPROB_ENTRIES:
            raise APIError(
                f"prompt_logprobs: {sum(prompt_lens)} prompt tokens x ({k} + 1) x n={params.n} entries exceed "
                f"the {self.MAX_PROMPT_LOGPROB_ENTRIES:,} a response may carry; lower prompt_logprobs or n.",
                param="prompt_logprobs",
            )

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """Raises APIError when the request's prompts x n exceed ``MAX_SEQUENCES_PER_REQUEST``.
        An n over ``MAX_N`` is left to SamplingParams, whose refusal names the cap it broke."""
        if n <= MAX_N and num_prompts * n > self.MAX_SEQUENCES_PER_REQUEST:
            raise APIError(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
                f"at most {self.MAX_SEQUENCES_PER_REQUEST} are allowed per request.",
                param="n",
            )

    async def run(
        self,
        request_id: str,
        prompts: list[TokenizedPrompt],
        params: list[SamplingParams],
        cache_salt: Optional[str],
        timeout_s: Optional[float] = None,
        kv_transfer_params: Optional[dict] = None,
        priority: int = 0,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per prompt (with its LoRA adapter, if any); yield ``(prompt
        index, delta output)``. However this ends (finished, client gone, cancelled, error), no
        request is left running.

        Raises:
            APIError: 404 when a prompt's adapter was unloaded since the request was checked.
        """
        rids = prompt_request_ids(request_id, len(prompts))
        make = self.input_processor.make_request
        loras = [self.current_lora(p.lora) for p in prompts]
        gens = [
            self.llm.generate_processed(
                make(
                    rid,
                    p.text,
                    p.token_ids,
                    sp,
                    cache_salt=cache_salt,
                    timeout_s=timeout_s,
                    kv_transfer_params=kv_transfer_params,
                    priority=priority,
                    lora=lora,
                )
            )
            for rid, p, sp, lora in zip(rids, prompts, params, loras)
        ]
        unfinished = set(rids)
        lora_usage = self.llm.metrics.lora_usage if any(loras) else None  # pagedserve:lora_requests_info
        if lora_usage is not None:
            for rid, lora in zip(rids, loras):
                if lora is not None:
                    lora_usage.add(rid, lora[0].lora_name)
        try:
            async with aclosing(merge_async_iterators(*gens)) as merged:
                async for pi, out in merged:
                    if out.finished:
                        unfinished.discard(rids[pi])
                    if lora_usage is not None:
                        lora_usage.update(rids[pi], finished=out.finished)
                    yield pi, out
        finally:
            for rid in unfinished:
                self.llm.abort(rid)
            if lora_usage is not None:
                for rid in rids:
                    lora_usage.discard(rid)

    def current_lora(self, lora: Optional[LoRAEntry]) -> Optional[LoRAEntry]:
        """The adapter a prepared request names, as registered now (it may have been unloaded, or
        replaced under its name, since the request was checked). Raises APIError 404 when it is
        gone: the request is refused before it reaches the engine."""
        if lora is None:
            return None
        name = lora[0].lora_name
        now = self.llm.loras.get(name)
        if now is None:
            raise not_found(name, self.served_model_names)
        return now


def not_found(model: str, served: list[str]) -> APIError:
    """The 404 of a model (or LoRA adapter) this server does not serve; the message names the
    served models (the adapters are listed by GET /v1/models)."""
    return APIError(f"The model `{model}` does not exist. Served: {', '.join(served)}.", param="model", status_code=404, err_type="NotFoundError")


# -- prefill/decode disaggregation: a request's kv_transfer_params -----------------------------
def _max_blocks(cfg: Any) -> int:
    return -(-cfg.max_model_len // cfg.block_size)


def check_kv_transfer_params(cfg: Any, params: dict) -> None:
    """Raises APIError (400, ``param="kv_transfer_params"``) on a server without
    ``--kv-transfer-config``, or for malformed or disallowed parameters (see
    ``pagedserve.distributed.kv_transfer``)."""
    if cfg.kv_transfer_config is None:
        raise APIError("kv_transfer_params needs a server started with --kv-transfer-config.", param="kv_transfer_params")
    try:
        kvp.check_params(params, _max_blocks(cfg), kvp.allowed_hosts_of(cfg.kv_transfer))
    except kvp.KVParamsError as e:
        raise APIError(str(e), param="kv_transfer_params") from None


def release_unused_kv(llm: Any, params: Any) -> None:
    """A request refused before reaching the engine may name a prefill instance's hold of its
    prompt's KV: ask the engine to release it now instead of at its lease (nothing for params
    that are malformed: they name nothing this server may contact)."""
    cfg = llm.config
    if cfg.kv_transfer_config is None or not isinstance(params, dict) or not kvp.wants_remote_prefill(params):
        return
    try:
        kvp.check_params(params, _max_blocks(cfg), kvp.allowed_hosts_of(cfg.kv_transfer))
    except kvp.KVParamsError:
        return
    llm.release_kv_transfer(params)
