"""What the test host's CPU has, for tests of one kernel path (read by ``pagedserve.platform``)."""
from __future__ import annotations

from pagedserve import platform


def cpu_flags() -> set:
    """The first CPU's feature flags (e.g. "avx2", "avx512_bf16"); empty where unreadable."""
    return set(platform.cpu_flags())
