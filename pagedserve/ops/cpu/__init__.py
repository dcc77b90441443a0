"""The CPU kernels (C, built on first use) and their ctypes wrappers: paged attention, fused
element-wise ops, row argmax, small-M matmuls on oneDNN's packed weights, the one-call decode
step. See ``build.py`` for how they are compiled, cached and disabled."""

from pagedserve.ops.cpu.build import get_decode_lib, get_fused_lib, get_lib
from pagedserve.ops.cpu.kernels import (
    add_rms_norm,
    argmax_bf16,
    fused_ops_usable,
    paged_attention_cpu,
    prefill_kernel_preferred,
    rope_write_kv,
    silu_mul,
)
from pagedserve.ops.cpu.matmul import (
    SMALL_GEMM_MAX_ROWS,
    calibrate_small_gemm,
    collapse_to_huge_pages,
    decode_layer_entries,
    decode_layers,
    get_small_gemm_lib,
    memory_read_bandwidth,
    small_gemm,
)

__all__ = [
    "get_lib",
    "get_fused_lib",
    "get_decode_lib",
    "add_rms_norm",
    "argmax_bf16",
    "fused_ops_usable",
    "paged_attention_cpu",
    "prefill_kernel_preferred",
    "rope_write_kv",
    "silu_mul",
    "SMALL_GEMM_MAX_ROWS",
    "calibrate_small_gemm",
    "collapse_to_huge_pages",
    "decode_layer_entries",
    "decode_layers",
    "get_small_gemm_lib",
    "memory_read_bandwidth",
    "small_gemm",
]
