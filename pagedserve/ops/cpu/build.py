"""Compiling and loading the CPU kernels: plain C, built once on first use with the system C
compiler and called through ctypes (no torch headers).

The sources in ``csrc/`` are translation units laid out by kind, one file per idea and ISA:

- ``common/``: ``cpu.c`` (which ISA this CPU has, asked at run time: ``cpu.h``), bf16 and int8-cache
  helpers, the AMX tile configuration;
- ``attention/``: the paged attention kernel, ``paged_attention.c`` (picks the path) over the
  units of each ISA (``scalar.c``, ``avx2.c`` and ``avx2_tokens.c``, ``avx512.c``,
  ``avx512bf16.c``, ``amx.c``; the map: ``attention.h``);
- ``fused/``: fused RMSNorm + residual add, SiLU-and-mul, RoPE + KV-cache write (``fused_ops.c``)
  and the row argmax (``argmax.c``), their vector rows in ``avx2.c``, ``avx512.c``,
  ``avx512bf16.c``;
- ``gemm/``: the bf16 matmuls, ``gemm.c`` (checks the CPU) over ``small_gemm.c`` (AVX512-BF16, on
  oneDNN's packed weights, 1-64 rows at a time), ``amx.c`` and ``avx2.c`` (own weight layouts);
- ``step/decode_step.c``: a whole step's layer loop; ``probe/``: the memory-bandwidth probe;
- ``quant/``: the matmul on quantized weights (:mod:`pagedserve.ops.quantized`'s layout) and their
  dequantization, ``qgemm.c`` (checks, the scalar loops) over ``avx2.c`` and ``avx512.c``;
- ``lora/``: the multi-LoRA delta, ``lora.c`` (checks, rows grouped by adapter, the portable
  loops) over ``avx2.c`` and ``avx512.c`` (the same loops, ``body.h``, with each ISA's flags).

They are linked into five libraries, ``paged_attention``, ``fused_ops``, ``decode`` (the step,
the matmuls and the fused ops again), ``quant`` and ``lora``, each cached as one shared object under
``$PAGEDSERVE_CACHE/kernels``, keyed by the sources, the compiler flags and the CPU, and linked
from the units' objects (``kernels/obj/``, same keys; compiled in parallel). Each unit is
compiled on its own: the portable ones (the dispatch, the scalar loops) for the baseline of the
architecture, each ISA's units with that ISA's explicit flags (``ISA_FLAGS``), on any x86-64 host
whatever its CPU; a portable unit asks ``ps_cpu_isa()`` before it calls into an ISA unit, so code
for an ISA the CPU lacks never runs. ``-mtune=native`` tunes all of them for this CPU (as the
former ``-march=native`` builds did). Off x86-64 only the portable units are built, with
``-march=native``. ``PAGEDSERVE_CPU_ISA=scalar|avx2|avx512|avx512bf16|amx`` caps the ISA the
kernels use (to run an older CPU's paths here). Each library links ``libgomp.so.1``, which the
dynamic loader resolves to the OpenMP runtime torch already loaded, so the kernels share torch's
thread pool and thread count.

``python -m pagedserve.ops.cpu --check-all-isas`` (``make check-kernels``, run by CI) compiles
every unit of every library with its flags and ``-Wall`` (any warning fails it, as ``-Werror``)
and links each library with no undefined symbol, on any x86-64 host: nothing is run. It checks
the objects the libraries are linked from, so after a build it costs nothing.

``PAGEDSERVE_CPU_KERNELS=0`` disables them; without a C compiler they are disabled with a
warning, and the engine uses PyTorch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from pagedserve import platform as host  # (the stdlib's platform is imported above)

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# -O3 and OpenMP for every unit; the ISA of a portable unit is the architecture's baseline on
# x86-64 (-mtune=native: tuned for this CPU, as -march=native did), this CPU's elsewhere.
_COMMON_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-fvisibility=hidden"] + (["-mtune=native"] if _X86 else ["-march=native"])
# The flags of each ISA's units: cumulative, as the levels of csrc/common/cpu.h.
_AVX2 = ["-mavx2", "-mfma"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_AVX512BF16 = _AVX512 + ["-mavx512bf16"]
ISA_FLAGS = {
    "portable": [],
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512bf16": _AVX512BF16,
    "amx": _AVX512BF16 + ["-mamx-tile", "-mamx-bf16"],
}

_FUSED_UNITS = [
    ("fused/fused_ops.c", "portable"),
    ("fused/argmax.c", "portable"),
    ("fused/avx2.c", "avx2"),
    ("fused/avx512.c", "avx512"),
    ("fused/avx512bf16.c", "avx512bf16"),
]
# name -> (extra flags, [(unit, ISA)]). The fused element-wise ops must round like PyTorch, so no
# FMA contraction there (nor in the decode library, which runs them too); attention accumulates
# in fp32 and may contract.
_LIBS = {
    "paged_attention": (
        ["-ffp-contract=fast"],
        [
            ("common/cpu.c", "portable"),
            ("attention/paged_attention.c", "portable"),
            ("attention/heads.c", "portable"),
            ("attention/token_tasks.c", "portable"),
            ("attention/scalar.c", "portable"),
            ("attention/avx2.c", "avx2"),
            ("attention/avx2_tokens.c", "avx2"),
            ("attention/avx512.c", "avx512"),
            ("attention/avx512bf16.c", "avx512bf16"),
            ("attention/amx.c", "amx"),
        ],
    ),
    "fused_ops": (["-ffp-contract=off"], [("common/cpu.c", "portable")] + _FUSED_UNITS),
    "decode": (
        ["-ffp-contract=off"],
        [("common/cpu.c", "portable")]
        + _FUSED_UNITS
        + [
            ("gemm/gemm.c", "portable"),
            ("gemm/small_gemm.c", "avx512bf16"),
            ("gemm/amx.c", "amx"),
            ("gemm/avx2.c", "avx2"),
            ("step/decode_step.c", "portable"),
            ("probe/stream_read.c", "portable"),
            ("probe/avx2.c", "avx2"),
            ("probe/avx512.c", "avx512"),
        ],
    ),
    # The quantized-weight matmul and dequantization: the dequantized weight must be the
    # reference's bits (a product, then a sum), so no contraction (the dot products use explicit FMA).
    "quant": (
        ["-ffp-contract=off"],
        [
            ("common/cpu.c", "portable"),
            ("quant/qgemm.c", "portable"),
            ("quant/avx2.c", "avx2"),
            ("quant/avx512.c", "avx512"),
        ],
    ),
    # The multi-LoRA delta: every unit sums in the same order, fusing each product and sum where
    # the ISA has FMA (the AVX2 and AVX-512 units give the same bits; csrc/lora/lora.h).
    "lora": (
        ["-ffp-contract=fast"],
        [
            ("common/cpu.c", "portable"),
            ("lora/lora.c", "portable"),
            ("lora/avx2.c", "avx2"),
            ("lora/avx512.c", "avx512"),
        ],
    ),
}
_libs: dict[str, Optional[ctypes.CDLL]] = {}
_lock = threading.Lock()


def _cpu_identity() -> bytes:
    """The first CPU's model name and feature flags (Linux), else the platform's description."""
    try:
        with open("/proc/cpuinfo", "rb") as fh:
            info = fh.read().split(b"\n\n", 1)[0]
        return b"\n".join(line for line in info.splitlines() if line.split(b":")[0].strip() in (b"model name", b"flags", b"Features"))
    except OSError:
        return (platform.machine() + platform.processor()).encode()


def _units(name: str) -> list[tuple[str, list[str]]]:
    """The library's units, each with its full flags (off x86-64: the portable ones)."""
    extra, units = _LIBS[name]
    return [(src, _COMMON_FLAGS + extra + ISA_FLAGS[isa]) for src, isa in units if _X86 or isa == "portable"]


