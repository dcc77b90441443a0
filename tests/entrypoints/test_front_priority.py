"""``--frontend-nice``: every thread of the front takes the value, threads started later inherit
it, a thread's priority is never raised, and a refusal is logged, not raised."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.entrypoints.openai import run_server

CHILD = """
import os, threading
from pagedserve.entrypoints.openai.run_server import lower_thread_priority
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
threads = len(os.listdir("/proc/self/task"))  # the main thread, the early one, any the imports started
first = lower_thread_priority(NICE)
late_nice = []
late = threading.Thread(target=lambda: late_nice.append(os.getpriority(os.PRIO_PROCESS, 0))); late.start(); late.join()
again = lower_thread_priority(NICE)
nices = sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))
stop.set(); early.join()
print(threads, first, again, late_nice[0], nices)
"""


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.strip().strip("[]").split(",")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are Linux's")
def test_every_thread_and_later_ones_take_the_value() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nice = min(base + 3, 19)
    if nice == base:
        pytest.skip("the runner is already at nice 19")
    out = subprocess.run([sys.executable, "-c", CHILD.replace("NICE", str(nice))], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    threads, first, again, late, nices = out.stdout.split(" ", 4)
    assert int(threads) >= 2 and int(first) == int(threads) and int(again) == 0  # every thread there; nothing left
    assert int(late) == nice
    nices = parse_ints(nices)
    assert len(nices) >= 2 and set(nices) == {nice}  # (a joined thread may linger in /proc a moment)


def test_zero_changes_nothing() -> None:
    assert run_server.lower_thread_priority(0) == 0


def test_a_refusal_is_logged_not_raised(monkeypatch, caplog) -> None:
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(run_server.os, "getpriority", lambda which, who: -20)
    monkeypatch.setattr(run_server.os, "setpriority", refuse)
    assert run_server.lower_thread_priority(10) == 0
    assert "--frontend-nice 10 not applied" in caplog.text
