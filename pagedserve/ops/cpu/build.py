"""Compiling and loading the CPU kernels: plain C, built once on first use with the system C
compiler and called through ctypes (no torch headers, so a build takes about a second).

Three libraries from ``csrc/``: ``paged_attention.c`` (the paged attention kernel),
``fused_ops.c`` (fused RMSNorm + residual add, SiLU-and-mul, RoPE + KV-cache write, row argmax)
and ``decode_step.c`` (bf16 matmuls straight from oneDNN's packed weights, built for 1-64
rows, ``small_gemm.c``, the AMX and AVX2 bf16 matmuls ``amx_gemm.c`` and ``avx2_gemm.c``, and a
whole step's layer loop). Each shared
object is cached under ``$PAGEDSERVE_CACHE/kernels`` keyed by the sources, the compiler flags
and the CPU. It links ``libgomp.so.1``, which the dynamic loader resolves to the OpenMP runtime
torch already loaded, so the kernels share torch's thread pool and thread count.

``PAGEDSERVE_CPU_KERNELS=0`` disables them; without a C compiler they are disabled with a
warning, and the engine uses PyTorch ops.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from typing import Optional

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_COMMON_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# name -> (source, extra flags). The fused element-wise ops must round like PyTorch, so no FMA
# contraction there; attention accumulates in fp32 and may contract.
_LIBS = {
    "paged_attention": ("paged_attention.c", ["-ffp-contract=fast"]),
    "fused_ops": ("fused_ops.c", ["-ffp-contract=off"]),
    "decode": ("decode_step.c", ["-ffp-contract=off"]),  # includes fused_ops.c, small_gemm.c, amx_gemm.c
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
        import platform

        return (platform.machine() + platform.processor()).encode()


def _compile(name: str) -> ctypes.CDLL:
    from pagedserve.platform import cache_dir

    src_name, extra = _LIBS[name]
    src_path = os.path.join(_CSRC, src_name)
    flags = _COMMON_FLAGS + extra
    with open(src_path, "rb") as fh:
        src = fh.read()
    for other in sorted(f for f in os.listdir(_CSRC) if f.endswith((".h", ".c")) and f != src_name):  # may be included
        with open(os.path.join(_CSRC, other), "rb") as fh:
            src += fh.read()
    # -march=native: the binary is only valid on this CPU model, so the CPU is part of the key
    # (a cache directory shared with or copied to another machine must not load it).
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_identity()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    so = os.path.join(out_dir, f"{name}-{key}.so")
    if not os.path.exists(so):
        os.makedirs(out_dir, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        subprocess.run([cc, *flags, src_path, "-o", tmp, "-lm"], check=True, capture_output=True)
        os.replace(tmp, so)
    return ctypes.CDLL(so)


def _declare(name: str, lib: ctypes.CDLL) -> None:
    i64, f32, p, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    if name == "paged_attention":
        for fn_name in ("paged_attention_f32", "paged_attention_bf16", "paged_attention_q8_f32", "paged_attention_q8_bf16"):
            fn = getattr(lib, fn_name)
            fn.restype = ctypes.c_int
            fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32]
        lib.paged_attention_bf16_fast_path.restype = ctypes.c_int
        lib.paged_attention_bf16_fast_path.argtypes = [i64, i64]
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
            if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0":
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
