"""The output thread hands a step's outputs to the consumers' event loops with one wake-up per
loop (``_put_each``), in order, and skips a loop that has closed."""
from __future__ import annotations

import asyncio
import threading

from pagedserve.engine.core_utility import _put_each


class CountingLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self.threadsafe_calls = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def _run_loop(loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
    asyncio.set_event_loop(loop)

    async def wait() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.005)

    loop.run_until_complete(wait())


def test_one_wakeup_per_loop_in_order() -> None:
    loops = [CountingLoop(), CountingLoop()]
    stop = threading.Event()
    threads = [threading.Thread(target=_run_loop, args=(lp, stop), daemon=True) for lp in loops]
    for t in threads:
        t.start()
    try:
        got: list[list[tuple[str, int]]] = [[], []]
        calls = []
        for i in range(10):  # interleaved between the two loops, as one step's outputs can be
            k = i % 2
            calls.append((loops[k], lambda x, k=k: got[k].append((threading.current_thread().name, x)), i))
        _put_each(calls)
        markers = [threading.Event(), threading.Event()]
        _put_each([(lp, lambda _, ev=ev: ev.set(), None) for lp, ev in zip(loops, markers)])
        assert all(ev.wait(5) for ev in markers)
        assert [x for _, x in got[0]] == [0, 2, 4, 6, 8]
        assert [x for _, x in got[1]] == [1, 3, 5, 7, 9]
        assert {name for name, _ in got[0]} == {threads[0].name}
        assert {name for name, _ in got[1]} == {threads[1].name}
        assert [lp.threadsafe_calls for lp in loops] == [2, 2]  # one wake-up per batch and loop
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for lp in loops:
            lp.close()


def test_closed_loop_is_skipped() -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    got = []
    _put_each([(closed, got.append, 1)])  # no exception: the consumer went away
    assert got == []
