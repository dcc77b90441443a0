"""CPU kernels in plain C, compiled once on first use with the system C compiler and called
through ctypes (no torch headers, so the build takes about a second).

Three libraries: ``paged_attention.c`` (the paged attention kernel), ``fused_ops.c`` (fused
RMSNorm + residual add, SiLU-and-mul, RoPE + KV-cache write) and ``decode_step.c`` (bf16 matmuls
of 1-16 rows straight from oneDNN's packed weights, ``small_gemm.c``, and a whole decode step's
layer loop for such small batches). Each shared object is cached
under ``$PAGEDSERVE_CACHE/kernels`` keyed by the source hash and the compiler flags. It links ``libgomp.so.1``, which the dynamic loader resolves to the OpenMP
runtime torch already loaded, so the kernels share torch's thread pool and thread count.

Set ``PAGEDSERVE_CPU_KERNELS=0`` to disable them; without a C compiler they are disabled
with a warning and the pure-PyTorch path is used.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_COMMON_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# name -> (source, extra flags). The fused element-wise ops must round like PyTorch, so no FMA
# contraction there; attention accumulates in fp32 and may contract.
_LIBS = {
    "paged_attention": ("paged_attention.c", ["-ffp-contract=fast"]),
    "fused_ops": ("fused_ops.c", ["-ffp-contract=off"]),
    "decode": ("decode_step.c", ["-ffp-contract=off"]),  # includes fused_ops.c and small_gemm.c
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
    from pagedserve.model.loader import cache_dir

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
        for fn_name in ("paged_attention_f32", "paged_attention_bf16"):
            fn = getattr(lib, fn_name)
            fn.restype = ctypes.c_int
            fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, f32]
        lib.paged_attention_bf16_fast_path.restype = ctypes.c_int
        lib.paged_attention_bf16_fast_path.argtypes = [i64, i64]
    elif name == "decode":
        lib.small_gemm_bf16.restype = ctypes.c_int
        lib.small_gemm_bf16.argtypes = [p, i64, i64, p, p, p, i64, i64, i64]
        lib.decode_layer_entries.restype = ctypes.c_int
        lib.decode_layer_entries.argtypes = []
        lib.decode_layers_bf16.restype = ctypes.c_int
        lib.decode_layers_bf16.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, i64, f32, f32, p, p, p, p, p, p, p, i64, p, p]
        lib.stream_read.restype = f32
        lib.stream_read.argtypes = [p, i64]
    else:
        lib.add_rms_norm.restype = None
        lib.add_rms_norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
        lib.silu_mul.restype = None
        lib.silu_mul.argtypes = [p, p, i64, i64, i32]
        lib.rope_write_kv.restype = None
        lib.rope_write_kv.argtypes = [p, i64, p, i64, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i32]


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


@functools.lru_cache(maxsize=None)  # asked once per layer per step; the answer never changes
def prefill_kernel_preferred(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether prefill chunks should use the C kernel: only on its vectorised bf16 path. The
    generic path (float32, other shapes, CPUs without AVX512-BF16) computes one query row at a
    time and is slower than PyTorch's flash SDPA on long prompts (e.g. 2048 float32 tokens: 180
    vs 72 ms, 1 thread); for decode rows the kernel is always the faster choice."""
    lib = get_lib()
    if lib is None or dtype != torch.bfloat16 or num_heads % num_kv_heads:
        return False
    return bool(lib.paged_attention_bf16_fast_path(num_heads // num_kv_heads, head_dim))


def _kv_pointers(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Addresses of K and V in a contiguous ``[2, ...]`` cache (cheaper than indexing views)."""
    base = kv_cache.data_ptr()
    return base, base + kv_cache.stride(0) * kv_cache.element_size()


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
    n, h, d = query.shape
    _, _, nkv, bs, kd = kv_cache.shape
    if out.dtype != query.dtype or out.shape != query.shape or kd != d or h % nkv != 0:
        return False
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or token_lens.dtype != torch.int64 or token_lens.numel() != n:
        return False
    if token_seq is not None and (token_seq.dtype != torch.int64 or token_seq.numel() != n):
        return False
    if token_seq is None and block_tables.shape[0] < n:
        return False
    fn = lib.paged_attention_bf16 if query.dtype == torch.bfloat16 else lib.paged_attention_f32
    rc = fn(
        query.data_ptr(),
        *_kv_pointers(kv_cache),
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


_FUSED_MAX_DIM = 16384  # MAX_DIM in fused_ops.c (hidden size of one row)


def fused_ops_usable(x: torch.Tensor) -> bool:
    """Whether the fused element-wise ops can run on tensors like ``x`` (CPU, float32 or
    bfloat16, compiled library present)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and get_fused_lib() is not None


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (or ``x`` when residual is None), then RMSNorm of it with HF
    LlamaRMSNorm's rounding (Zhang & Sennrich 2019).

    Args:
        x: ``[rows, dim]`` contiguous; residual: same shape, updated in place (or None);
            weight: ``[dim]``, same dtype. Callers check ``fused_ops_usable``.
    Returns:
        (normed ``[rows, dim]``, residual) where residual is the updated tensor (``x`` itself
        when None was given).
    """
    lib = get_fused_lib()
    assert lib is not None and x.is_contiguous() and weight.dtype == x.dtype and x.shape[-1] <= _FUSED_MAX_DIM
    out = torch.empty_like(x)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    rows, dim = x.shape
    lib.add_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        rows, dim, eps, int(x.dtype == torch.bfloat16),
    )
    return out, (x if residual is None else residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [rows, 2 * inter]`` (gate first) -> ``[rows, inter]``,
    with PyTorch's rounding (silu rounded to the storage type before the product)."""
    lib = get_fused_lib()
    assert lib is not None and gate_up.is_contiguous()
    rows, two_inter = gate_up.shape
    out = torch.empty(rows, two_inter // 2, dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, two_inter // 2, int(gate_up.dtype == torch.bfloat16))
    return out


def rope_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """RoPE (NeoX halves, HF rounding) on Q and K, K and V written to their cache slots.

    Args:
        qk: ``[rows, (num_heads + num_kv_heads) * head_dim]`` view with unit inner stride (rows
            may be strided, e.g. a slice of the fused QKV output); v: ``[rows, num_kv_heads *
            head_dim]`` likewise. positions, slot_mapping: ``[rows]`` int64 contiguous.
        cos, sin: float32 ``[max_positions, head_dim]`` tables.
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` contiguous, same dtype.
    Returns:
        q ``[rows, num_heads, head_dim]`` contiguous, rotated.
    """
    lib = get_fused_lib()
    _, _, nkv, bs, hd = kv_cache.shape
    rows = qk.shape[0]
    assert lib is not None and qk.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
    assert positions.is_contiguous() and slot_mapping.is_contiguous() and cos.dtype == torch.float32
    q = torch.empty(rows, num_heads, hd, dtype=qk.dtype)
    lib.rope_write_kv(
        qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), positions.data_ptr(), slot_mapping.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), q.data_ptr(), *_kv_pointers(kv_cache),
        rows, num_heads, nkv, hd, bs, int(qk.dtype == torch.bfloat16),
    )
    return q


# -- small-M matmuls on oneDNN's packed weights (decode of 1-16 sequences) ------------------------

SMALL_GEMM_MAX_ROWS = 16  # SG_MAX_ROWS in small_gemm.c


def get_small_gemm_lib() -> Optional[ctypes.CDLL]:
    """The compiled small-M matmul, or None when disabled (also by ``PAGEDSERVE_SMALL_GEMM=0``)."""
    if os.environ.get("PAGEDSERVE_SMALL_GEMM", "1") == "0":
        return None
    return _get("decode")


def _packed_address(packed_weight: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of an opaque oneDNN tensor's buffer."""
    return torch.ops.mkldnn.data_ptr(packed_weight), torch.ops.mkldnn._nbytes(packed_weight)


def small_gemm(x: torch.Tensor, packed_weight: torch.Tensor, bias: Optional[torch.Tensor], out_features: int, plan: tuple[int, int]) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous, 1 <= M <= 16) times a packed weight whose ``plan`` came
    from :func:`calibrate_small_gemm`: ``[M, out_features]`` bf16, bit-identical to oneDNN's
    batched result. Raises RuntimeError if the kernel rejects the shape (callers check first)."""
    lib = _get("decode")  # not get_small_gemm_lib(): plans made at load stay usable if the env changes
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    rc = lib.small_gemm_bf16(
        x.data_ptr(), m, k, torch.ops.mkldnn.data_ptr(packed_weight), None if bias is None else bias.data_ptr(),
        y.data_ptr(), out_features, plan[0], plan[1],
    )
    if rc != 0:
        raise RuntimeError(f"small_gemm_bf16 rejected x {tuple(x.shape)} -> {out_features}")
    return y


_CALIBRATION_OUTPUTS = 1 << 18  # outputs compared per probe batch


def calibrate_small_gemm(packed_weight: torch.Tensor, out_features: int, in_features: int, bias: Optional[torch.Tensor]) -> Optional[tuple[int, int]]:
    """Find how oneDNN splits K into partial sums for this weight shape, so that the small-M
    kernel reproduces its batched output bit for bit (see ``small_gemm.c``).

    Tries (chain, body) candidates (k pairs: partial sums of ``chain`` pairs over the first
    ``body``, then one over the rest) on random rows and keeps the first whose every output
    equals oneDNN's batched result, then confirms it on a second, independent batch. Returns
    None when the layout is not [N/64][K/2][64][2], the shape is not supported, or no candidate
    matches both batches. A wrong candidate differs from oneDNN in about 1-3 outputs in 10^4,
    so each batch has enough rows for 2^18 outputs (at least 64 rows): a wrong candidate then
    shows ~40 mismatches, and passes by chance with probability ~e^-40. (With a fixed 64 rows
    a 64-output weight was given a wrong plan about half the time.)
    """
    lib = get_small_gemm_lib()
    n, k = out_features, in_features
    if lib is None or n % 64 or k % 2 or packed_weight.dtype != torch.bfloat16:
        return None
    try:
        _, nbytes = _packed_address(packed_weight)
    except (RuntimeError, AttributeError):
        return None
    if nbytes != n * k * 2:  # padded layout (N or K not a multiple of the block)
        return None
    k2 = k // 2
    step = SMALL_GEMM_MAX_ROWS
    rows = max(64, -(-_CALIBRATION_OUTPUTS // n))
    rows = min(-(-rows // step) * step, 4096)
    w_ptr = torch.ops.mkldnn.data_ptr(packed_weight)
    b_ptr = None if bias is None else bias.data_ptr()

    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        return x, torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")

    def matches(x: torch.Tensor, ref: torch.Tensor, chain: int, body: int) -> Optional[bool]:
        y = torch.empty(step, n, dtype=torch.bfloat16)
        for r0 in range(0, rows, step):
            if lib.small_gemm_bf16(x[r0].data_ptr(), step, k, w_ptr, b_ptr, y.data_ptr(), n, chain, body) != 0:
                return None
            if not torch.equal(y, ref[r0 : r0 + step]):
                return False
        return True

    bodies = []
    for b in (32, 64, 128, 256, 512, k2):
        if k2 - k2 % b not in bodies:
            bodies.append(k2 - k2 % b)
    x, ref = batch(1234)
    for chain in (256, 512, 128, 1024, 64, k2):
        for body in bodies:
            ok = matches(x, ref, chain, body)
            if ok is None:
                return None
            if ok:
                x2, ref2 = batch(4321)
                return (chain, body) if matches(x2, ref2, chain, body) else None
    return None


_MADV_COLLAPSE = 25
_HUGE_PAGE = 2 << 20


def collapse_to_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux (>= 6.1) to back ``[address, address + nbytes)`` with 2 MiB pages now
    (``madvise(MADV_COLLAPSE)``; contents unchanged, independent of the THP sysfs mode). Decode
    streams every weight each step, and with 4 KiB pages TLB misses cap that stream: measured
    here, a batch-1 step's matmuls 6.0 -> 5.3 ms. Tries the 2 MiB-aligned range around the
    buffer, then the aligned range inside it. Returns False where unsupported (nothing changes)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    lo, hi = address // _HUGE_PAGE * _HUGE_PAGE, -(-(address + nbytes) // _HUGE_PAGE) * _HUGE_PAGE
    if madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
        return True
    lo, hi = -(-address // _HUGE_PAGE) * _HUGE_PAGE, (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return hi > lo and madvise(lo, hi - lo, _MADV_COLLAPSE) == 0


def decode_layer_entries() -> int:
    """Entries per layer of the table :func:`decode_layers` takes (``decode_step.c``)."""
    return int(_get("decode").decode_layer_entries())


def decode_layers(
    table: torch.Tensor,
    hidden: torch.Tensor,
    final_norm: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    inter: int,
    block_size: int,
    eps: float,
    scale: float,
) -> int:
    """Every decoder layer and the final RMSNorm of a decode step of ``M <= 16`` sequences, in
    one C call (``decode_step.c``), bf16.

    Args:
        table: ``[num_layers, decode_layer_entries()]`` int64: per layer the packed weights,
            biases (0 if none) and small-M plans of qkv, o, gate_up, down, the two RMSNorm
            weights and the layer's K and V cache addresses.
        hidden: ``[M, hidden_size]`` contiguous bf16 embeddings, overwritten with the final
            normed hidden states.
        positions, slot_mapping, seq_lens: ``[M]`` int64; block_tables: ``[M, max_blocks]``
            int64; cos, sin: float32 ``[max_positions, head_dim]``. Positions and slots must be
            in range (the C code does not check).
    Returns:
        0 on success; -1 unsupported shape, -2 out of memory, -3 attention failed.
    """
    lib = _get("decode")  # the table was built with it (see small_gemm)
    attention = ctypes.cast(get_lib().paged_attention_bf16, ctypes.c_void_p).value
    m, hid = hidden.shape
    assert hidden.is_contiguous() and block_tables.is_contiguous() and seq_lens.is_contiguous() and positions.is_contiguous()
    return lib.decode_layers_bf16(
        table.data_ptr(), table.shape[0], m, hid, num_heads, num_kv_heads, head_dim, inter, block_size, eps, scale,
        hidden.data_ptr(), final_norm.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), attention,
    )


def memory_read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> Optional[float]:
    """Memory read bandwidth in bytes/s: the best of ``repeats`` reads of an ``nbytes`` buffer
    (2 MiB pages where Linux allows, like the packed weights) with every OpenMP thread. The
    ceiling of batch-1 decode, which streams every weight once per token. None without the
    compiled kernels."""
    import time

    lib = _get("decode") if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0" else None
    if lib is None:
        return None
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    collapse_to_huge_pages(buf.data_ptr(), nbytes)
    lib.stream_read(buf.data_ptr(), nbytes)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        lib.stream_read(buf.data_ptr(), nbytes)
        best = min(best, time.perf_counter() - t)
    return nbytes / best
