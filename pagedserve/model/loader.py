"""Load checkpoints' weights (torch): the tensors of an HF folder's safetensors files or of a
GGUF file, and the dtype the engine computes in. Finding, converting and reading a checkpoint's
config and tokenizer is torch-free and lives in :mod:`pagedserve.model.files`; its names are
re-exported here (``pagedserve.model.loader.resolve_model`` is public).
"""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch

from pagedserve.model.files import (  # noqa: F401  (the public names of model files, kept here)
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    convert_gguf,
    default_model_path,
    gguf_source,
    iterate_gguf_arrays,
    load_config,
    load_eos_token_ids,
    load_tokenizer,
    model_fingerprint,
    resolve_model,
)
from pagedserve.model.validation import ModelFileError, describe, short
from pagedserve.platform import cache_dir, cpu_has_bf16  # noqa: F401


def iterate_gguf_weights(path: str, num_heads: int, num_kv_heads: int, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors of a GGUF file, with HF names and layouts."""
    for name, arr in iterate_gguf_arrays(path, num_heads, num_kv_heads, arch):
        yield name, torch.from_numpy(arr)


def gguf_quantized_modules(model_dir: str, module_of) -> set[str]:
    """The module paths (``module_of(hf_name)``) whose weights a GGUF-backed folder holds
    quantized: every part of a fused module (q/k/v, gate/up) quantized; empty for other folders."""
    from pagedserve.model.file_headers import read_gguf_header
    from pagedserve.model.files import _gguf_weight_names

    source = gguf_source(model_dir)
    if source is None:
        return set()
    header = read_gguf_header(source)
    quantized: dict[str, bool] = {}
    for gname, hf in _gguf_weight_names(header).items():
        if not hf.endswith(".weight") or len(header.tensors[gname].shape) not in (2, 3):
            continue
        shape = header.tensors[gname].shape
        if len(shape) == 3 and ".experts." not in hf:
            continue
        # An MoE expert stack (GGUF dims [in, out, E]) holds each expert's module.
        names = [hf] if len(shape) == 2 else [hf.replace(".experts.", f".experts.{e}.") for e in range(shape[2])]
        is_q = header.tensors[gname].dtype not in ("F32", "F16", "BF16")
        for module in map(module_of, names):
            quantized[module] = quantized.get(module, True) and is_q
    return {m for m, q in quantized.items() if q}


def iterate_weights(model_dir: str, hf_config, quantized: bool) -> Iterator[tuple[str, object]]:
    """``(HF name, tensor)`` of a checkpoint folder: its safetensors files, or the GGUF file a
    cached GGUF folder stands for (:func:`gguf_source`), whose quantized tensors come as
    :class:`~pagedserve.ops.quantized.QuantizedWeight` when ``quantized`` (else dequantized to
    float32 in memory, one tensor at a time).

    Raises:
        ModelFileError: a weight file that cannot be read.
    """
    source = gguf_source(model_dir)
    if source is None:
        yield from iterate_safetensors_weights(model_dir)
        return
    from pagedserve.model.gguf_quant import iterate_gguf_tensors

    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    yield from iterate_gguf_tensors(source, heads, kv_heads, hf_config.model_type, quantized=quantized)


def iterate_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every ``*.safetensors`` file of a folder (``resolve_model`` has
    checked their headers against the config).

    Raises:
        ModelFileError: no weight files, or one that cannot be read (changed since it was checked).
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if not files:
        raise ModelFileError(model_dir, "no *.safetensors weight files in this folder")
    for fpath in files:
        try:
            fh = safe_open(fpath, framework="pt")
        except Exception as e:
            raise ModelFileError(fpath, f"cannot read it as safetensors ({describe(e)})") from None
        with fh:
            for name in fh.keys():
                try:
                    tensor = fh.get_tensor(name)
                except Exception as e:
                    raise ModelFileError(fpath, f"cannot read tensor {short(name)} ({describe(e)})") from None
                yield name, tensor


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, on CPUs with AVX-512 BF16 (or AMX), and on CPUs with AVX2 +
    FMA where pagedserve's AVX2 bf16 matmul runs (bf16 weights, float32 arithmetic: faster than
    float32 there, see docs/perf-history.md, "AVX2: a CPU without AVX-512"); else float32.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() or avx2_bf16_packed() else torch.float32


def avx2_bf16_packed() -> bool:
    """bf16 projections take the AVX2 matmul here (packing on, kernels built)."""
    from pagedserve.model.packed_linear import avx2_bf16, packing_available

    return packing_available(torch.device("cpu"), torch.bfloat16) and avx2_bf16(torch.bfloat16)