def _sources_digest(csrc: str) -> bytes:
    """Every file of csrc (a unit, or a header a unit may include): its path and contents."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(csrc):
        dirs.sort()
        for f in sorted(files):
            if f.endswith((".c", ".h")):
                path = os.path.join(root, f)
                with open(path, "rb") as fh:
                    h.update(os.path.relpath(path, csrc).encode() + b"\0" + fh.read() + b"\0")
    return h.digest()


def _object_stem(digest: bytes, src: str, flags: list[str]) -> str:
    """The name of a unit's object under ``kernels/obj`` without its extension (``.o``, and
    ``.log``: the compiler's warnings): the unit's path and a key of the sources (``digest``),
    the flags, the compiler and the CPU."""
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(digest + repr((src, flags, cc)).encode() + _cpu_identity()).hexdigest()[:16]
    return f"{src.replace('/', '-')[:-2]}-{key}"


def object_stems() -> set[str]:
    """The objects (as :func:`_object_stem` names them) the engine's libraries are linked from
    with this tree's sources, flags, ``$CC`` and CPU, which ``--check-all-isas`` compiles too.
    ``pagedserve cache clear`` removes the other objects under ``kernels/obj`` (an older
    version's, another compiler's or CPU's, a benchmark variant's: rebuilt when needed)."""
    digest = _sources_digest(_CSRC)
    return {_object_stem(digest, src, flags) for name in _LIBS for src, flags in _units(name)}


def _object(csrc: str, digest: bytes, src: str, flags: list[str]) -> tuple[str, str]:
    """One unit's object and the compiler's warnings ('' if none), compiled with -Wall on first use
    and kept under ``kernels/obj``, keyed by the sources, the flags, the compiler and the CPU
    (-mtune=native). Raises CalledProcessError (stderr: the compiler's) when it does not compile."""
    from pagedserve.platform import cache_dir

    cc = os.environ.get("CC", "cc")
    out_dir = os.path.join(cache_dir(), "kernels", "obj")
    obj = os.path.join(out_dir, _object_stem(digest, src, flags) + ".o")
    if not os.path.exists(obj):
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".o", dir=out_dir)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, "-Wall", "-c", os.path.join(csrc, src), "-o", tmp], check=True, capture_output=True)
            with open(tmp[:-2] + ".log", "wb") as fh:
                fh.write(r.stderr)
            os.replace(tmp[:-2] + ".log", obj[:-2] + ".log")
            os.replace(tmp, obj)
        finally:
            for f in (tmp, tmp[:-2] + ".log"):
                if os.path.exists(f):
                    os.remove(f)
    with open(obj[:-2] + ".log", "rb") as fh:
        return obj, fh.read().decode(errors="replace").strip()


