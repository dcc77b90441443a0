"""Utility calls (:class:`pagedserve.messages.UtilityCall`) fanned out to data-parallel replicas
by :class:`pagedserve.engine.dp_client.DPClient`, and their answers combined into the one
UTILITY message (:class:`pagedserve.messages.UtilityResult`) AsyncLLM awaits.

``reset_prefix_cache`` goes to every live replica and is True only when each reset; every
other call goes to the first live replica. A replica that dies stops being waited for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedserve.messages import EngineCoreEventType, UtilityResult

BROADCAST_UTILITIES = ("reset_prefix_cache", "add_lora", "remove_lora")


@dataclass
class _UtilityCall:
    name: str
    waiting: set[int]
    results: list[Any] = field(default_factory=list)
    error: Optional[str] = None


class UtilityFanout:
    """The utility calls in flight; each method returns the messages now complete (a list,
    usually empty or of one). Not thread-safe: DPClient calls it under its lock."""

    def __init__(self) -> None:
        self._calls: dict[int, _UtilityCall] = {}

    @staticmethod
    def targets(name: str, alive: list[bool]) -> list[int]:
        """The replicas a call named ``name`` goes to."""
        live = [i for i, ok in enumerate(alive) if ok]
        return live if name in BROADCAST_UTILITIES else live[:1]

    def start(self, call_id: int, name: str, targets: list[int]) -> list[tuple]:
        self._calls[call_id] = _UtilityCall(name, set(targets))
        return [] if targets else [self._finish(call_id, "no engine replica is alive")]

    def answer(self, replica: int, call_id: int, result: Any, error: Optional[str]) -> list[tuple]:
        """Replica ``replica`` answered call ``call_id`` (unknown ids are ignored)."""
        call = self._calls.get(call_id)
        if call is None:
            return []
        call.waiting.discard(replica)
        call.results.append(result)
        call.error = call.error or error
        return [] if call.waiting else [self._finish(call_id)]

    def replica_died(self, replica: int, reason: str) -> list[tuple]:
        """Stop waiting for ``replica``; a call left with no answer at all fails with ``reason``."""
        done = []
        for call_id, call in list(self._calls.items()):
            if replica in call.waiting:
                call.waiting.discard(replica)
                if not call.waiting:
                    done.append(self._finish(call_id, None if call.results else reason))
        return done

    def _finish(self, call_id: int, error: Optional[str] = None) -> tuple:
        call = self._calls.pop(call_id)
        error = error or call.error
        if call.name == "reset_prefix_cache":
            result = bool(call.results) and all(call.results)
        else:
            result = call.results[0] if call.results else None
        return (EngineCoreEventType.UTILITY, UtilityResult(call_id, None if error else result, error))
