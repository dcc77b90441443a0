"""The scheduler's waiting queue, one class per scheduling policy (vLLM v1's
``--scheduling-policy``: ``fcfs`` or ``priority``; see vLLM's ``v1/core/sched/request_queue.py``).

- ``fcfs``: arrival order; a preempted request goes back to the front.
- ``priority``: a min-heap on ``(priority, arrival_time)``: a smaller ``priority`` value runs
  first, ties by arrival, then by insertion (so a preempted request goes after exact ties:
  the n > 1 siblings of one request). Under this policy the scheduler also keeps its running
  list in that order, so the request it preempts first (the list's back) is the one with the
  largest key, as vLLM's. (vLLM keeps running requests in admission order, so there they also
  take the step's token budget in that order; here the smaller key takes it first.)
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator, Protocol

from pagedserve.core.request import Request


def priority_key(req: Request) -> tuple[int, float]:
    """The order of the ``priority`` policy: smaller first."""
    return (req.priority, req.arrival_time)


class RequestQueue(Protocol):
    def add(self, req: Request) -> None: ...
    def prepend(self, req: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> None: ...
    def __iter__(self) -> Iterator[Request]: ...
    def __len__(self) -> int: ...


class FCFSQueue:
    """Arrival order (``add`` appends); ``prepend`` puts a preempted request first."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        """The next request. Raises IndexError when empty."""
        return self._q[0]

    def pop(self) -> Request:
        """Remove and return the next request. Raises IndexError when empty."""
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        """Raises ValueError when ``req`` is not queued."""
        self._q.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)


class PriorityQueue:
    """A heap on :func:`priority_key`; ``prepend`` is ``add`` (the key decides). ``remove``
    marks the entry dead in O(1) and ``peek`` / ``pop`` drop dead entries from the top, so a
    mass abort costs O(n log n), not O(n) a request; when dead entries outnumber the live ones
    (aborts deep in the heap that never surface), the heap is rebuilt from the live ones."""

    def __init__(self) -> None:
        self._heap: list[list] = []  # [priority, arrival_time, seq, request or None when removed]
        self._entries: dict[int, list] = {}  # id(request) -> its live entry
        self._seq = itertools.count()  # ties of equal keys: insertion order, never comparing Requests

    def add(self, req: Request) -> None:
        entry = [*priority_key(req), next(self._seq), req]
        self._entries[id(req)] = entry
        heapq.heappush(self._heap, entry)

    prepend = add

    def _top(self) -> list:
        while self._heap and self._heap[0][-1] is None:
            heapq.heappop(self._heap)
        return self._heap[0]

    def peek(self) -> Request:
        """The next request. Raises IndexError when empty."""
        return self._top()[-1]

    def pop(self) -> Request:
        """Remove and return the next request. Raises IndexError when empty."""
        self._top()
        req = heapq.heappop(self._heap)[-1]
        del self._entries[id(req)]
        return req

    def remove(self, req: Request) -> None:
        """Raises ValueError when ``req`` is not queued."""
        entry = self._entries.pop(id(req), None)
        if entry is None:
            raise ValueError(f"request {req.request_id!r} is not waiting")
        entry[-1] = None
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [e for e in self._heap if e[-1] is not None]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order (sorts a copy)."""
        return (e[-1] for e in sorted(self._entries.values(), key=lambda e: e[:3]))

    def __len__(self) -> int:
        return len(self._entries)


def make_request_queue(policy: str) -> RequestQueue:
    """The queue of ``EngineConfig.scheduling_policy``. Raises ValueError for another name."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be fcfs or priority, got {policy!r}")
