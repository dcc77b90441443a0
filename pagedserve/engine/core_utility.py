"""Calls into the engine core that are not requests (vLLM's "utility" calls), for
:class:`pagedserve.engine.async_llm.AsyncLLM`: each sends ``["utility", call_id, name, args]``
and awaits the core's answer, which the output thread resolves between two steps.

The class is a mixin: it uses the host's ``client``, ``_lock``, ``_call_ids``,
``_utility_calls``, ``_check_alive``, ``_stopped`` and ``_error``.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from pagedserve.engine.loop_handoff import call_soon_in, set_future


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
            call_soon_in(loop, set_future, fut, result, RuntimeError(error) if error else None)
