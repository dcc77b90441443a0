"""EngineCore: the scheduler and the worker, and one step = schedule -> execute -> update.

It takes validated :class:`EngineCoreRequest`s and returns :class:`EngineCoreOutputs`; it does
no tokenization, detokenization or output shaping (the frontend's input and output processors
do). It runs in the caller's process (``LLM``) or in a process of its own behind ZeroMQ
(``pagedserve serve``, see :mod:`pagedserve.engine.core_proc`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.core.structured_output import StructuredOutputManager

logger = logging.getLogger("pagedserve")


@dataclass
class EngineCoreInfo:
    """What the frontend needs to know of a started core (sent in its ready message).

    Attributes:
        config: the resolved config (max_model_len and the token budget filled in).
        num_blocks, block_bytes: the KV pool (blocks, bytes per block).
        dtype, device: as strings ("bfloat16", "cpu").
        model_dir: the resolved HF-style model directory (tokenizer and config live there).
    """

    config: EngineConfig
    num_blocks: int
    block_bytes: int
    dtype: str
    device: str
    model_dir: str


class EngineCore:
    """Scheduler + worker for one model.

    Raises:
        ValueError / FileNotFoundError: from the worker (bad config or model path).
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.model.loader import load_eos_token_ids, load_tokenizer
        from pagedserve.worker.worker import Worker  # the only torch import of the core path

        t0 = time.monotonic()
        self.worker = Worker(config)
        spec = self.worker.kv_spec
        self.config = config.resolved(spec.max_model_len)
        self.config.verify_token_budget()
        self.worker.initialize_cache(self.config)
        kv = KVCacheManager(spec.num_blocks, self.config.block_size, self.config.enable_prefix_caching, self.worker.model_identity)
        tokenizer_dir = config.tokenizer or self.worker.model_dir
        hf_config = self.worker.hf_config
        grammars = StructuredOutputManager(lambda: load_tokenizer(tokenizer_dir), hf_config.vocab_size,
                                           lambda tok: load_eos_token_ids(self.worker.model_dir, hf_config, tok))
        self.scheduler = Scheduler(self.config, kv, grammars)
        self.info = EngineCoreInfo(
            self.config, spec.num_blocks, spec.block_bytes, str(self.worker.dtype).replace("torch.", ""),
            str(self.worker.device), self.worker.model_dir,
        )
        B = self.config.block_size
        logger.info(
            "pagedserve: KV cache %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token), max_model_len %d, "
            "token budget %d, engine ready in %.1fs",
            spec.num_blocks, B, spec.num_blocks * B, spec.num_blocks * spec.block_bytes / 2**20, spec.block_bytes // B,
            self.config.max_model_len, self.config.max_num_batched_tokens, time.monotonic() - t0,
        )

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a validated request. Raises ValueError when its id is in use."""
        self.scheduler.add_request(
            Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids, req.arrival_time, req.cache_salt,
                    req.deadline)
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests as aborted and free their blocks now (unknown ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and update once; outputs of the requests that progressed."""
        scheduler_output = self.scheduler.schedule()
        # Even an empty step goes to the worker: it carries the ids of finished requests.
        runner_output = self.worker.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefix blocks; refused (False) while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()
