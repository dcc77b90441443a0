"""ctypes wrappers of the bf16 matmuls of ``csrc/gemm/`` and of the one-call step
(``csrc/step/decode_step.c``, decodes and prefill chunks): the small-M matmul on oneDNN's packed
weights (``gemm/small_gemm.c``), with the per-shape calibration that makes it bit-identical to oneDNN's batched output; the AMX
and AVX2 bf16 matmuls on their own weight layouts (``gemm/amx.c``, ``gemm/avx2.c``); 2 MiB pages for the weights; and a
memory-bandwidth probe."""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from pagedserve import platform
from pagedserve.ops.cpu.build import _get, get_lib

# The layer-by-layer path's projections take the small-M kernel up to here (SG_MAX_ROWS in csrc/gemm/small_gemm.c).
SMALL_GEMM_MAX_ROWS = 64


def get_small_gemm_lib() -> Optional[ctypes.CDLL]:
    """The compiled small-M matmul, or None when disabled (also by ``PAGEDSERVE_SMALL_GEMM=0``)."""
    if not platform.switch_on("PAGEDSERVE_SMALL_GEMM"):
        return None
    return _get("decode")


def amx_available() -> bool:
    """Whether the AMX matmul runs here: the CPU has AMX-BF16, Linux granted the tile
    state, and ``PAGEDSERVE_AMX`` is not 0 (read when weights are packed; packed layers keep
    their kernel)."""
    return platform.switch_on("PAGEDSERVE_AMX") and _amx_granted()


@functools.lru_cache(maxsize=None)
def _amx_granted() -> bool:
    lib = _get("decode")
    return lib is not None and bool(lib.amx_gemm_available())


def amx_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (N and K multiples of 32) in the AMX matmul's layout
    ``[N/32, K/32, 2, 16, 16, 2]`` bf16: per 32 outputs and 32 k, two 16 x 16 x 2 B tiles
    (k pairs x outputs x pair), contiguous in the order the kernel reads them."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16).contiguous()
    return w.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def amx_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous) times a weight in :func:`amx_layout`:
    ``[M, out_features]`` bf16; fp32 accumulation over k in order, one rounding (each row's
    result independent of M). Raises RuntimeError if the kernel rejects the shape."""
    return _bf16_gemm("amx_gemm_bf16", x, weight, bias, out_features)


def _bf16_gemm(name: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """Call the C matmul ``name`` (x, M, K, weight, bias, y, N; 0 on success) into a new bf16 ``y``."""
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    if m == 0:
        return y
    assert x.dtype == torch.bfloat16 and x.is_contiguous()
    rc = getattr(_get("decode"), name)(x.data_ptr(), m, k, weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), out_features)
    if rc != 0:
        raise RuntimeError(f"{name} failed ({rc}) for x {tuple(x.shape)} -> {out_features}")
    return y


def avx2_gemm_available() -> bool:
    """Whether the AVX2 bf16 matmul (``gemm/avx2.c``) runs here (AVX2 + FMA) and
    ``PAGEDSERVE_AVX2_GEMM`` is not 0 (read when weights are packed)."""
    if not platform.switch_on("PAGEDSERVE_AVX2_GEMM"):
        return False
    lib = _get("decode")
    return lib is not None and bool(lib.avx2_gemm_available())


AVX2_PANEL = 16  # AG_NR in csrc/gemm/avx2.c


def avx2_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` in the AVX2 matmul's layout ``[ceil(N/16), K, 16]`` bf16: per 16
    outputs a contiguous panel, k by k; outputs past N are zeros."""
    n, k = weight.shape
    panels = -(-n // AVX2_PANEL)
    w = torch.zeros(panels * AVX2_PANEL, k, dtype=torch.bfloat16)
    w[:n] = weight.detach()
    return w.view(panels, AVX2_PANEL, k).transpose(1, 2).contiguous()


def avx2_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous) times a weight in :func:`avx2_layout`: ``[M,
    out_features]`` bf16; float32 FMA over k in order, bias, one rounding (each row's result
    independent of M). Raises RuntimeError if the kernel fails (unsupported CPU, no memory)."""
    return _bf16_gemm("avx2_gemm_bf16", x, weight, bias, out_features)


def _packed_address(packed_weight: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of an opaque oneDNN tensor's buffer."""
    return torch.ops.mkldnn.data_ptr(packed_weight), torch.ops.mkldnn._nbytes(packed_weight)