def _objects(csrc: str, units: list[tuple[str, list[str]]]) -> list[tuple[str, str]]:
    """_object of every unit, compiled in parallel (one per CPU)."""
    digest = _sources_digest(csrc)
    with ThreadPoolExecutor(max_workers=max(1, min(len(units), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda u: _object(csrc, digest, *u), units))


def _link(objs: list[str], so: str, extra: tuple[str, ...] = ()) -> None:
    """Link objs into the shared object so (written whole: a temporary, then renamed)."""
    cc = os.environ.get("CC", "cc")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(so))
    os.close(fd)
    try:
        subprocess.run([cc, "-shared", "-fopenmp", *objs, "-o", tmp, "-lm", *extra], check=True, capture_output=True)
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_library(name: str, so: str, extra_flags: tuple[str, ...] = (), csrc: str = _CSRC) -> None:
    """Build the library ``name`` ("paged_attention", "fused_ops", "decode") into the shared
    object so, every unit with ``extra_flags`` added (e.g. ``-DPS_ISA_CAP=PS_ISA_AVX512BF16``: a
    build without its AMX paths, see cpu.h), from csrc (default this tree's; another revision's
    with the same units). For peers to compare against, as ``pagedserve bench kernels`` builds."""
    objs = _objects(csrc, [(src, flags + list(extra_flags)) for src, flags in _units(name)])
    _link([obj for obj, _ in objs], so)


