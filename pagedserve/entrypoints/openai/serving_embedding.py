"""/v1/embeddings (OpenAI's shape, vLLM's extras) on an engine started with ``--runner pooling``.

``input``: a string, a list of strings, a list of token ids or a list of token-id lists (at most
``MAX_INPUTS`` of them). ``encoding_format``: "float" (lists of numbers) or "base64" (base64 of
the little-endian float32 values, what the ``openai`` client asks for by default).
``dimensions``: Matryoshka truncation, refused unless the model's config declares it. vLLM's
``truncate_prompt_tokens`` (the last k tokens), ``add_special_tokens`` (default true) and
``normalize`` are taken; ``user`` is accepted and ignored. Every input runs as its own engine
request through the scheduler (chunked prefill, prefix caching with LAST pooling, continuous
batching beside other requests); usage counts the prompt tokens.

Refused with a 400: a server that generates text (no ``--runner pooling``), an empty input,
an input longer than max_model_len, an unknown ``encoding_format``, ``dimensions`` a model
does not support.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Annotated, Literal, Optional, Union

from pydantic import StrictBool, StrictInt

from pagedserve.entrypoints.openai.http_common import APIError
from pagedserve.entrypoints.openai.protocol import NonEmptyStr, OpenAIBaseModel, TokenId, schema_only
from pagedserve.entrypoints.openai.serving_common import OpenAIServing, check_extra_fields
from pagedserve.entrypoints.openai.serving_completion import TokenizedPrompt
from pagedserve.pooler_config import PoolerConfig, PoolingParams, encode_base64, finish_embedding, pooling_sampling_params


class EmbeddingRequest(OpenAIBaseModel):
    model: Optional[str] = None
    input: Union[
        NonEmptyStr,
        Annotated[list[NonEmptyStr], schema_only(minItems=1)],
        Annotated[list[TokenId], schema_only(minItems=1)],
        Annotated[list[Annotated[list[TokenId], schema_only(minItems=1)]], schema_only(minItems=1)],
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = None
    user: Optional[str] = None
    request_id: Optional[str] = None
    truncate_prompt_tokens: Optional[StrictInt] = None
    add_special_tokens: StrictBool = True
    normalize: Optional[StrictBool] = None
    priority: StrictInt = 0


class EmbeddingData(OpenAIBaseModel):
    object: str = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class OpenAIServingEmbedding(OpenAIServing):
    """The embeddings endpoint."""

    # Most inputs one request may embed (OpenAI's own limit is 2,048).
    MAX_INPUTS = 2048

    @property
    def pooler(self) -> PoolerConfig:
        """The engine's pooler config. Raises APIError 400 on an engine that generates text."""
        cfg = self.llm.config.pooler
        if cfg is None:
            raise APIError(
                "This server generates text: /v1/embeddings needs a server started with --runner pooling.", param="model", err_type="BadRequestError"
            )
        return cfg

    def prepare(self, req: EmbeddingRequest) -> tuple[str, list[TokenizedPrompt], PoolingParams]:
        """Validate and tokenize. Raises APIError / RequestError naming the field."""
        check_extra_fields(req)
        model = self.check_model(req.model)
        cfg = self.pooler
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        try:
            params.verify(cfg)
        except ValueError as e:
            raise APIError(str(e), param="dimensions") from None
        self.input_processor.check_priority(req.priority)
        inputs = req.input
        if not inputs:
            raise APIError("input must not be empty.", param="input")
        if isinstance(inputs, list) and inputs and not all(isinstance(x, int) for x in inputs) and len(inputs) > self.MAX_INPUTS:
            raise APIError(f"input holds {len(inputs)} items; at most {self.MAX_INPUTS} are allowed per request.", param="input")
        prompts = []
        for p in self._as_list(inputs):
            if isinstance(p, str):
                if not p:
                    raise APIError("input must not be empty.", param="input")
                ids = self.input_processor.tokenize(p, req.add_special_tokens, "input")
            else:
                ids = list(p)
            if not ids:
                raise APIError("input must not be empty.", param="input")
            self.input_processor.check_token_ids(ids, "input", param="input")
            if req.truncate_prompt_tokens is not None:
                ids = self.input_processor.truncate_prompt(ids, req.truncate_prompt_tokens)
            if len(ids) >= self.llm.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.llm.max_model_len} tokens, and one input has {len(ids)} "
                    f"(at most {self.llm.max_model_len - 1} can be embedded). Please shorten the input or set truncate_prompt_tokens.",
                    param="input",
                )
            prompts.append(TokenizedPrompt(p if isinstance(p, str) else None, ids))
        return model, prompts, params

    @staticmethod
    def _as_list(inputs) -> list:
        if isinstance(inputs, str):
            return [inputs]
        if inputs and all(isinstance(x, int) for x in inputs):
            return [inputs]
        return list(inputs)

    async def embed_full(
        self, req: EmbeddingRequest, request_id: str, model: str, prompts: list[TokenizedPrompt], params: PoolingParams, engine_id: str
    ) -> EmbeddingResponse:
        """Run every input; the response once all are pooled."""
        cfg = self.pooler
        sp = [pooling_sampling_params()] * len(prompts)
        vectors: list[Optional[list[float]]] = [None] * len(prompts)
        async with aclosing(self.run(engine_id, prompts, sp, None, self.request_timeout, priority=req.priority)) as outs:  # type: ignore[type-var]
            async for i, out in outs:
                if not out.finished:
                    continue
                o = out.outputs[0] if out.outputs else None
                if out.pooled is None:
                    reason = o.finish_reason if o is not None else None
                    if reason == "timeout":
                        raise APIError("the request passed its timeout before it was embedded.", status_code=408, err_type="TimeoutError")
                    raise APIError(f"the embedding request ended without a result ({reason}).", status_code=500, err_type="InternalServerError")
                vectors[i] = finish_embedding(out.pooled, cfg, params)
        data = [
            EmbeddingData(index=i, embedding=encode_base64(v) if req.encoding_format == "base64" else v)  # type: ignore[arg-type]
            for i, v in enumerate(vectors)
        ]
        n = sum(len(p.token_ids) for p in prompts)
        return EmbeddingResponse(
            id=request_id, created=int(time.time()), model=model, data=data, usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)
        )
