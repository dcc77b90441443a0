"""The output side of :class:`pagedserve.engine.async_llm.AsyncLLM`: one thread receives the
engine core's messages, runs the output processor (detokenization, stop strings) and hands each
``RequestOutput`` to its consumer's event loop, one ``loop.call_soon_threadsafe`` per loop and
step (:mod:`pagedserve.engine.loop_handoff`); it resolves utility calls; when the core dies it
ends every live request. :class:`OutputHandler` owns the state the thread shares with the
callers (streams, pending utility calls, the latest stats), behind one lock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagedserve.core.outputs import SchedulerStats, sum_stats
from pagedserve.engine.llm_engine import log_stats
from pagedserve.engine.loop_handoff import call_each_in_loops, call_soon_in, set_future
from pagedserve.messages import AbortRequests
from pagedserve.messages import EngineCoreEventType as Event
from pagedserve.messages import EngineCoreRequestType as Req

logger = logging.getLogger("pagedserve")

STATS_LOG_INTERVAL_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine core has stopped (shutdown, a crash, or its process died)."""


@dataclass
class Stream:
    """Where one request's outputs go: its consumer's loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class OutputHandler:
    """The output thread and the state it shares with AsyncLLM's callers.

    Args:
        client: the engine-core client (``send``, ``recv``, ``is_alive``).
        output_processor: the :class:`OutputProcessor` (used only under this handler's lock).
        stats: the core's counters before its first step.
        data_parallel_size: > 1 keeps stats and metrics per engine (``engine_index``).
        replica_stats: data parallel: each replica's stats at start.
        metrics: observer with ``observe_stats``, ``observe_step``, ``observe_output`` (and
            ``for_engine``), called from the thread; or None.
        on_engine_dead: called once (from the thread) when the core dies or fails.
    """

    def __init__(
        self,
        client: Any,
        output_processor: Any,
        stats: SchedulerStats,
        *,
        data_parallel_size: int = 1,
        replica_stats: tuple = (),
        metrics: Any = None,
        on_engine_dead: Optional[Callable[[], None]] = None,
    ) -> None:
        self.client = client
        self.output_processor = output_processor
        self.data_parallel_size = data_parallel_size
        self.metrics = metrics
        self.on_engine_dead = on_engine_dead
        self.lock = threading.Lock()  # output processor, streams, stats, utility calls
        self.streams: dict[str, Stream] = {}
        self.not_started: set[str] = set()  # admitted, no output yet (queued or in prefill)
        self._utility_calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._stats = stats
        self._engine_stats: dict[int, SchedulerStats] = dict(enumerate(replica_stats))
        self.error: Optional[str] = None
        self.stopped = False
        self._thread = threading.Thread(target=self._run, name="pagedserve-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return not self.stopped and self.error is None and self._thread.is_alive()

    @property
    def stats(self) -> SchedulerStats:
        with self.lock:
            return self._stats

    def check_alive(self) -> None:
        """Raises EngineDeadError when the core failed or the engine is shut down."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        if self.stopped:
            raise EngineDeadError("engine is shut down")

    def stop(self, timeout_s: float) -> None:
        """After the client's shutdown: let the thread end (live requests get EngineDeadError)."""
        self.stopped = True
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join(timeout_s)

    # -- utility calls ---------------------------------------------------------------------------
    def register_call(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> int:
        """A new call id whose answer resolves ``fut`` in ``loop``. Raises EngineDeadError."""
        call_id = next(self._call_ids)
        with self.lock:
            self.check_alive()
            self._utility_calls[call_id] = (loop, fut)
        return call_id

    def forget_call(self, call_id: int) -> None:
        with self.lock:
            self._utility_calls.pop(call_id, None)

    def _resolve_utility(self, call_id: int, result: Any, error: Optional[str]) -> None:
        with self.lock:
            entry = self._utility_calls.pop(call_id, None)
        if entry is not None:
            loop, fut = entry
            call_soon_in(loop, set_future, fut, result, RuntimeError(error) if error else None)

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        last_log = time.monotonic()
        reason = "engine is shut down"
        try:
            while not self.stopped:
                msg = self.client.recv(0.1)
                if msg is None:
                    if not self.client.is_alive() and not self.stopped:
                        reason = f"engine core process died (exit status {getattr(self.client.proc, 'returncode', '?')})"
                        break
                    continue
                kind, payload = msg
                if kind is Event.OUTPUTS:
                    self.handle_outputs(payload)
                    if time.monotonic() - last_log >= STATS_LOG_INTERVAL_S:
                        last_log = time.monotonic()
                        log_stats(self.stats)
                elif kind is Event.UTILITY:
                    self._resolve_utility(payload.call_id, payload.result, payload.error)
                elif kind is Event.FAILED:  # data parallel: one replica died under these sequences
                    self._fail_sequences(payload.request_ids, payload.reason)
                elif kind is Event.ERROR:
                    reason = f"engine core failed: {payload.kind}: {payload.message}"
                    break
        except BaseException as e:  # a bug in output processing: fail loudly, never hang
            logger.exception("pagedserve output thread crashed")
            reason = f"output processing failed: {e!r}"
            self._fail_all(reason, dead=True)
            return
        self._fail_all(reason, dead=not self.stopped)

    def handle_outputs(self, core_outputs: Any) -> None:
        """One step's :class:`EngineCoreOutputs`: process, observe, hand to the consumers."""
        with self.lock:
            outputs, to_abort = self.output_processor.process_outputs(core_outputs)
            if core_outputs.scheduler_stats is not None:
                if self.data_parallel_size > 1:
                    self._engine_stats[core_outputs.engine_index] = core_outputs.scheduler_stats
                    self._stats = sum_stats(list(self._engine_stats.values()))
                else:
                    self._stats = core_outputs.scheduler_stats
            streams = [(o, self.streams.pop(o.request_id, None) if o.finished else self.streams.get(o.request_id)) for o in outputs]
        if to_abort:
            self.client.send((Req.ABORT, AbortRequests(to_abort)))
        if self.metrics is not None:
            metrics = self.metrics.for_engine(core_outputs.engine_index) if self.data_parallel_size > 1 else self.metrics
            if core_outputs.scheduler_stats is not None:  # new counters (and this step's KV-load times)
                metrics.observe_stats(core_outputs.scheduler_stats)
            metrics.observe_step(core_outputs.num_scheduled_tokens)
            for o in outputs:
                metrics.observe_output(o)
        call_each_in_loops([(stream.loop, stream.queue.put_nowait, out) for out, stream in streams if stream is not None])

    def _fail_sequences(self, child_ids: list[str], reason: str) -> None:
        """End the requests owning these core sequences with EngineDeadError ``reason`` (their
        replica is gone, the server is not)."""
        with self.lock:
            parents = {self.output_processor.sequence_of[c][0].request_id for c in child_ids if c in self.output_processor.sequence_of}
            streams = [self.streams.pop(p, None) for p in parents]
            self.output_processor.abort_requests(list(parents))
        err = EngineDeadError(f"{reason} while running this request")
        call_each_in_loops([(stream.loop, stream.queue.put_nowait, err) for stream in streams if stream is not None])

    def fail_all_requests(self, reason: str) -> None:
        """End every live request now with :class:`EngineDeadError` ``reason`` (the server
        answers 503) and abort them in the core, which keeps running; for a shutdown that
        cannot wait any longer."""
        with self.lock:
            child_ids = self.output_processor.abort_requests(list(self.output_processor.request_states))
        self._fail_all(reason, dead=False)
        if child_ids:
            self.client.send((Req.ABORT, AbortRequests(child_ids)))

    def _fail_all(self, reason: str, dead: bool) -> None:
        with self.lock:
            if dead:
                self.error = reason
                logger.error("pagedserve: %s; failing every live request", reason)
            streams, self.streams = self.streams, {}
            calls, self._utility_calls = self._utility_calls, {}
            self.output_processor.abort_requests(list(self.output_processor.request_states))
        if dead and self.on_engine_dead is not None:  # first: a consumer woken below may check on it
            self.on_engine_dead()
        err = EngineDeadError(reason)
        call_each_in_loops([(stream.loop, stream.queue.put_nowait, err) for stream in streams.values()])
        for loop, fut in calls.values():
            call_soon_in(loop, set_future, fut, None, err)
