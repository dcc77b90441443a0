"""AsyncLLM: an :class:`LLMEngine` stepped by a background thread, driven from asyncio.

``LLMEngine`` is not thread-safe, so exactly one thread (the *engine thread*) ever calls into
it. Everything else talks to that thread through a command list guarded by one condition
variable:

* ``generate()`` queues an *add* command and awaits a future that the engine thread resolves
  with ``None`` (queued) or the ``ValueError`` that ``add_request`` raised.
* ``abort()`` queues an *abort* command (it never blocks, so it is safe in ``finally`` blocks
  of cancelled tasks).
* After each ``step()`` the engine thread hands every ``RequestOutput`` to the asyncio loop of
  its consumer with ``loop.call_soon_threadsafe(queue.put_nowait, output)``.

The thread sleeps on the condition while there is no command and no unfinished request, so an
idle server costs nothing. HTTP handlers only ever enqueue and await: a long forward pass never
blocks the event loop, and a flood of requests never blocks the engine.

A consumer that stops iterating ``generate()`` (``break``, ``aclose()``, task cancellation,
client disconnect) aborts its request at once: its KV blocks go back to the pool in the engine
thread's next pass.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown, or a crash); no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    cache_salt: Optional[str]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _resolve(fut: asyncio.Future, result: Any = None, exc: Optional[BaseException] = None) -> None:
    """Set a future's outcome unless its waiter has gone (runs on the future's loop)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncLLM:
    """Serve an :class:`LLMEngine` to asyncio code.

    Args:
        engine: the engine; from now on only this object's thread may call into it.
        metrics: optional observer (see :class:`pagedserve.metrics.EngineMetrics`) with
            ``observe_stats(stats)``, ``observe_output(output)`` and ``observe_abort(request_id)``,
            called on the engine thread.

    Example::

        llm = AsyncLLM(LLMEngine(EngineConfig()))
        async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
            print(out.outputs[0].text)
        llm.shutdown()
    """

    def __init__(self, engine: LLMEngine, metrics: Any = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._cv = threading.Condition()
        self._commands: list[Any] = []
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._error: Optional[BaseException] = None
        self._stats: dict[str, Any] = engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    # -- public API (any thread / event loop) -------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    @property
    def errored(self) -> bool:
        return self._error is not None

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        cache_salt: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs (as ``params.output_kind`` shapes them) until it
        finishes.

        Leaving the iteration early (break/aclose/cancellation) aborts the request.

        Raises:
            ValueError: the engine refused the request (message names the field), or
                ``request_id`` is in use.
            EngineDeadError: the engine thread is not running.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        with self._cv:
            self._check_alive()
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = _Stream(loop, queue)
            self._commands.append(_Add(request_id, prompt, params, time.monotonic(), cache_salt, loop, added))
            self._cv.notify()
        finished = False
        refused = False
        try:
            try:
                await added
            except BaseException as e:
                refused = not isinstance(e, asyncio.CancelledError)
                raise
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already dropped it
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if refused:
                # Never reached the engine; drop only our own stream entry.
                with self._cv:
                    if self._streams.get(request_id) is not None and self._streams[request_id].queue is queue:
                        del self._streams[request_id]
            elif not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it is unknown or done). Never blocks on the engine."""
        with self._cv:
            self._streams.pop(request_id, None)
            if self._stopped:
                return
            self._commands.append(_Abort(request_id))
            self._cv.notify()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            self._check_alive()
            self._commands.append(_Call(fn, loop, fut))
            self._cv.notify()
        return await fut

    def get_stats(self) -> dict[str, Any]:
        """The engine's counters (see ``LLMEngine.get_stats``) as of the last step or command."""
        with self._cv:
            return dict(self._stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; live requests end with EngineDeadError."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- engine thread ----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}")
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("engine is shut down")

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        with self._cv:
            stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed
                pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._commands and not self._stopped and not engine.has_unfinished_requests():
                        self._cv.wait()
                    if self._stopped:
                        break
                    commands, self._commands = self._commands, []
                for cmd in commands:
                    self._handle(cmd)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    for out in outputs:
                        if self.metrics is not None:
                            self.metrics.observe_output(out)
                        self._deliver(out.request_id, out, out.finished)
                self._refresh_stats()
        except BaseException as e:  # a bug in the engine: fail every live request loudly
            logger.exception("pagedserve engine thread crashed")
            self._error = e
        finally:
            with self._cv:
                self._stopped = True
                streams, self._streams = self._streams, {}
                pending, self._commands = self._commands, []
            err = EngineDeadError(f"engine failed: {self._error!r}" if self._error else "engine is shut down")
            for rid, stream in streams.items():
                try:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
                except RuntimeError:
                    pass
            for cmd in pending:
                if isinstance(cmd, (_Add, _Call)):
                    try:
                        cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, err)
                    except RuntimeError:
                        pass

    def _handle(self, cmd: Any) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            with self._cv:
                wanted = cmd.request_id in self._streams
            if not wanted:  # aborted before it was even queued
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, None)
                return
            try:
                engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time, cache_salt=cmd.cache_salt)
            except Exception as e:  # ValueError: invalid request; nothing was queued
                with self._cv:
                    self._streams.pop(cmd.request_id, None)
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, e)
                return
            cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, None)
        elif isinstance(cmd, _Abort):
            before = engine.get_num_unfinished_requests()
            engine.abort_request(cmd.request_id)
            if self.metrics is not None and engine.get_num_unfinished_requests() < before:
                self.metrics.observe_abort(cmd.request_id)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(engine)
            except Exception as e:
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, None, e)
            else:
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, result, None)

    def _refresh_stats(self) -> None:
        stats = self.engine.get_stats()
        with self._cv:
            self._stats = stats
        if self.metrics is not None:
            self.metrics.observe_stats(stats)
