"""EngineCore: the scheduler and the worker, and one step = schedule -> execute -> update.

It takes validated :class:`EngineCoreRequest`s and returns :class:`EngineCoreOutputs`; it does
no tokenization, detokenization or output shaping (the frontend's input and output processors
do). It runs in the caller's process (``LLM``) or in a process of its own behind ZeroMQ
(``pagedserve serve``, see :mod:`pagedserve.engine.core_proc`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.outputs import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.core.structured_output import StructuredOutputManager
from pagedserve.core.trace import StepTracer, block_map
from pagedserve.lora_request import LoRARequest, adapter_digest, parse_lora_modules
from pagedserve.pooler_config import pooler_config_dict, resolve_pooler_config

logger = logging.getLogger("pagedserve")


def _describe_step_target(config) -> str:
    """The step-time target as the start-up log line states it."""
    m = config.max_step_decode_multiple
    return f"{config.max_step_ms:g} ms" + (f" or {m:g}x the step's decodes alone, the larger" if m else "")


def _describe_spec(spec) -> str:
    if spec is None:
        return "off"
    off_at = f", off from {spec.disable_by_batch_size} running" if spec.disable_by_batch_size else ""
    return f"{spec.method} ({spec.num_speculative_tokens} drafts from suffixes of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens{off_at})"


class EngineCore:
    """Scheduler + worker for one model.

    Raises:
        ValueError / FileNotFoundError: from the worker (bad config or model path).
    """

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.executor.tp_executor import create_executor  # the only torch import of the core path
        from pagedserve.model.files import load_eos_token_ids, load_tokenizer

        t0 = time.monotonic()
        # The in-process Worker itself, or a tensor-parallel executor with the same interface.
        self.worker = create_executor(config)
        try:
            spec = self.worker.kv_spec
            self.config = config.resolved(spec.max_model_len, self.worker.device.type)
            if self.config.runner == "pooling":
                self.config = _with_pooling(self.config, self.worker.model_dir)
            self.config.verify_token_budget()
            if spec.sliding_window is not None and self.config.kv_transfer_config is not None:
                raise ValueError(
                    "prefill/decode disaggregation (kv_transfer_config) is not supported for sliding-window models: a "
                    f"transfer sends every prompt block, and the blocks older than the {spec.sliding_window}-token window are freed during prefill"
                )
            self.worker.initialize_cache(self.config)
        except BaseException:
            self.worker.shutdown()
            raise
        kv = KVCacheManager(
            spec.num_blocks, self.config.block_size, self.config.enable_prefix_caching, self.worker.model_identity, spec.sliding_window
        )
        tokenizer_dir = config.tokenizer or self.worker.model_dir
        hf_config = self.worker.hf_config
        grammars = StructuredOutputManager(
            lambda: load_tokenizer(tokenizer_dir), hf_config.vocab_size, lambda tok: load_eos_token_ids(self.worker.model_dir, hf_config, tok)
        )
        connector = None
        if self.config.kv_transfer_config is not None:
            from pagedserve.distributed.kv_transfer.scheduler_side import NetworkConnectorScheduler

            connector = NetworkConnectorScheduler(
                self.config.kv_transfer, self.config.block_size, kv.block_hashes, -(-self.config.max_model_len // self.config.block_size)
            )
        self.scheduler = Scheduler(self.config, kv, grammars, connector)
        self.loras: dict[int, tuple[LoRARequest, str]] = {}  # registered adapters: id -> (request, digest)
        try:
            for lora in parse_lora_modules(self.config.lora_modules):
                self.add_lora(lora)
        except BaseException:
            self.worker.shutdown()
            raise
        tracer = StepTracer(self.config.trace_buffer_steps, self.config.trace_file)
        self.tracer: Optional[StepTracer] = tracer if tracer.enabled else None
        self.info = EngineCoreInfo(
            self.config,
            spec.num_blocks,
            spec.block_bytes,
            str(self.worker.dtype).replace("torch.", ""),
            str(self.worker.device),
            self.worker.model_dir,
            kv.seed_hash,
            *_weights_of(self.worker),
            [[r, key] for r, key in self.loras.values()],
        )
        B = self.config.block_size
        logger.info(
            "pagedserve: KV cache %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token, %s), max_model_len %d, "
            "token budget %d, step-time target %s, speculative decoding %s, engine ready in %.1fs",
            spec.num_blocks,
            B,
            spec.num_blocks * B,
            spec.num_blocks * spec.block_bytes / 2**20,
            spec.block_bytes // B,
            "int8" if self.config.kv_cache_dtype == "int8" else str(self.worker.dtype).replace("torch.", ""),
            self.config.max_model_len,
            self.config.max_num_batched_tokens,
            _describe_step_target(self.config) if self.scheduler.step_cost is not None else "off",
            _describe_spec(self.config.speculative),
            time.monotonic() - t0,
        )

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a validated request. Raises ValueError when its id is in use or its LoRA
        adapter is not registered here."""
        lora_key = None
        if req.lora_request is not None:
            entry = self.loras.get(req.lora_request.lora_int_id)
            if entry is None or entry[0].lora_name != req.lora_request.lora_name or (req.lora_key is not None and req.lora_key != entry[1]):
                raise ValueError(f"LoRA adapter {req.lora_request.lora_name!r} (id {req.lora_request.lora_int_id}) is not loaded")
            lora_key = entry[1]
        self.scheduler.add_request(
            Request(
                req.request_id,
                req.prompt_token_ids,
                req.sampling_params,
                req.eos_token_ids,
                req.arrival_time,
                req.cache_salt,
                req.deadline,
                req.kv_transfer_params,
                req.priority,
                req.lora_request,
                lora_key,
            )
        )

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> str:
        """Register a LoRA adapter: the worker loads and checks it (see
        :mod:`pagedserve.worker.lora_manager`). Returns the digest its KV is cached under
        (the same adapter again: its digest, nothing reloaded).

        Raises:
            ValueError: LoRA is off, the id or name is taken by another adapter, ``max_cpu_loras``
                adapters are registered, or the adapter is refused (files, rank, shapes).
        """
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)")
        if isinstance(lora, dict):  # from a utility call's arguments
            lora = LoRARequest(**lora)
        else:
            lora.__post_init__()  # its fields again (a dataclass's fields can be reassigned)
        same = self.loras.get(lora.lora_int_id)
        if same is not None:
            if (same[0].lora_name, same[0].lora_path) == (lora.lora_name, lora.lora_path):
                return same[1]
            raise ValueError(f"LoRA id {lora.lora_int_id} is already used by adapter {same[0].lora_name!r}")
        if any(r.lora_name == lora.lora_name for r, _ in self.loras.values()):
            raise ValueError(f"a LoRA adapter named {lora.lora_name!r} is already loaded")
        if len(self.loras) >= self.config.lora_capacity:
            raise ValueError(f"{len(self.loras)} LoRA adapters are loaded, the most max_cpu_loras allows; unload one first")
        key = adapter_digest(lora.lora_path)
        try:
            self.worker.add_lora(lora)
            self.loras[lora.lora_int_id] = (lora, key)
        except BaseException:
            # Never half-registered: whatever fails once the worker may hold the adapter unloads
            # it there (a no-op when it was refused before holding it); the id was free here.
            self.loras.pop(lora.lora_int_id, None)
            try:
                self.worker.remove_lora(lora.lora_int_id)
            except Exception:
                logger.exception("pagedserve: could not unload LoRA adapter %r after a failed add", lora.lora_name)
            raise
        return key

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter. False when it is not loaded.

        Raises:
            ValueError: live requests use it (it is never taken from under them).
        """
        entry = self.loras.get(lora_int_id)
        if entry is None:
            return False
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {entry[0].lora_name!r} is in use by {len(users)} request(s); retry when they finish")
        self.worker.remove_lora(lora_int_id)
        del self.loras[lora_int_id]
        return True

    def list_loras(self) -> list[int]:
        """Ids of the registered adapters."""
        return sorted(self.loras)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests as aborted and free their blocks now (unknown ids are ignored)."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.tracer is not None and done:
            self.tracer.note_aborted(r.request_id for r in done)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def poll_interval(self) -> Optional[float]:
        """How soon the busy loop should step again when no command arrives: 0 while requests
        can run, a short interval while only KV transfers are outstanding (their completions
        arrive with a step), None when idle."""
        s = self.scheduler
        if s.waiting or s.running:
            return 0.0
        return s.kv_poll_interval()

    def release_kv_transfer(self, params: dict) -> None:
        """The front refused a request whose ``kv_transfer_params`` name a prefill instance's
        hold: release it now (no-op without a KV connector or for other params)."""
        if self.scheduler.connector is not None:
            self.scheduler.connector.release_remote(params)

    def shutdown(self) -> None:
        """Stop the worker's background threads (the KV connector's) or, with tensor
        parallelism, its worker processes, in bounded time."""
        self.worker.shutdown()

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and update once; outputs of the requests that progressed."""
        tracer = self.tracer
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        if tracer is not None:  # before the model runs: phases are read off num_computed_tokens
            scheduled = tracer.scheduled_entries(self.scheduler, scheduler_output)
        # Even an empty step goes to the worker: it carries the ids of finished requests.
        runner_output = self.worker.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        # The step-cost model behind max_step_ms learns from every step's wall time.
        self.scheduler.record_step_time(1000.0 * (time.monotonic() - start))
        if tracer is not None:
            tracer.record(start, scheduled, self.scheduler, scheduler_output, outputs)
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefix blocks; refused (False) while requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_step_trace(self, since_step: Optional[int] = None, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """The last steps' records (see :mod:`pagedserve.core.trace` for their fields), oldest
        first: those with ``step >= since_step`` still in the ring buffer (all when None), at
        most ``limit``. Empty when the trace is off (``trace_buffer_steps=0``). A poller passes
        the last step it saw + 1; a gap between that and the first record returned means the
        buffer overflowed in between."""
        return self.tracer.get(since_step, limit) if self.tracer is not None else []

    def enable_kv_events(self) -> None:
        """Record prefix-cache stored/removed events from now on (for a data-parallel router)."""
        self.scheduler.kv_cache_manager.block_pool.enable_kv_events()

    def take_kv_events(self) -> Optional[list]:
        """Events since the last call (see ``EngineCoreOutputs.kv_events``), or None."""
        return self.scheduler.kv_cache_manager.block_pool.take_kv_events()

    def get_block_map(self) -> dict[str, Any]:
        """A snapshot of every KV block's state and owner (see
        :func:`pagedserve.core.trace.block_map`); O(num_blocks), built on each call."""
        return block_map(self.scheduler.kv_cache_manager, [r.request_id for r in self.scheduler.running])


def _with_pooling(config: EngineConfig, model_dir: str) -> EngineConfig:
    """``config`` with its pooler config resolved against the checkpoint (see
    :func:`pagedserve.pooler_config.resolve_pooler_config`), and prefix caching off unless
    the pooling is LAST (MEAN and CLS read positions a prefix hit would skip; vLLM does the same)."""
    pooler = resolve_pooler_config(config.pooler_config, model_dir)
    caching = config.enable_prefix_caching
    if caching and pooler.pooling_type != "LAST":
        logger.info("pagedserve: prefix caching is off: %s pooling reads every prompt position", pooler.pooling_type)
        caching = False
    logger.info("pagedserve: pooling runner, %s pooling, normalize %s", pooler.pooling_type, pooler.normalize)
    return dataclasses.replace(config, pooler_config=pooler_config_dict(pooler), enable_prefix_caching=caching)


def _weights_of(worker) -> tuple[str, int]:
    """(weights_type, weight_bytes) of a worker (or a TP executor's rank 0)."""
    w = getattr(worker, "weights", None) or getattr(getattr(worker, "worker", None), "weights", None)
    if w is None:
        return "", 0
    return w.kind, w.quantized_bytes + w.float_bytes
