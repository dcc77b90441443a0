"""The server front's threads yield the cores to the engine's compute threads (``--frontend-nice``).

On cores the engine saturates, each wake-up of a front thread (HTTP, tokenizing, detokenizing,
the output thread) preempted one of the engine core's OpenMP threads mid step, and its partner
then waited for it at the next barrier: W1 over HTTP on 2 cores ran ~8 % slower steps than
offline although the front used ~0.3 s of CPU in 13 s. At nice 10 the scheduler lets the front
run when a compute thread yields instead (docs/perf-history.md, "the front yields to the
engine": 1.02-1.11x in 7 of 8 pairs). Where a core is free, a nice value has no effect.

Processes the front forks afterwards inherit the value: call this after the engine's processes
have started. The chat template render process (``chat_template.py``), started on first use,
runs at it; its time bound starts once it is ready.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("pagedserve")


def lower_thread_priority(nice: int) -> int:
    """Set every thread of this process to a nice value of at least ``nice`` (Linux, where a
    nice value is per thread and new threads inherit their creator's; elsewhere, or with
    ``nice <= 0``, nothing). Never makes a thread's priority higher. Passes again until no
    thread changes, so that threads started meanwhile are caught. Returns how many threads
    changed. A refusal (a sandbox forbidding ``setpriority``) is logged, never raised: the
    server runs as before."""
    if nice <= 0 or not os.path.isdir("/proc/self/task"):
        return 0
    total = 0
    while True:
        changed = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                if os.getpriority(os.PRIO_PROCESS, int(tid)) < nice:
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                    changed += 1
            except ProcessLookupError:  # the thread has ended
                pass
            except OSError as e:
                logger.warning("pagedserve: --frontend-nice %d not applied: %s", nice, e)
                return total + changed
        total += changed
        if not changed:
            return total
