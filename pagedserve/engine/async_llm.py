"""AsyncLLM: the serving frontend. Requests are validated and tokenized here, the engine core
runs beside it (its own process by default, see :mod:`pagedserve.engine.core_client`), and
outputs are detokenized here and handed to asyncio consumers (vLLM v1's ``AsyncLLM`` shape).

* ``generate()`` runs the :class:`InputProcessor` on the caller's event loop (a bad request
  raises at once and never reaches the core), registers the request with the
  :class:`OutputProcessor`, sends it to the core, and yields its outputs.
* Its :class:`OutputHandler` runs one *output thread* that receives the core's per-step
  outputs, runs the output processor (detokenization, stop strings: a sequence that hits one is
  aborted in the core), and hands each ``RequestOutput`` to its consumer's loop, one
  ``loop.call_soon_threadsafe`` per loop and step (:mod:`pagedserve.engine.loop_handoff`).
* Utility calls (``reset_prefix_cache``, ``get_step_trace``, ``get_block_map``: vLLM's name for
  calls into the core that are not requests) send a UTILITY message and await the answer the
  output thread resolves between two steps.
* A consumer that stops iterating (``break``, ``aclose()``, cancellation, client disconnect)
  aborts its request at once; the core frees its blocks before its next step.
* If the core dies (even by SIGKILL) or fails a step, every live request ends with
  :class:`EngineDeadError`, ``errored`` turns True and ``on_engine_dead`` is called; nothing hangs.
* With ``data_parallel_size`` N > 1 the client is a :class:`pagedserve.engine.dp_client.DPClient`
  (N replicas, one router): stats and metrics are kept per engine (``get_stats`` sums them),
  and a replica's death ends only the requests it was running (a FAILED message).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import SchedulerStats
from pagedserve.engine.input_processor import ProcessedRequest, PromptType
from pagedserve.engine.llm_engine import make_processors, served_model_names
from pagedserve.engine.output_handler import EngineDeadError, OutputHandler, Stream
from pagedserve.lora_request import LoRARequest
from pagedserve.messages import AbortRequests, AddRequest, ReleaseKV, UtilityCall
from pagedserve.messages import EngineCoreRequestType as Req
from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]


class AsyncLLM:
    """Serve one model to asyncio code.

    Args:
        config: the engine's configuration.
        engine_process: run the engine core in its own process (default) or in a thread.
        metrics: the Prometheus observer (:class:`pagedserve.metrics.EngineMetrics`, called from
            the output thread); one is made for the served model name when None.
        on_engine_dead: called once (from the output thread) when the core dies or fails.

    Raises:
        ValueError / FileNotFoundError: invalid config or model (from the core's start-up).

    Example::

        llm = AsyncLLM(EngineConfig())
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
            print(out.outputs[0].text)
        llm.shutdown()
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_process: bool = True,
        metrics: Any = None,
        on_engine_dead: Optional[Callable[[], None]] = None,
        log_level: str = "info",
    ) -> None:
        from pagedserve.engine.core_client import MPClient, ThreadClient
        from pagedserve.model.files import resolve_model

        resolve_model(config.model)  # convert a GGUF file once, here, before the core starts
        config = config.with_serving_defaults()  # e.g. the bounded step time: latency matters online
        self.data_parallel_size = config.data_parallel_size
        if self.data_parallel_size > 1:
            if not engine_process:
                raise ValueError("data_parallel_size > 1 needs engine processes (engine_process=True)")
            from pagedserve.engine.dp_client import DPClient

            self.client: Any = DPClient(config, log_level)
        else:
            self.client = MPClient(config, log_level) if engine_process else ThreadClient(config)
        info = self.client.info
        self.config = info.config
        self.served_model_names = served_model_names(config)
        self.model_name = self.served_model_names[0]
        self.model_dir = info.model_dir
        self.input_processor, self.output_processor, self.tokenizer = make_processors(info, info.model_dir)
        self.max_model_len = self.config.max_model_len
        self.vocab_size = self.input_processor.vocab_size
        # LoRA adapters by name (registered at start with --lora-modules, or by add_lora): (request, digest)
        self.loras: dict[str, tuple[LoRARequest, str]] = {r.lora_name: (r, key) for r, key in info.loras}
        self.metrics = metrics if metrics is not None else EngineMetrics(self.model_name)
        self.metrics.set_weights(info.weights_type, info.weight_bytes)
        self.outputs = OutputHandler(
            self.client,
            self.output_processor,
            SchedulerStats(num_total_blocks=info.num_blocks, num_free_blocks=info.num_blocks),
            data_parallel_size=self.data_parallel_size,
            replica_stats=tuple(getattr(self.client, "replica_stats", ())),
            metrics=self.metrics,
            on_engine_dead=on_engine_dead,
        )
        self.outputs.start()

    # -- public API (any event loop) ------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.outputs.is_running

    @property
    def errored(self) -> bool:
        return self.outputs.error is not None

    @property
    def engine_pid(self) -> int:
        return self.client.pid

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last step or command."""
        return self.outputs.stats

    def replica_status(self) -> Optional[list[dict[str, Any]]]:
        """Data parallel: each replica's state (see ``DPClient.replica_status``); else None."""
        return self.client.replica_status() if self.data_parallel_size > 1 else None

    def num_unfinished_requests(self) -> int:
        with self.outputs.lock:
            return self.output_processor.get_num_unfinished_requests()

    def num_waiting_to_start(self) -> int:
        """Requests handed to the core that have produced no output yet (queued or in prefill)."""
        with self.outputs.lock:
            return len(self.outputs.not_started)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        cache_salt: Optional[str] = None,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate an offline-style prompt (see ``InputProcessor.process``) and stream its
        outputs; ``lora_request`` (an adapter registered by name, loaded here if new) or None.

        Raises:
            ValueError: the request is invalid (the message names the field) or the id is in use.
            EngineDeadError: the engine core is not running.
        """
        lora = None
        if lora_request is not None:
            if lora_request.lora_name not in self.loras:
                await self.add_lora(lora_request)
            lora = self.loras[lora_request.lora_name]
        processed = self.input_processor.process(request_id, prompt, params, cache_salt=cache_salt, priority=priority, lora=lora)
        async for out in self.generate_processed(processed):
            yield out

    async def generate_processed(self, req: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        """Stream the outputs (as ``params.output_kind`` shapes them) of a request the input
        processor made, until it finishes. Leaving early aborts it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        out = self.outputs
        with out.lock:
            out.check_alive()
            self.output_processor.add_request(req)  # ValueError on a duplicate id
            out.streams[req.request_id] = Stream(loop, queue)
            out.not_started.add(req.request_id)
        try:
            self.client.send((Req.ADD, AddRequest(req.children)))
        except BaseException:
            with out.lock:
                out.streams.pop(req.request_id, None)
                out.not_started.discard(req.request_id)
                self.output_processor.abort_requests([req.request_id])
            raise
        finished = False
        started = False
        try:
            while True:
                item = await queue.get()
                if not isinstance(item, BaseException) and not started:
                    started = True
                    with out.lock:
                        out.not_started.discard(req.request_id)
                if isinstance(item, BaseException):
                    finished = True  # the output thread already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with out.lock:
                out.not_started.discard(req.request_id)
            if not finished:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or done). Never blocks on the core."""
        with self.outputs.lock:
            self.outputs.streams.pop(request_id, None)
            child_ids = self.output_processor.abort_requests([request_id])
        if child_ids:
            metrics = self.metrics
            if self.data_parallel_size > 1:
                metrics = metrics.for_engine(self.client.engine_of(child_ids[0]))
            self.client.send((Req.ABORT, AbortRequests(child_ids)))
            metrics.observe_abort(request_id, len(child_ids))

    def fail_all_requests(self, reason: str) -> None:
        """End every live request now with EngineDeadError ``reason`` (see
        :meth:`OutputHandler.fail_all_requests`); the core keeps running."""
        self.outputs.fail_all_requests(reason)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core and the output thread; live requests end with EngineDeadError."""
        self.outputs.stopped = True
        self.client.shutdown(timeout_s)
        self.outputs.stop(timeout_s)

    # -- utility calls -----------------------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        return await self._call_utility("reset_prefix_cache")

    def release_kv_transfer(self, params: dict) -> None:
        """A refused request named a prefill instance's KV hold: have the core release it (a
        one-way RELEASE_KV command; nothing to await)."""
        if self.outputs.is_running:
            self.client.send((Req.RELEASE_KV, ReleaseKV(params)))

    async def get_step_trace(self, since_step: Optional[int] = None, limit: Optional[int] = None) -> list[dict[str, Any]]:
        """The engine core's step records with ``step >= since_step`` (every buffered one when
        None), oldest first, at most ``limit``: plain dicts (fields in
        :mod:`pagedserve.core.trace`), fetched from the core between two of its steps. A
        dashboard polls with the last step it saw + 1. Empty when ``trace_buffer_steps=0``.

        Raises:
            EngineDeadError: the engine core is not running.
        """
        return await self._call_utility("get_step_trace", since_step, limit)

    async def get_block_map(self) -> dict[str, Any]:
        """Every KV block's state and owner now (see :func:`pagedserve.core.trace.block_map`),
        built by the core on this call (O(num_blocks)).

        Raises:
            EngineDeadError: the engine core is not running.
        """
        return await self._call_utility("get_block_map")

    # -- LoRA adapters ---------------------------------------------------------------------------
    async def add_lora(self, lora: LoRARequest) -> None:
        """Register (load and check) an adapter in the engine, under ``lora.lora_name``.

        Raises:
            ValueError: LoRA is off, the name is taken by another adapter, or the engine refused
                the adapter (the message says why).
        """
        have = self.loras.get(lora.lora_name)
        if have is not None:
            if have[0].lora_path == lora.lora_path:
                return
            raise ValueError(f"a LoRA adapter named {lora.lora_name!r} is already loaded")
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora")
        try:
            key = await self._call_utility("add_lora", lora)
        except EngineDeadError:
            raise
        except RuntimeError as e:  # the core's refusal, "add_lora: <why>"
            raise ValueError(str(e).removeprefix("add_lora: ")) from None
        self.loras[lora.lora_name] = (lora, key)

    async def remove_lora(self, name: str) -> bool:
        """Unregister an adapter by name; False when there is none.

        Raises:
            ValueError: live requests use it (retry when they finish).
        """
        entry = self.loras.get(name)
        if entry is None:
            return False
        try:
            await self._call_utility("remove_lora", entry[0].lora_int_id)
        except EngineDeadError:
            raise
        except RuntimeError as e:
            raise ValueError(str(e).removeprefix("remove_lora: ")) from None
        self.loras.pop(name, None)
        return True

    def next_lora_id(self) -> int:
        """An adapter id no registered adapter uses."""
        return max((r.lora_int_id for r, _ in self.loras.values()), default=0) + 1

    async def _call_utility(self, name: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call_id = self.outputs.register_call(loop, fut)
        try:
            self.client.send((Req.UTILITY, UtilityCall(call_id, name, list(args))))
        except BaseException:  # not encodable (a caller's bug): leave no entry behind
            self.outputs.forget_call(call_id)
            raise
        return await fut
