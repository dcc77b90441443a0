"""LLMEngine: the synchronous engine of ``LLM`` and the CLI, in one process.

Glue only: the :class:`InputProcessor` validates and tokenizes, the :class:`EngineCore`
(scheduler + worker) runs ``schedule -> execute -> update``, the :class:`OutputProcessor`
detokenizes and shapes :class:`RequestOutput`s. A sequence that hits a stop string is aborted in
the core in the same step, so its blocks are freed at once.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Union

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import SchedulerStats
from pagedserve.engine.core import EngineCore
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")


def served_model_names(config: EngineConfig) -> list[str]:
    """The names the API answers to; the first is the one it reports."""
    if config.served_model_name:
        return list(config.served_model_name)
    if config.model is None:
        from pagedserve.model.files import DEFAULT_MODEL_NAME

        return [DEFAULT_MODEL_NAME]
    return [os.path.basename(os.path.normpath(config.model))]


def make_processors(info, model_dir: str) -> tuple[InputProcessor, OutputProcessor, object]:
    """The frontend's processors for a core described by ``info`` (tokenizer from
    ``info.config.tokenizer`` or else ``model_dir``); returns (input processor, output
    processor, tokenizer)."""
    from pagedserve.model import files as loader

    tokenizer = loader.load_tokenizer(info.config.tokenizer or model_dir)
    hf_config = loader.load_config(model_dir)
    eos = loader.load_eos_token_ids(model_dir, hf_config, tokenizer)
    inputs = InputProcessor(
        tokenizer, hf_config.vocab_size, info.config.max_model_len, eos, info.config.scheduling_policy, pooling=info.config.runner == "pooling"
    )
    return inputs, OutputProcessor(tokenizer), tokenizer


class LLMEngine:
    """A model, its KV cache and the requests stepped to completion, in this process.

    Raises:
        ValueError: on an invalid configuration (e.g. max_model_len larger than the model's
            context or than the KV cache can hold).
        FileNotFoundError: when the model path does not exist.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is for the server (pagedserve serve, AsyncLLM); the offline engine runs one replica")
        self.core = EngineCore(config)
        self.config = self.core.config  # resolved
        self.model_name = served_model_names(config)[0]
        self.input_processor, self.output_processor, self.tokenizer = make_processors(self.core.info, self.core.info.model_dir)
        self._last_log = time.monotonic()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.input_processor.vocab_size

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> str:
        """Validate and queue a request; returns its id. ``priority``: see ``EngineConfig.scheduling_policy``.
        ``lora_request``: the LoRA adapter to run with (loaded here the first time; None: the base model).

        Raises:
            ValueError: naming the field: empty prompt, prompt too long for max_model_len, token
                ids outside the vocabulary, duplicate request_id, invalid sampling parameters, an
                adapter that is refused or LoRA off.
        """
        lora = None
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            lora = (lora_request, self.core.add_lora(lora_request))
        req = self.input_processor.process(request_id, prompt, params, arrival_time, cache_salt, priority, lora)
        self.output_processor.add_request(req)
        for child in req.children:
            self.core.add_request(child)
        return req.request_id

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        """Abort requests (by the id add_request returned); their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core.abort_requests(self.output_processor.abort_requests(list(request_ids)))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return the outputs of requests that progressed."""
        outputs, to_abort = self.output_processor.process_outputs(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        self._maybe_log_stats()
        return outputs

    def get_stats(self) -> SchedulerStats:
        """The core's counters (blocks, requests, preemptions, prefix cache, tokens)."""
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefix blocks. Returns False (and does nothing) while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def get_step_trace(self, since_step: Optional[int] = None, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """The engine core's step records with ``step >= since_step`` (all buffered when None),
        oldest first, at most ``limit``; fields in :mod:`pagedserve.core.trace`. Empty when
        ``trace_buffer_steps=0``."""
        return self.core.get_step_trace(since_step, limit)

    def get_block_map(self) -> dict[str, Any]:
        """Every KV block's state (free / used / shared / cached) and owner, built now; see
        :func:`pagedserve.core.trace.block_map`."""
        return self.core.get_block_map()

    def _maybe_log_stats(self, interval_s: float = 10.0) -> None:
        now = time.monotonic()
        if now - self._last_log >= interval_s:
            self._last_log = now
            log_stats(self.get_stats())


def log_stats(s: SchedulerStats) -> None:
    logger.info(
        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
        s.num_running,
        s.num_waiting,
        100 * s.kv_cache_usage,
        100 * s.prefix_cache_hit_rate,
        s.num_preemptions,
    )
