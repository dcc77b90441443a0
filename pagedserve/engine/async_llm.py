"""AsyncLLM: the serving frontend. Requests are validated and tokenized here, the engine core
runs beside it (its own process by default, see :mod:`pagedserve.engine.core_client`), and
outputs are detokenized here and handed to asyncio consumers (vLLM v1's ``AsyncLLM`` shape).

* ``generate()`` runs the :class:`InputProcessor` on the caller's event loop (a bad request
  raises at once and never reaches the core), registers the request with the
  :class:`OutputProcessor`, sends it to the core, and yields its outputs.
* One *output thread* receives the core's per-step outputs, runs the output processor
  (detokenization, stop strings: a sequence that hits one is aborted in the core), and hands
  each ``RequestOutput`` to its consumer's loop, one ``loop.call_soon_threadsafe`` per loop
  and step (:mod:`pagedserve.engine.loop_handoff`).
* A consumer that stops iterating (``break``, ``aclose()``, cancellation, client disconnect)
  aborts its request at once; the core frees its blocks before its next step.
* If the core dies (even by SIGKILL) or fails a step, every live request ends with
  :class:`EngineDeadError`, ``errored`` turns True and ``on_engine_dead`` is called; nothing hangs.
* With ``data_parallel_size`` N > 1 the client is a :class:`pagedserve.engine.dp_client.DPClient`
  (N replicas, one router): stats and metrics are kept per engine (``get_stats`` sums them),
  and a replica's death ends only the requests it was running (``["failed", ids, reason]``).
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import SchedulerStats
from pagedserve.engine.core_utility import CoreUtilityCalls
from pagedserve.engine.input_processor import ProcessedRequest, PromptType, RequestError
from pagedserve.engine.llm_engine import make_processors, served_model_names
from pagedserve.engine.output_thread import EngineDeadError, OutputThread
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM(CoreUtilityCalls, OutputThread):
    """Serve one model to asyncio code.

    Args:
        config: the engine's configuration.
        engine_process: run the engine core in its own process (default) or in a thread.
        metrics: optional observer (:class:`pagedserve.metrics.EngineMetrics`) with
            ``observe_stats``, ``observe_output`` and ``observe_abort``, called from the
            output thread.
        on_engine_dead: called once (from the output thread) when the core dies or fails.

    Raises:
        ValueError / FileNotFoundError: invalid config or model (from the core's start-up).

    Example::

        llm = AsyncLLM(EngineConfig())
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
            print(out.outputs[0].text)
        llm.shutdown()
    """

    def __init__(self, config: EngineConfig, *, engine_process: bool = True, metrics: Any = None,
                 on_engine_dead: Optional[Callable[[], None]] = None, log_level: str = "info") -> None:
        from pagedserve.engine.core_client import MPClient, ThreadClient
        from pagedserve.model.loader import resolve_model

        resolve_model(config.model)  # convert a GGUF file once, here, before the core starts
        config = config.with_serving_defaults()  # e.g. the bounded step time: latency matters online
        self.data_parallel_size = config.data_parallel_size
        if self.data_parallel_size > 1:
            if not engine_process:
                raise ValueError("data_parallel_size > 1 needs engine processes (engine_process=True)")
            from pagedserve.engine.dp_client import DPClient

            self.client = DPClient(config, log_level)
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
        self.metrics = metrics
        self.on_engine_dead = on_engine_dead
        self._lock = threading.Lock()  # output processor, streams, stats
        self._streams: dict[str, _Stream] = {}
        self._not_started: set[str] = set()  # admitted, no output yet (queued or in prefill)
        self._preparing = 0  # HTTP requests inside admission(), not yet handed to the core
        self.max_queued_requests: Optional[int] = None  # beyond it, new requests get 503
        self.draining = False  # set by the server when it stops admitting (SIGTERM)
        self._utility_calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stats = SchedulerStats(num_total_blocks=info.num_blocks, num_free_blocks=info.num_blocks)
        # Data parallel: each replica's latest stats.
        self._engine_stats: dict[int, SchedulerStats] = dict(enumerate(getattr(self.client, "replica_stats", ())))
        self._error: Optional[str] = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run_output_loop, name="pagedserve-output", daemon=True)
        self._thread.start()

    # -- public API (any event loop) ------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self._stopped and self._error is None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        return self._error is not None

    @property
    def engine_pid(self) -> int:
        return self.client.pid

    def get_stats(self) -> SchedulerStats:
        """The core's counters as of its last step or command."""
        with self._lock:
            return self._stats

    def replica_status(self) -> Optional[list[dict[str, Any]]]:
        """Data parallel: each replica's state (see ``DPClient.replica_status``); else None."""
        return self.client.replica_status() if self.data_parallel_size > 1 else None

    def num_unfinished_requests(self) -> int:
        with self._lock:
            return self.output_processor.get_num_unfinished_requests()

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       cache_salt: Optional[str] = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Validate an offline-style prompt (see ``InputProcessor.process``) and stream its outputs.

        Raises:
            ValueError: the request is invalid (the message names the field) or the id is in use.
            EngineDeadError: the engine core is not running.
        """
        processed = self.input_processor.process(request_id, prompt, params, cache_salt=cache_salt, priority=priority)
        async for out in self.generate_processed(processed):
            yield out

    async def generate_processed(self, req: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        """Stream the outputs (as ``params.output_kind`` shapes them) of a request the input
        processor made, until it finishes. Leaving early aborts it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._check_alive()
            self.output_processor.add_request(req)  # ValueError on a duplicate id
            self._streams[req.request_id] = _Stream(loop, queue)
            self._not_started.add(req.request_id)
        try:
            self.client.send(["add", req.children])
        except BaseException:
            with self._lock:
                self._streams.pop(req.request_id, None)
                self._not_started.discard(req.request_id)
                self.output_processor.abort_requests([req.request_id])
            raise
        finished = False
        started = False
        try:
            while True:
                item = await queue.get()
                if not isinstance(item, BaseException) and not started:
                    started = True
                    with self._lock:
                        self._not_started.discard(req.request_id)
                if isinstance(item, BaseException):
                    finished = True  # the output thread already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._not_started.discard(req.request_id)
            if not finished:
                self.abort(req.request_id)

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Admit one HTTP request for preparation (tokenizing, rendering), or raise RequestError
        503 with ``Retry-After`` when ``max_queued_requests`` requests are already waiting to
        start (requests being prepared count), so an overloaded server says so at once instead
        of queueing without end."""
        with self._lock:
            self._check_capacity()
            self._preparing += 1
        try:
            yield
        finally:
            with self._lock:
                self._preparing -= 1

    def _check_capacity(self) -> None:
        waiting = len(self._not_started) + self._preparing
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            raise RequestError(f"the server is overloaded: {waiting} requests are waiting to start; retry later.",
                               status_code=503, err_type="ServiceUnavailableError", headers={"Retry-After": "1"})

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or done). Never blocks on the core."""
        with self._lock:
            self._streams.pop(request_id, None)
            child_ids = self.output_processor.abort_requests([request_id])
        if child_ids:
            metrics = self.metrics
            if metrics is not None and self.data_parallel_size > 1:
                metrics = metrics.for_engine(self.client.engine_of(child_ids[0]))
            self.client.send(["abort", child_ids])
            if metrics is not None:
                metrics.observe_abort(request_id, len(child_ids))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core and the output thread; live requests end with EngineDeadError."""
        self._stopped = True
        self.client.shutdown(timeout_s)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # -- output thread (the loop itself: pagedserve.engine.output_thread) ------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}")
        if self._stopped:
            raise EngineDeadError("engine is shut down")
