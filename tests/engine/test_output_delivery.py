"""The output thread hands a step's outputs to the consumers' event loops with one wake-up per
loop (``call_each_in_loops``), in order, and skips a loop that has closed."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from pagedserve.engine.loop_handoff import call_each_in_loops
from pagedserve.engine.output_handler import OutputHandler, Stream


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
        call_each_in_loops(calls)
        markers = [threading.Event(), threading.Event()]
        call_each_in_loops([(lp, lambda _, ev=ev: ev.set(), None) for lp, ev in zip(loops, markers)])
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
    open_loop = asyncio.new_event_loop()
    got = []
    try:
        call_each_in_loops([(closed, got.append, 1), (open_loop, got.append, 2)])  # no exception
        open_loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        open_loop.close()
    assert got == [2]


def _handler(streams: dict) -> OutputHandler:
    """An output handler around a stub client and output processor (its thread not started)."""
    handler = OutputHandler(SimpleNamespace(send=lambda msg: None), SimpleNamespace(process_outputs=lambda core: (core.outputs, [])),
                            stats=None)
    handler.streams = streams
    return handler


def test_a_step_wakes_each_consumer_loop_once() -> None:
    loop = CountingLoop()
    try:
        queues = [asyncio.Queue() for _ in range(3)]
        host = _handler({f"r{i}": Stream(loop, q) for i, q in enumerate(queues)})
        outs = [SimpleNamespace(request_id=f"r{i}", finished=i == 2) for i in range(3)]
        host.handle_outputs(SimpleNamespace(outputs=outs, scheduler_stats=None, engine_index=0, num_scheduled_tokens=3))
        loop.run_until_complete(asyncio.sleep(0.01))
        assert loop.threadsafe_calls == 1
        assert [q.get_nowait() for q in queues] == outs
        assert list(host.streams) == ["r0", "r1"]  # the finished request's stream is dropped
    finally:
        loop.close()


def test_a_failing_consumer_does_not_stop_the_others(caplog) -> None:
    loop = asyncio.new_event_loop()
    got = []

    def fail(_):
        raise RuntimeError("consumer bug")

    try:
        call_each_in_loops([(loop, got.append, 0), (loop, fail, 1), (loop, got.append, 2)])
        loop.run_until_complete(asyncio.sleep(0.01))  # runs the scheduled batch
    finally:
        loop.close()
    assert got == [0, 2]
    assert "handing an output to its consumer failed" in caplog.text