def _compile(name: str) -> ctypes.CDLL:
    from pagedserve.platform import cache_dir

    # -mtune=native (and -march=native off x86-64) make the code this CPU's, so the CPU is part of
    # the key (a cache directory shared with or copied to another machine must not load it).
    key = hashlib.sha256(_sources_digest(_CSRC) + repr(_units(name)).encode() + _cpu_identity()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    so = os.path.join(out_dir, f"{name}-{key}.so")
    if not os.path.exists(so):
        os.makedirs(out_dir, exist_ok=True)
        build_library(name, so)
    return ctypes.CDLL(so)


def check_all_isas() -> list[str]:
    """Compile every unit of every library with its ISA's flags and -Wall, and link each library
    (``-Wl,--no-undefined``): nothing runs, so any x86-64 host checks every ISA's code. A warning
    fails the check as -Werror would. The objects are the ones the libraries are built from (kept
    under ``kernels/obj``), so the check and the engine's build compile each unit once between
    them. Returns the failures (the compiler's or the linker's messages), empty when all pass."""
    from pagedserve.platform import cache_dir

    failures = []
    units = {(src, tuple(flags)) for name in _LIBS for src, flags in _units(name)}  # the fused units are in two libraries
    digest = _sources_digest(_CSRC)

    def one(unit: tuple[str, tuple[str, ...]]) -> Optional[str]:
        src, flags = unit
        try:
            obj, warnings = _object(_CSRC, digest, src, list(flags))
        except subprocess.CalledProcessError as e:
            failures.append(f"{src} ({' '.join(flags)}):\n{e.stderr.decode(errors='replace').strip()}")
            return None
        if warnings:
            failures.append(f"{src} ({' '.join(flags)}): -Wall warns (-Werror):\n{warnings}")
        return obj

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        objs = dict(zip(units, pool.map(one, units)))
    out_dir = os.path.join(cache_dir(), "kernels")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="check-", dir=out_dir) as work:
        for name in _LIBS:
            lib_objs = [objs[(src, tuple(flags))] for src, flags in _units(name)]
            if all(lib_objs):
                try:
                    _link(lib_objs, os.path.join(work, f"{name}.so"), ("-Wl,--no-undefined",))
                except subprocess.CalledProcessError as e:
                    failures.append(f"linking {name}:\n{e.stderr.decode(errors='replace').strip()}")
    return failures


