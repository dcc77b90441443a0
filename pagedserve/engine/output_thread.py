"""The output thread of :class:`pagedserve.engine.async_llm.AsyncLLM`: it receives the engine
core's messages, runs the output processor (detokenization, stop strings) and hands each
``RequestOutput`` to its consumer's event loop; when the core dies it ends every live request.

The class is a mixin: it uses the host's ``client``, ``_lock``, ``_streams``,
``output_processor``, ``metrics``, ``data_parallel_size``, ``_stats``, ``_engine_stats``,
``_utility_calls``, ``_resolve_utility``, ``on_engine_dead``, ``_stopped`` and ``_error``.
"""
from __future__ import annotations

import logging
import time

from pagedserve.engine.loop_handoff import call_each_in_loops, call_soon_in, set_future
from pagedserve.engine.llm_engine import log_stats

logger = logging.getLogger("pagedserve")

STATS_LOG_INTERVAL_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine core has stopped (shutdown, a crash, or its process died)."""


class OutputThread:
    """``_run_output_loop`` (the thread's body) and the ways live requests end early."""

    def _run_output_loop(self) -> None:
        last_log = time.monotonic()
        reason = "engine is shut down"
        try:
            while not self._stopped:
                msg = self.client.recv(0.1)
                if msg is None:
                    if not self.client.is_alive() and not self._stopped:
                        reason = f"engine core process died (exit status {getattr(self.client.proc, 'returncode', '?')})"
                        break
                    continue
                kind = msg[0]
                if kind == "outputs":
                    self._handle_outputs(msg[1])
                    if time.monotonic() - last_log >= STATS_LOG_INTERVAL_S:
                        last_log = time.monotonic()
                        log_stats(self.get_stats())
                elif kind == "utility":
                    self._resolve_utility(msg[1], msg[2], msg[3])
                elif kind == "failed":  # data parallel: one replica died under these sequences
                    self._fail_sequences(msg[1], msg[2])
                elif kind == "error":
                    reason = f"engine core failed: {msg[1]}: {msg[2]}"
                    break
        except BaseException as e:  # a bug in output processing: fail loudly, never hang
            logger.exception("pagedserve output thread crashed")
            reason = f"output processing failed: {e!r}"
            self._fail_all(reason, dead=True)
            return
        self._fail_all(reason, dead=not self._stopped)

    def _handle_outputs(self, core_outputs) -> None:
        with self._lock:
            outputs, to_abort = self.output_processor.process_outputs(core_outputs)
            if core_outputs.scheduler_stats is not None:
                if self.data_parallel_size > 1:
                    from pagedserve.core.outputs import sum_stats

                    self._engine_stats[core_outputs.engine_index] = core_outputs.scheduler_stats
                    self._stats = sum_stats(list(self._engine_stats.values()))
                else:
                    self._stats = core_outputs.scheduler_stats
            streams = [(o, self._streams.pop(o.request_id, None) if o.finished else self._streams.get(o.request_id)) for o in outputs]
        if to_abort:
            self.client.send(["abort", to_abort])
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
        with self._lock:
            parents = {self.output_processor.sequence_of[c][0].request_id for c in child_ids if c in self.output_processor.sequence_of}
            streams = [self._streams.pop(p, None) for p in parents]
            self.output_processor.abort_requests(list(parents))
        err = EngineDeadError(f"{reason} while running this request")
        call_each_in_loops([(stream.loop, stream.queue.put_nowait, err) for stream in streams if stream is not None])

    def fail_all_requests(self, reason: str) -> None:
        """End every live request now with :class:`EngineDeadError` ``reason`` (the server
        answers 503) and abort them in the core, which keeps running; for a shutdown that
        cannot wait any longer."""
        with self._lock:
            child_ids = self.output_processor.abort_requests(list(self.output_processor.request_states))
        self._fail_all(reason, dead=False)
        if child_ids:
            self.client.send(["abort", child_ids])

    def _fail_all(self, reason: str, dead: bool) -> None:
        with self._lock:
            if dead:
                self._error = reason
                logger.error("pagedserve: %s; failing every live request", reason)
            streams, self._streams = self._streams, {}
            calls, self._utility_calls = self._utility_calls, {}
            self.output_processor.abort_requests(list(self.output_processor.request_states))
        if dead and self.on_engine_dead is not None:  # first: a consumer woken below may check on it
            self.on_engine_dead()
        err = EngineDeadError(reason)
        call_each_in_loops([(stream.loop, stream.queue.put_nowait, err) for stream in streams.values()])
        for loop, fut in calls.values():
            call_soon_in(loop, set_future, fut, None, err)
