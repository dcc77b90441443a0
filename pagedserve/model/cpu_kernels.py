"""CPU kernels in plain C, compiled once on first use with the system C compiler and called
through ctypes (no torch headers, so the build takes about a second).

The shared object is cached under ``$PAGEDSERVE_CACHE/kernels`` keyed by the source hash and
the compiler flags. It links ``libgomp.so.1``, which the dynamic loader resolves to the OpenMP
runtime torch already loaded, so the kernels share torch's thread pool and thread count.

Set ``PAGEDSERVE_CPU_KERNELS=0`` to disable them; without a C compiler they are disabled
with a warning and the pure-PyTorch path is used.
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

import torch

logger = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast"]
_lib: Optional[ctypes.CDLL] = None
_tried = False
_lock = threading.Lock()


def _build() -> Optional[ctypes.CDLL]:
    from pagedserve.model.loader import cache_dir

    with open(_SRC, "rb") as fh:
        src = fh.read()
    key = hashlib.sha256(src + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    so = os.path.join(out_dir, f"paged_attention-{key}.so")
    if not os.path.exists(so):
        os.makedirs(out_dir, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        subprocess.run([cc, *_FLAGS, _SRC, "-o", tmp, "-lm"], check=True, capture_output=True)
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    i64, f32, p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    for name in ("paged_attention_f32", "paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32]
    return lib


def get_lib() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None when disabled or unavailable."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0":
                try:
                    _lib = _build()
                except (OSError, subprocess.CalledProcessError) as e:
                    detail = getattr(e, "stderr", b"") or b""
                    logger.warning("CPU attention kernel unavailable, using PyTorch attention: %s %s", e, detail.decode()[-500:])
                    _lib = None
            _tried = True
    return _lib


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: Optional[torch.Tensor],
    token_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Attention straight from the paged cache into ``out``, one query token at a time.

    Query token ``t`` attends to the first ``token_lens[t]`` tokens of the sequence whose block
    table is row ``token_seq[t]`` (row ``t`` when ``token_seq`` is None: decode, one token per
    sequence). A prefill chunk passes, for its token at position ``p``, ``token_lens = p + 1``:
    causal attention over cached context and the chunk itself, whose K/V are already in the cache.
    Every row is computed the same way whatever else is in the batch, so chunking, prefix-cache
    hits and batch composition do not change a row's result.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` contiguous, float32 or bfloat16.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``, same dtype.
        block_tables: ``[num_seqs, max_blocks]`` int64, contiguous.
        token_seq: ``[num_tokens]`` int64 row of ``block_tables`` per token, or None.
        token_lens: ``[num_tokens]`` int64 (tokens attended to, the query's own included).
        out: ``[num_tokens, num_heads, head_dim]`` contiguous, written in place.
    Returns:
        False (and writes nothing) when the kernel cannot run here: no compiled library, a
        device other than CPU, or another dtype or layout.
    """
    lib = get_lib()
    if lib is None or query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16):
        return False
    if kv_cache.dtype != query.dtype or not (query.is_contiguous() and out.is_contiguous() and kv_cache.is_contiguous()):
        return False
    if not (block_tables.is_contiguous() and token_lens.is_contiguous()) or (token_seq is not None and not token_seq.is_contiguous()):
        return False
    fn = lib.paged_attention_bf16 if query.dtype == torch.bfloat16 else lib.paged_attention_f32
    n, h, d = query.shape
    _, _, nkv, bs, _ = kv_cache.shape
    rc = fn(
        query.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        None if token_seq is None else token_seq.data_ptr(),
        token_lens.data_ptr(),
        out.data_ptr(),
        n,
        h,
        nkv,
        d,
        bs,
        scale,
    )
    return rc == 0
