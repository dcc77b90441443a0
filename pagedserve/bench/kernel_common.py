"""What every ``pagedserve bench kernels`` op shares: the shapes, alternating timing rounds, one
result row per case, and building peer variants of the C libraries (another ISA cap, another revision)."""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import subprocess
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    pass  # imported where used: the CLI parser (and a server front) must not load torch


OPS = ("matmul", "attention", "fused", "kv_int8", "step", "sampler", "qmatmul")
MATMUL_SHAPES = {  # (out, in) of qkv, o, gate_up, down; layers
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 4),
}
HEAD_DIM, BLOCK = 64, 16


# -- timing --------------------------------------------------------------------------------
def alternate(fns: dict[str, Callable[[], Any]], rounds: int, reps: int = 1) -> dict[str, dict[str, float]]:
    """One warm-up call of each side, then ``rounds`` rounds alternating the sides (each ``reps``
    calls); per side the median and minimum ms per call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t0) / reps * 1e3)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v)} for k, v in times.items()}


def _case(op: str, case: str, sides: dict[str, dict[str, float]], base: str, work: Optional[dict[str, float]] = None, **extra: Any) -> dict[str, Any]:
    """A result: the sides' times, each side's median over ``base``'s, and per side the rate of
    ``work`` (e.g. ``{"GB/s": bytes / 1e9}``: units per second)."""
    b = sides[base]["median_ms"]
    for s in sides.values():
        for unit, amount in (work or {}).items():
            s[unit] = amount / (s["median_ms"] / 1e3)
    res = {
        "op": op,
        "case": case,
        "base": base,
        "sides": sides,
        "ratio_to_base": {k: v["median_ms"] / b for k, v in sides.items() if k != base},
        **extra,
    }
    rates = lambda s: "".join(f", {s[u]:.1f} {u}" for u in (work or {}))  # noqa: E731
    line = ", ".join(f"{k} {v['median_ms']:.3f} ms ({'min %.3f' % v['min_ms']}{rates(v)})" for k, v in sides.items())
    ratios = "; ".join(f"{k} / {base} = {r:.2f}x" for k, r in res["ratio_to_base"].items())
    print(f"{op} | {case}: {line}" + (f"; {ratios}" if ratios else ""), flush=True)
    return res


# -- building peers --------------------------------------------------------------------------
def _rev_csrc(rev: str, tmp: str) -> str:
    """``csrc/`` of git revision ``rev``, extracted under ``tmp``."""
    from pagedserve.ops.cpu import build

    root = build._CSRC
    for _ in range(4):  # the checkout: csrc is pagedserve/ops/cpu/csrc
        root = os.path.dirname(root)
    rel = os.path.relpath(build._CSRC, root)
    out = os.path.join(tmp, "rev")
    os.makedirs(out, exist_ok=True)
    tree = subprocess.run(["git", "archive", rev, rel], cwd=root, check=True, stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-f", "-", "-C", out], input=tree, check=True)
    return os.path.join(out, rel)


_variants: dict[str, ctypes.CDLL] = {}
# Each library's one source before csrc/ was split into units (176ec54): --rev of an older revision.
_UNITY_SOURCES = {"paged_attention": "paged_attention.c", "fused_ops": "fused_ops.c", "decode": "decode_step.c"}
# Build-time caps (``-DPS_ISA_CAP``, csrc/common/cpu.h): the same units, run at a lower ISA level.
CAP_AVX512BF16 = "-DPS_ISA_CAP=PS_ISA_AVX512BF16"  # no AMX: the AVX-512 (AVX512-BF16) paths
CAP_SCALAR = "-DPS_ISA_CAP=PS_ISA_SCALAR"  # the generic C loops


def build_variant(lib: str, flags: list[str], tmp: str, tag: str, csrc: Optional[str] = None) -> ctypes.CDLL:
    """The engine's library ``lib`` ("paged_attention", "fused_ops", "decode") built as the engine
    builds it (``build.build_library``: its units, each with its ISA's flags) with ``flags`` added
    to every unit (e.g. ``CAP_AVX512BF16``: the same code capped below AMX), from ``csrc`` (default
    this tree's), its functions declared. A ``csrc`` from before the units (one source per
    library, as ``--rev`` of an older revision gives) is built as it was then: that source with
    ``-march=native`` and ``flags``. Kept under ``$PAGEDSERVE_CACHE/kernels/bench/``, keyed by
    the sources, the flags, the compiler and the CPU as the engine's own builds are (the units'
    objects under ``kernels/obj/``, shared with the engine's where the flags are the same)."""
    import hashlib

    from pagedserve.ops.cpu import build

    src_dir = csrc or build._CSRC
    units = build._units(lib)
    unity = not all(os.path.exists(os.path.join(src_dir, src)) for src, _ in units)
    if unity:
        single = os.path.join(src_dir, _UNITY_SOURCES[lib])
        if not os.path.exists(single):
            raise SystemExit(f"{src_dir}: neither this tree's kernel units nor the single {_UNITY_SOURCES[lib]} of older revisions")
        recipe: Any = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *build._LIBS[lib][0], *flags]
    else:
        recipe = [(src, unit_flags + list(flags)) for src, unit_flags in units]
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(build._sources_digest(src_dir) + repr((recipe, cc)).encode() + build._cpu_identity()).hexdigest()[:16]
    if key in _variants:
        return _variants[key]
    from pagedserve.platform import cache_dir

    out_dir = os.path.join(cache_dir(), "kernels", "bench")
    so = os.path.join(out_dir, f"{lib}-{tag}-{key}.so")
    if not os.path.exists(so):
        os.makedirs(out_dir, exist_ok=True)
        print(
            f"building {lib} ({tag}: {' '.join(flags) or 'the engine flags'}" + (f", one source: {_UNITY_SOURCES[lib]}" if unity else "") + ") ...",
            flush=True,
        )
        try:
            if unity:
                part = os.path.join(tmp, os.path.basename(so))
                subprocess.run([cc, *recipe, single, "-o", part, "-lm"], check=True, capture_output=True)
                shutil.move(part, so)
            else:
                build.build_library(lib, so, tuple(flags), src_dir)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"building {lib} ({tag}) failed:\n{(e.stderr or b'').decode(errors='replace')[-3000:]}") from None
    dll = ctypes.CDLL(so)
    build._declare(lib, dll)
    _variants[key] = dll
    return dll


def _cpu_class() -> str:
    from pagedserve.bench.results import host_info

    return host_info()["class"]


_LEVELS = ("other", "avx2", "avx512", "avx512bf16", "amx")  # cpu_class's, lowest first


def _kernel_class() -> str:
    """The class whose kernel paths run here: this CPU's, or lower where ``PAGEDSERVE_CPU_ISA``
    caps the kernels (e.g. ``avx2`` on an AMX host: its peers are then an AVX2 CPU's)."""
    cls = _cpu_class()
    cap = os.environ.get("PAGEDSERVE_CPU_ISA", "")
    cap = "other" if cap == "scalar" else cap
    if cls in _LEVELS and cap in _LEVELS and _LEVELS.index(cap) < _LEVELS.index(cls):
        return cap
    return cls
