"""Benchmark results as data: one JSON line per measurement, appended to
``benchmarks/results/<scenario>.jsonl``, with the host class, the commit and the command beside
the figures, so that two figures are compared only where their hosts and commits say they may be.

A line::

    {"scenario": "kernels", "time": "2026-12-06T10:00:00Z", "commit": "a9a3ce3...",
     "host": {"cpu": "AMD EPYC 7R13 Processor", "class": "avx2", "cores": 2},
     "command": "pagedserve bench kernels --op matmul", "tiny": false, "figures": {...}}

``host.class`` is the CPU's bf16 class, which decides which kernels run: ``amx`` (AMX-BF16),
``avx512bf16`` (AVX512-BF16, no AMX), ``avx2`` (AVX2 + FMA, no AVX-512 BF16) or ``other``.

Where the lines go: ``$PAGEDSERVE_BENCH_RESULTS`` (a directory; ``0`` writes nothing), else
``benchmarks/results/`` of the checkout this package runs from. ``--tiny`` smoke runs write only
where ``$PAGEDSERVE_BENCH_RESULTS`` names a directory, so a smoke run never lands among the
measured figures.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import shlex
import subprocess
import sys
from typing import Any, Optional, Sequence

ENV = "PAGEDSERVE_BENCH_RESULTS"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_class(flags: set[str]) -> str:
    """``amx`` / ``avx512bf16`` / ``avx2`` / ``other`` from a CPU's flags (``platform.cpu_flags``)."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512bf16"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "other"


@functools.lru_cache(maxsize=None)
def host_info() -> dict[str, Any]:
    """``{"cpu": model name, "class": cpu_class, "cores": usable cores}`` of this machine."""
    from pagedserve import platform

    name, flags = platform.cpu_model_name(), set(platform.cpu_flags())
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return {"cpu": name, "class": cpu_class(flags), "cores": cores}


@functools.lru_cache(maxsize=None)
def git_commit(root: str = _ROOT) -> str:
    """``git rev-parse HEAD`` of the checkout at ``root``, or ``"unknown"``."""
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def results_dir(tiny: bool = False) -> Optional[str]:
    """The directory result lines go to, or None when they are not written (see the module doc)."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env in ("", "0") else env
    if tiny:
        return None
    bench = os.path.join(_ROOT, "benchmarks")
    return os.path.join(bench, "results") if os.path.isdir(bench) else None


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command as typed: ``pagedserve ...`` for the CLI, the script's path relative to the
    checkout otherwise."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        prog = argv[0]
        if os.path.basename(prog) in ("pagedserve", "cli.py", "__main__.py"):
            prog = "pagedserve"
        elif os.path.isabs(prog) and prog.startswith(_ROOT + os.sep):
            prog = os.path.relpath(prog, _ROOT)
        argv[0] = prog
    return shlex.join(argv)


def record(
    scenario: str, figures: dict[str, Any], *, tiny: bool = False, command: Optional[str] = None, extra: Optional[dict[str, Any]] = None
) -> Optional[str]:
    """Append one result line for ``scenario`` (``benchmarks/results/<scenario>.jsonl``).

    Args:
        scenario: file stem, e.g. ``"kernels"``, ``"prefix_caching"``.
        figures: the measured numbers (JSON-serialisable; floats are kept as they are).
        tiny: a smoke run (recorded only where ``$PAGEDSERVE_BENCH_RESULTS`` asks for it).
        command: the command line (default: this process's ``sys.argv``).
        extra: more top-level keys (e.g. ``{"model": ...}``).
    Returns:
        The file written, or None when nothing was written.
    """
    out_dir = results_dir(tiny)
    if out_dir is None:
        return None
    line = {
        "scenario": scenario,
        "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "host": host_info(),
        "command": command if command is not None else command_line(),
        "tiny": tiny,
        **(extra or {}),
        "figures": _finite(figures),
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{scenario}.jsonl")
    with open(path, "a") as fh:
        fh.write(json.dumps(line, default=_jsonable, allow_nan=False) + "\n")
    return path


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None (strict JSON), dict keys as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
