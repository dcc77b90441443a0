"""Offline API: ``LLM.generate``, ``LLM.chat`` and ``LLM.embed``, with vLLM's names and shapes."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from tqdm import tqdm

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import SchedulerStats
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.pooler_config import PoolingParams, finish_embedding, pooling_sampling_params
from pagedserve.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


def _is_token_ids(x: Any) -> bool:
    """A flat sequence of integers (Python, numpy or torch), i.e. one tokenized prompt."""
    import operator

    if isinstance(x, (str, bytes, dict)) or not hasattr(x, "__len__") or len(x) == 0:
        return False
    try:
        operator.index(x[0])
        return True
    except (TypeError, IndexError):
        return False


def _prompt_list(prompts: Any) -> list:
    """One prompt or a list of them, as a list. Raises ValueError for what is neither (None,
    bytes, a number, ...); each prompt is checked when it is queued."""
    if prompts is None or isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, (str, dict)) and not _is_iterable(prompts):
        raise ValueError(f"prompts must be a string, a token-id list, a dict or a list of these, got {type(prompts).__name__}")
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    return list(prompts)


def _is_iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


class LLM:
    """An engine for offline batched generation.

    Args:
        model: None for the default SmolLM2-135M-Instruct, or a path to an HF model directory
            (config.json, *.safetensors, tokenizer files) or a .gguf file.
        kwargs: any field of :class:`pagedserve.config.EngineConfig` (``dtype``,
            ``max_model_len``, ``num_kv_blocks``, ...); an unknown name is a TypeError.

    Example::

        llm = LLM()
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or a list of prompts (str, token-id list or
        ``{"prompt_token_ids": [...]}``), in input order. ``priority``: one int per prompt
        (smaller runs first), only with ``scheduling_policy="priority"``, as vLLM's.
        ``lora_request``: a :class:`LoRARequest` for every prompt or a list of one per prompt
        (None: the base model), with ``LLM(..., enable_lora=True)``.

        Raises:
            ValueError: for invalid prompts, sampling parameters or priorities (nothing is
                queued then).
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        if self.llm_engine.config.runner == "pooling":
            raise ValueError("this engine was started with runner='pooling': it makes embeddings (LLM.embed), not text")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority must hold one value per prompt: {len(priorities)} for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request must be one LoRARequest or one per prompt: {len(loras)} for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, priorities, loras)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (str, token-id list or ``{"prompt_token_ids": [...]}``), in
        input order, as vLLM's ``LLM.embed``: the pooled final-norm hidden states of the prompt
        (see :mod:`pagedserve.pooler_config`). Needs ``LLM(..., runner="pooling")``.

        Raises:
            ValueError: a generating engine, invalid prompts or pooling params (nothing is queued then).
        """
        cfg = self.llm_engine.config.pooler
        if cfg is None:
            raise ValueError('embed() needs an engine started with runner="pooling" (LLM(model, runner="pooling")); this one generates text')
        prompts = _prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pp_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            pp_list = list(pooling_params)
            if len(pp_list) != len(prompts):
                raise ValueError("pooling_params must be one PoolingParams or one per prompt")
        for pp in pp_list:
            pp.verify(cfg)
        sp = pooling_sampling_params(truncate_prompt_tokens)
        outs = self._run(prompts, [sp] * len(prompts), use_tqdm, [0] * len(prompts))
        return [
            EmbeddingRequestOutput(
                o.request_id, EmbeddingOutput(finish_embedding(o.pooled or b"", cfg, pp)), o.prompt_token_ids, True, o.num_cached_tokens
            )
            for o, pp in zip(outs, pp_list)
        ]

    def chat(
        self,
        messages: Union[Conversation, list[Conversation]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, each rendered with the
        tokenizer's chat template (``[{"role": ..., "content": ...}, ...]``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template)} for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True, chat_template: Optional[str] = None) -> list[int]:
        tok = self.llm_engine.tokenizer
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
        return tok(text, add_special_tokens=False)["input_ids"]

    def _run(
        self, prompts: list, params_list: list[SamplingParams], use_tqdm: bool, priorities: list[int], loras: Optional[list] = None
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for p, sp, prio, lora in zip(prompts, params_list, priorities, loras or [None] * len(prompts)):
                ids.append(engine.add_request(None, p, sp, priority=prio, lora_request=lora))
        except Exception:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[Optional[RequestOutput]] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while any(r is None for r in results) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def stats(self) -> SchedulerStats:
        """Engine counters: num_total_blocks, num_free_blocks, kv_cache_usage, num_running,
        num_waiting, num_preemptions, prefix_cache_queries / prefix_cache_hits (tokens),
        prefix_cache_hit_rate, num_prompt_tokens, num_generation_tokens."""
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def get_step_trace(self, since_step: Optional[int] = None, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """What the engine did in its last steps: one dict per step with ``step >= since_step``
        (every buffered one when None), oldest first, at most ``limit``. Fields (see
        :mod:`pagedserve.core.trace`): ``step``, ``time``, ``duration_ms``, ``token_budget``,
        ``num_scheduled_tokens``, ``predicted_ms``, ``target_ms``, ``scheduled`` (``request_id``, ``phase`` "prefill"/"decode",
        ``num_tokens``, ``num_computed_tokens``, ``num_prompt_tokens``, ``admitted``,
        ``prefix_hit_tokens``), ``preempted``, ``finished`` (``request_id``,
        ``finish_reason``), ``num_running``, ``num_waiting`` and the block counts
        ``num_total_blocks``, ``num_used_blocks``, ``num_free_blocks``,
        ``num_cached_free_blocks``. The engine keeps the last ``trace_buffer_steps`` (1024)."""
        return self.llm_engine.get_step_trace(since_step, limit)

    def get_block_map(self) -> dict[str, Any]:
        """Every KV block's state now: ``state`` (per block id, index into ``state_names`` =
        free, used, shared, cached), ``owner`` (index into ``request_ids`` or -1), ``ref_cnt``,
        ``block_size``, ``num_blocks``."""
        return self.llm_engine.get_block_map()
