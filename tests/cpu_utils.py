"""What the test host's CPU has (Linux /proc/cpuinfo), for tests of one kernel path."""
from __future__ import annotations


def cpu_flags() -> set:
    """The first CPU's feature flags (e.g. "avx2", "avx512_bf16"); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