def small_gemm_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (N % 64 == 0, K even) in the layout the small-M kernel reads,
    oneDNN's AB16b64a2b: ``[N/64, K/2, 64, 2]`` bf16 (64 outputs, then pairs of k)."""
    n, k = weight.shape
    return weight.detach().to(torch.bfloat16).reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def small_gemm_layout_matches(packed_weight: torch.Tensor, out_features: int, in_features: int) -> bool:
    """Whether oneDNN packed ``packed_weight`` in :func:`small_gemm_layout`. It does on
    AVX512-BF16 CPUs without AMX; with AMX it packs [N/32, K/2, 32, 2] for its AMX kernels, which
    the small-M kernel would read as garbage. Checked on a few k pairs: oneDNN's product with unit
    rows ``e_k`` is column k of the weight exactly, compared with the raw buffer."""
    n, k = out_features, in_features
    if n % 64 or k % 2 or packed_weight.dtype != torch.bfloat16:
        return False
    ptr, nbytes = _packed_address(packed_weight)
    if nbytes != n * k * 2:
        return False
    pairs = sorted({0, k // 2 - 1, k // 4, (3 * k) // 8})
    unit = torch.zeros(2 * len(pairs), k, dtype=torch.bfloat16)
    for i, j in enumerate(pairs):
        unit[2 * i, 2 * j] = unit[2 * i + 1, 2 * j + 1] = 1
    cols = torch.ops.mkldnn._linear_pointwise(unit, packed_weight, None, "none", [], "")  # [2 * len(pairs), N]
    raw = torch.frombuffer((ctypes.c_int16 * (n * k)).from_address(ptr), dtype=torch.int16).view(torch.bfloat16)
    raw = raw.view(n // 64, k // 2, 64, 2)
    for i, j in enumerate(pairs):
        got = raw[:, j].reshape(n, 2).t()  # [2, N]: the pair's two k, every output
        if not torch.equal(got, cols[2 * i : 2 * i + 2]):
            return False
    return True


def small_gemm(x: torch.Tensor, packed_weight: torch.Tensor, bias: Optional[torch.Tensor], out_features: int, plan: tuple[int, int]) -> torch.Tensor:
    """``x [M, K]`` (bf16, contiguous, M >= 1; past SMALL_GEMM_MAX_ROWS, 64 rows at a time) times a
    weight in :func:`small_gemm_layout` (oneDNN's packed tensor, or a plain tensor in that layout)
    with the summation ``plan`` (chain, body) that :func:`calibrate_small_gemm` found: ``[M,
    out_features]`` bf16, bit-identical to oneDNN's batched result. Raises RuntimeError if the
    kernel rejects the shape (callers check first)."""
    lib = _get("decode")  # not get_small_gemm_lib(): plans made at load stay usable if the env changes
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    w_ptr = torch.ops.mkldnn.data_ptr(packed_weight) if packed_weight.is_mkldnn else packed_weight.data_ptr()
    rc = lib.small_gemm_bf16(
        x.data_ptr(),
        m,
        k,
        w_ptr,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        plan[0],
        plan[1],
    )
    if rc != 0:
        raise RuntimeError(f"small_gemm_bf16 rejected x {tuple(x.shape)} -> {out_features}")
    return y


_CALIBRATION_OUTPUTS = 1 << 18  # outputs compared per probe batch


def calibrate_small_gemm(packed_weight: torch.Tensor, out_features: int, in_features: int, bias: Optional[torch.Tensor]) -> Optional[tuple[int, int]]:
    """Find how oneDNN splits K into partial sums for this weight shape, so that the small-M
    kernel reproduces its batched output bit for bit (see ``gemm/small_gemm.c``).

    Tries (chain, body) candidates (k pairs: partial sums of ``chain`` pairs over the first
    ``body``, then one over the rest) on random rows and keeps the first whose every output
    equals oneDNN's batched result, then confirms it on a second, independent batch. Returns
    None when the layout is not [N/64][K/2][64][2] (:func:`small_gemm_layout_matches`), the shape is not supported, or no candidate
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
    if nbytes != n * k * 2 or not small_gemm_layout_matches(packed_weight, n, k):  # padded, or AMX's layout
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
    token_lens: torch.Tensor,
    *,
    token_seq: Optional[torch.Tensor] = None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    inter: int,
    block_size: int,
    eps: float,
    scale: float,
    kv_int8: bool = False,
) -> int:
    """Every decoder layer and the final RMSNorm of a step of ``M`` tokens (decodes, prefill
    chunks or both), in one C call (``decode_step.c``), bf16.

    Args:
        table: ``[num_layers, decode_layer_entries()]`` int64: per layer the packed weights,
            biases (0 if none) and small-M plans ((0, -1): the AMX matmul) of qkv, o, gate_up, down, the two RMSNorm
            weights and the layer's K and V cache addresses.
        hidden: ``[M, hidden_size]`` contiguous bf16 embeddings, overwritten with the final
            normed hidden states.
        positions, slot_mapping, token_lens: ``[M]`` int64 (token_lens: tokens each token
            attends to, its position + 1); block_tables: ``[num_seqs, max_blocks]`` int64;
            token_seq: ``[M]`` int64, each token's row of block_tables (None: row t, a decode
            step); cos, sin: float32 ``[max_positions, head_dim]``. Positions, slots and
            token_seq must be in range (the C code does not check).
        kv_int8: the caches in the table are the int8 layout of :mod:`pagedserve.ops.kv_int8`.
    Returns:
        0 on success; -1 unsupported shape, -2 out of memory, -3 attention failed.
    """
    lib = _get("decode")  # the table was built with it (see small_gemm)
    attn_fn = get_lib().paged_attention_q8_bf16 if kv_int8 else get_lib().paged_attention_bf16
    attention = ctypes.cast(attn_fn, ctypes.c_void_p).value
    m, hid = hidden.shape
    assert hidden.is_contiguous() and block_tables.is_contiguous() and token_lens.is_contiguous() and positions.is_contiguous()
    assert token_seq is None or (token_seq.is_contiguous() and token_seq.dtype == torch.int64 and token_seq.shape[0] == m)
    return lib.decode_layers_bf16(
        table.data_ptr(),
        table.shape[0],
        m,
        hid,
        num_heads,
        num_kv_heads,
        head_dim,
        inter,
        block_size,
        eps,
        scale,
        hidden.data_ptr(),
        final_norm.data_ptr(),
        positions.data_ptr(),
        slot_mapping.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        None if token_seq is None else token_seq.data_ptr(),
        token_lens.data_ptr(),
        attention,
        int(kv_int8),
    )


def memory_read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> Optional[float]:
    """Memory read bandwidth in bytes/s: the best of ``repeats`` reads of an ``nbytes`` buffer
    (2 MiB pages where Linux allows, like the packed weights) with every OpenMP thread. The
    ceiling of batch-1 decode, which streams every weight once per token. None without the
    compiled kernels."""
    import time

    lib = _get("decode") if platform.switch_on("PAGEDSERVE_CPU_KERNELS") else None
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
