"""What this host is and how pagedserve's kernels are switched, read in one place (torch-free):
the CPU's feature flags and class, the cache folder, available memory, and the ``PAGEDSERVE_*``
kernel switches. ``describe()`` is the start-up log line.

The switches are environment variables (on unless set to ``0``), read when a kernel path is
chosen (weights packed, the C step built), so a test can flip one for a new engine:

- ``PAGEDSERVE_PACK_WEIGHTS``: pack projections for the CPU (oneDNN / AMX / AVX2 layouts);
- ``PAGEDSERVE_AMX``: the AMX bf16 matmul; ``PAGEDSERVE_AVX2_GEMM``: the AVX2 bf16 matmul;
- ``PAGEDSERVE_SMALL_GEMM``: the small-M matmul on oneDNN's buffers;
- ``PAGEDSERVE_CPU_KERNELS``: every compiled C kernel (off: PyTorch ops only);
- ``PAGEDSERVE_TRITON_ATTENTION``: the Triton paged-attention kernel on CUDA (off: PyTorch's
  gather + SDPA).

``PAGEDSERVE_CACHE`` names the cache folder (default ``~/.cache/pagedserve``): converted GGUF
models under ``gguf/``, compiled kernels under ``kernels/``.
"""

from __future__ import annotations

import functools
import os
import sys

KERNEL_SWITCHES = (
    "PAGEDSERVE_PACK_WEIGHTS",
    "PAGEDSERVE_AMX",
    "PAGEDSERVE_AVX2_GEMM",
    "PAGEDSERVE_SMALL_GEMM",
    "PAGEDSERVE_CPU_KERNELS",
    "PAGEDSERVE_TRITON_ATTENTION",
)


def switch_on(name: str) -> bool:
    """Whether kernel switch ``name`` (one of :data:`KERNEL_SWITCHES`) is on (not ``0``).

    Raises:
        KeyError: an unknown switch name (a typo would silently read as on).
    """
    if name not in KERNEL_SWITCHES:
        raise KeyError(f"unknown kernel switch {name!r} (known: {', '.join(KERNEL_SWITCHES)})")
    return os.environ.get(name, "1") != "0"


def cache_dir() -> str:
    """The cache folder: ``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``."""
    return os.environ.get("PAGEDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve"))


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (e.g. ``avx2``, ``avx512_bf16``,
    ``amx_bf16``); empty where unreadable (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_has_bf16() -> bool:
    """AVX-512 BF16 or AMX-BF16: bf16 arithmetic in hardware."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_class() -> str:
    """``amx`` (AMX-BF16), ``avx512bf16``, ``avx512``, ``avx2`` (with FMA) or ``other``: the
    classes whose kernels differ (reported with every benchmark figure)."""
    f = cpu_flags()
    if {"amx_bf16", "amx_tile"} <= f:
        return "amx"
    if "avx512_bf16" in f:
        return "avx512bf16"
    if "avx512f" in f:
        return "avx512"
    if {"avx2", "fma"} <= f:
        return "avx2"
    return "other"


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); else physical pages x page size; 0 if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def describe() -> str:
    """One line for the start-up log: CPU, class, cores, switches that are off, cache folder."""
    off = [name for name in KERNEL_SWITCHES if not switch_on(name)]
    return (
        f"{cpu_model_name()} ({cpu_class()}, {os.cpu_count()} cores), kernels: "
        f"{'all on' if not off else 'off: ' + ', '.join(off)}, cache {cache_dir()}"
    )


def block_torch_import() -> None:
    """Make ``import torch`` fail in this process (a server front, whose engine core runs in
    another process): transformers then loads tokenizers and configs without torch, and the
    front stays small (no torch in its memory). Children do not inherit it. Has no effect when
    torch is already imported."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