def _declare(name: str, lib: ctypes.CDLL) -> None:
    i64, f32, p, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    if name == "paged_attention":
        for fn_name in ("paged_attention_f32", "paged_attention_bf16", "paged_attention_q8_f32", "paged_attention_q8_bf16"):
            fn = getattr(lib, fn_name)
            fn.restype = ctypes.c_int
            fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32]
        lib.paged_attention_window.restype = ctypes.c_int
        lib.paged_attention_window.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32, i32, i32, i64, f32]
        lib.paged_attention_bf16_fast_path.restype = ctypes.c_int
        lib.paged_attention_bf16_fast_path.argtypes = [i64, i64]
    elif name == "quant":
        lib.qgemm.restype = ctypes.c_int
        lib.qgemm.argtypes = [p, i32, i64, i64, i64, p, i32, i64, p, p, i64, p, i32, i64]
        lib.qdequant.restype = ctypes.c_int
        lib.qdequant.argtypes = [p, i32, i64, p, p, i64, i64, p, i32]
    elif name == "lora":
        lib.lora_add_delta.restype = ctypes.c_int
        lib.lora_add_delta.argtypes = [p, i64, p, i64, i32, i64, p, i64, p, p, p, i32, i64, i64, i64]
    elif name == "decode":
        lib.small_gemm_bf16.restype = ctypes.c_int
        lib.small_gemm_bf16.argtypes = [p, i64, i64, p, p, p, i64, i64, i64]
        lib.amx_gemm_bf16.restype = ctypes.c_int
        lib.amx_gemm_bf16.argtypes = [p, i64, i64, p, p, p, i64]
        lib.amx_gemm_available.restype = ctypes.c_int
        lib.amx_gemm_available.argtypes = []
        lib.avx2_gemm_bf16.restype = ctypes.c_int
        lib.avx2_gemm_bf16.argtypes = [p, i64, i64, p, p, p, i64]
        lib.avx2_gemm_available.restype = ctypes.c_int
        lib.avx2_gemm_available.argtypes = []
        lib.decode_layer_entries.restype = ctypes.c_int
        lib.decode_layer_entries.argtypes = []
        lib.decode_layers_bf16.restype = ctypes.c_int
        lib.decode_layers_bf16.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, i64, f32, f32, p, p, p, p, p, p, p, i64, p, p, p, i32]
        lib.stream_read.restype = f32
        lib.stream_read.argtypes = [p, i64]
    else:
        lib.add_rms_norm.restype = None
        lib.add_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
        lib.silu_mul.restype = None
        lib.silu_mul.argtypes = [p, p, i64, i64, i32]
        lib.argmax_bf16_rows.restype = None
        lib.argmax_bf16_rows.argtypes = [p, i64, i64, i64, p]
        for fn in (lib.rope_write_kv, lib.rope_write_kv_q8):
            fn.restype = None
            fn.argtypes = [p, i64, p, i64, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i32]


def _get(name: str) -> Optional[ctypes.CDLL]:
    if name in _libs:
        return _libs[name]
    with _lock:
        if name not in _libs:
            lib = None
            if host.switch_on("PAGEDSERVE_CPU_KERNELS"):
                try:
                    lib = _compile(name)
                    _declare(name, lib)
                except (OSError, subprocess.CalledProcessError, AttributeError) as e:
                    detail = getattr(e, "stderr", b"") or b""
                    logger.warning("CPU kernels %r unavailable, using PyTorch ops: %s %s", name, e, detail.decode()[-500:])
                    lib = None
            _libs[name] = lib
    return _libs[name]


def get_lib() -> Optional[ctypes.CDLL]:
    """The compiled attention kernel, or None when disabled or unavailable."""
    return _get("paged_attention")


def get_fused_lib() -> Optional[ctypes.CDLL]:
    """The compiled fused element-wise ops, or None when disabled or unavailable."""
    return _get("fused_ops")


def get_decode_lib() -> Optional[ctypes.CDLL]:
    """The compiled small-M matmul and decode step, whatever ``PAGEDSERVE_SMALL_GEMM`` says."""
    return _get("decode")


def get_quant_lib() -> Optional[ctypes.CDLL]:
    """The compiled quantized-weight matmul and dequantization (``csrc/quant/``), or None when
    disabled or unavailable."""
    return _get("quant")


def get_lora_lib() -> Optional[ctypes.CDLL]:
    """The compiled multi-LoRA delta (``csrc/lora/``), or None when disabled or unavailable."""
    return _get("lora")


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pagedserve.ops.cpu", description="Compile-check the CPU kernels.")
    parser.add_argument(
        "--check-all-isas",
        action="store_true",
        required=True,
        help="compile every unit of every library with its ISA's flags and -Wall -Werror, link the libraries; run nothing",
    )
    parser.parse_args(argv)
    failures = check_all_isas()
    for f in failures:
        print(f, file=sys.stderr)
    units = {(src, tuple(flags)) for name in _LIBS for src, flags in _units(name)}
    isas = "every ISA" if _X86 else "not x86-64: the portable units"
    print(f"kernels: {len(units)} units of {len(_LIBS)} libraries ({isas}): " + (f"{len(failures)} FAILED" if failures else "compiled and linked"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
