"""Calls into the engine core that are not requests (vLLM's "utility" calls), for
:class:`pagedserve.engine.async_llm.AsyncLLM`: each sends ``["utility", call_id, name, args]``
and awaits the core's answer, which the output thread resolves between two steps.

The class is a mixin: it uses the host's ``client``, ``_lock``, ``_call_ids``,
``_utility_calls``, ``_check_alive``, ``_stopped`` and ``_error``.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional


class CoreUtilityCalls:
    """``reset_prefix_cache``, ``get_step_trace`` and ``get_block_map`` on the engine core."""

    async def reset_prefix_cache(self) -> bool:
        return await self._call_utility("reset_prefix_cache")

    def release_kv_transfer(self, params: dict) -> None:
        """A refused request named a prefill instance's KV hold: have the core release it (a
        one-way command, ``["release_kv", params]``; nothing to await)."""
        if not self._stopped and self._error is None:
            self.client.send(["release_kv", params])

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

    async def _call_utility(self, name: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._check_alive()
            self._utility_calls[call_id] = (loop, fut)
        try:
            self.client.send(["utility", call_id, name, list(args)])
        except BaseException:  # not encodable (a caller's bug): leave no entry behind
            with self._lock:
                self._utility_calls.pop(call_id, None)
            raise
        return await fut

    def _resolve_utility(self, call_id: int, result: Any, error: Optional[str]) -> None:
        with self._lock:
            entry = self._utility_calls.pop(call_id, None)
        if entry is not None:
            loop, fut = entry
            _put(loop, _set_future, fut, result, RuntimeError(error) if error else None)


def _set_future(fut: asyncio.Future, result: Any, exc: Optional[BaseException]) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


def _put(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed
        pass


def _put_each(calls: list[tuple[asyncio.AbstractEventLoop, Callable, Any]]) -> None:
    """``fn(arg)`` for each ``(loop, fn, arg)`` on its loop, in order, with one wake-up of each
    loop: one ``call_soon_threadsafe`` per loop instead of one per call (each writes to the
    loop's self-pipe and wakes its thread, which then contends for the GIL)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable, Any]]] = {}
    for loop, fn, arg in calls:
        by_loop.setdefault(loop, []).append((fn, arg))
    for loop, items in by_loop.items():
        _put(loop, _call_each, items)


def _call_each(items: list[tuple[Callable, Any]]) -> None:
    for fn, arg in items:
        fn(arg)
