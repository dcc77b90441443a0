"""GGUF tensors read as they are: quantized blocks repacked into pagedserve's quantized layout
(:class:`pagedserve.ops.quantized.QuantizedWeight`), never dequantized to float on the way.

:func:`repack` turns one tensor's GGUF blocks into a ``QuantizedWeight`` whose
:meth:`~pagedserve.ops.quantized.QuantizedWeight.dequantize` gives the same float32 values as
``gguf.quants.dequantize`` (the same products and sums in the same order, so the same roundings)::

    type   bits  group  q (as stored)          scale        min            vs gguf
    Q8_0   8     32     q (int8)               d            -              bit-identical
    Q4_0   4     32     q (0..15, as is)       d            -8*d           equal (*)
    Q4_1   4     32     q (0..15, as is)       d            m              bit-identical
    Q5_0   8     32     q - 16 (-16..15)       d            -              bit-identical
    Q5_1   8     32     q (0..31)              d            m              bit-identical
    Q4_K   4     32     q (0..15, re-nibbled)  d*sc         -(dmin*m)      bit-identical
    Q5_K   8     32     q (0..31)              d*sc         -(dmin*m)      bit-identical
    Q6_K   8     16     q - 32 (-32..31)       d*sc         -              bit-identical

``d``, ``dmin`` and ``m`` are the blocks' fp16 fields widened to float32, ``sc``/``m`` the K
types' 6-bit sub-block scales and mins (``sc`` an int8 for Q6_K); ``d*sc`` and ``dmin*m`` are
float32 products exactly as gguf forms them, and ``a - b`` equals ``a + (-b)`` in IEEE arithmetic.
(*) Q4_0: gguf computes ``d * (q - 8)``, pagedserve ``q*d + (-8*d)``. Both products are exact
(an 11-bit fp16 mantissa times a 4-bit integer fits float32's 24 bits) and so is their sum
(``(q - 8) * d`` fits too), so every value is equal; only the sign of a zero can differ (gguf's
``-0.0`` for ``q == 8`` and ``d < 0`` is ``+0.0`` here): 0 ulp, ``torch.equal``, and a dot
product differs only in the sign of an exact zero result.

ggml's Q4_0/Q4_1 blocks are already in pagedserve's 4-bit nibble order (byte ``j`` of a block of
32: input ``j`` low, ``16 + j`` high) and are copied as they are; Q4_K's 64-input chunks (byte
``j`` of 32: input ``j`` low, ``32 + j`` high) are re-nibbled into two such groups of 32.

:func:`iterate_gguf_tensors` walks a GGUF file one tensor at a time with HF names (as
:func:`pagedserve.model.gguf_names.iterate_gguf_arrays`), the llama Q/K rows un-permuted. Work is
vectorized numpy over chunks of rows, so memory at a time is one repacked tensor plus a few MiB.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch

from pagedserve.model.file_headers import SUPPORTED_GGUF_TYPES, ModelFileError, TensorSpec, read_gguf_header, short
from pagedserve.ops.quantized import QuantizedWeight

__all__ = ["SUPPORTED_GGUF_TYPES", "repack", "iterate_gguf_tensors", "rope_row_order", "QUANTIZED_GGUF_TYPES"]

FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")
QUANTIZED_GGUF_TYPES = tuple(t for t in SUPPORTED_GGUF_TYPES if t not in FLOAT_GGUF_TYPES)

# Elements decoded per chunk of rows: bounds the temporaries (a few bytes per element) whatever
# the tensor's size.
_CHUNK_ELEMENTS = 1 << 21

_Decoded = tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]  # q, scales, mins: one row per block


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (``[nb, 2]`` uint8) as float32 ``[nb, 1]``."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Little-endian bit ``i`` of ``qh`` (``[nb, n]`` uint8) at ``[:, i]``, 0 or 1 (``[nb, 8n]``)."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _q8_0(b: np.ndarray) -> _Decoded:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None


def _q4_0(b: np.ndarray) -> _Decoded:
    d = _f16(b[:, :2])
    return b[:, 2:], d, d * np.float32(-8.0)


def _q4_1(b: np.ndarray) -> _Decoded:
    return b[:, 4:], _f16(b[:, :2]), _f16(b[:, 2:4])


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 values 0..31 (``[nb, 32]`` uint8) from 4 bytes of high bits and 16 of nibbles."""
    lo = np.concatenate((qs & np.uint8(0x0F), qs >> np.uint8(4)), axis=1)
    return lo | (_high_bits(qh) << np.uint8(4))


def _q5_0(b: np.ndarray) -> _Decoded:
    q = (_five_bits(b[:, 2:6], b[:, 6:]).view(np.int8) - np.int8(16)).astype(np.int8)
    return q, _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> _Decoded:
    return _five_bits(b[:, 4:8], b[:, 8:]).view(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the block's scales ``d*sc`` and mins ``-(dmin*m)`` per sub-block of 32
    (float32 ``[nb, 8]``), formed as gguf forms them."""
    nb = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(nb, 3, 4)
    lo, hi, mix = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate((lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)), axis=1)
    m = np.concatenate((hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)), axis=1)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> _Decoded:
    nb = b.shape[0]
    scales, mins = _k_scales(b)
    # A chunk of 64 inputs: byte j < 32 holds input j (low) and 32 + j (high). Here: inputs
    # 0..31 (the low nibbles) as one group of 32, 32..63 (the high ones) as the next.
    qs = b[:, 16:144].reshape(nb, 4, 2, 16)
    b0, b1 = qs[:, :, 0], qs[:, :, 1]  # bytes j and 16 + j of each chunk
    out = np.empty((nb, 4, 2, 16), dtype=np.uint8)
    np.bitwise_or(b0 & np.uint8(0x0F), b1 << np.uint8(4), out=out[:, :, 0])
    np.bitwise_or(b0 >> np.uint8(4), b1 & np.uint8(0xF0), out=out[:, :, 1])
    return out.reshape(nb, 128), scales, mins


def _q5_k(b: np.ndarray) -> _Decoded:
    nb = b.shape[0]
    scales, mins = _k_scales(b)
    qs = b[:, 48:176].reshape(nb, 4, 1, 32)
    lo = np.concatenate((qs & np.uint8(0x0F), qs >> np.uint8(4)), axis=2).reshape(nb, 8, 32)
    hi = _high_bits(b[:, 16:48]).reshape(nb, 32, 8).transpose(0, 2, 1)  # [sub-block i, j]: bit i of qh[j]
    return (lo | (hi << np.uint8(4))).reshape(nb, 256).view(np.int8), scales, mins


def _q6_k(b: np.ndarray) -> _Decoded:
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64)
    lo = np.concatenate((ql & np.uint8(0x0F), ql >> np.uint8(4)), axis=2).reshape(nb, 2, 4, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    q = ((lo | (hi << np.uint8(4))).view(np.int8) - np.int8(32)).astype(np.int8)
    d = _f16(b[:, 208:210])
    scales = d * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q.reshape(nb, 256), scales, None


# type -> (bits, group, has mins, block decoder)
_LAYOUTS: dict[str, tuple[int, int, bool, Callable[[np.ndarray], _Decoded]]] = {
    "Q8_0": (8, 32, False, _q8_0),
    "Q4_0": (4, 32, True, _q4_0),
    "Q4_1": (4, 32, True, _q4_1),
    "Q5_0": (8, 32, False, _q5_0),
    "Q5_1": (8, 32, True, _q5_1),
    "Q4_K": (4, 32, True, _q4_k),
    "Q5_K": (8, 32, True, _q5_k),
    "Q6_K": (8, 16, False, _q6_k),
}
assert set(_LAYOUTS) == set(QUANTIZED_GGUF_TYPES)


def _block_sizes(qtype: str) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def repack(raw: np.ndarray, qtype: str, shape: tuple[int, int], *, where: str = "GGUF tensor") -> QuantizedWeight:
    """One GGUF tensor's quantized blocks as a :class:`QuantizedWeight` (see the module docstring).

    Args:
        raw: the tensor's bytes as ``gguf.GGUFReader`` gives them (``t.data``: uint8
            ``[rows, bytes_per_row]``, a memmap; any shape holding those bytes in row order).
        qtype: the ggml type's name (``"Q4_K"``; a ``GGMLQuantizationType`` is taken too).
        shape: ``(N, K)`` in HF order: N rows (outputs) of K inputs (GGUF's ``ne[1], ne[0]``).
        where: names the tensor in errors (the ModelFileError's path part).

    Raises:
        ModelFileError: a type outside the quantized SUPPORTED_GGUF_TYPES, K not a multiple of
            the type's block, or ``raw`` not holding the bytes of that shape.
    """
    qtype = str(getattr(qtype, "name", qtype))
    if qtype not in _LAYOUTS:
        what = "a float type, loaded as a float tensor, not repacked" if qtype in FLOAT_GGUF_TYPES else "not supported"
        raise ModelFileError(where, f"ggml type {qtype} is {what} (quantized types pagedserve repacks: {', '.join(QUANTIZED_GGUF_TYPES)})")
    bits, group, has_mins, decode = _LAYOUTS[qtype]
    N, K = (int(s) for s in shape)
    block, type_size = _block_sizes(qtype)
    if N <= 0 or K <= 0 or K % block:
        raise ModelFileError(where, f"shape {(N, K)} does not fit {qtype}: the inputs (K = {K}) must be a positive multiple of its block of {block}")
    row_bytes = K // block * type_size
    if raw.dtype != np.uint8 or raw.size != N * row_bytes:
        raise ModelFileError(where, f"{qtype} data of shape {(N, K)} must be {N * row_bytes} bytes (uint8), got {raw.dtype} {tuple(raw.shape)}")
    rows = raw.reshape(N, row_bytes)
    qdata = np.empty((N, K // 2 if bits == 4 else K), dtype=np.uint8 if bits == 4 else np.int8)
    scales = np.empty((N, K // group), dtype=np.float32)
    mins = np.empty((N, K // group), dtype=np.float32) if has_mins else None
    step = max(1, _CHUNK_ELEMENTS // K)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        blocks = np.ascontiguousarray(rows[r0:r1]).reshape(-1, type_size)
        with np.errstate(invalid="ignore", over="ignore"):  # a file's inf/NaN scales stay as gguf reads them
            q, s, m = decode(blocks)
        nb = blocks.shape[0]  # the output rows are contiguous: these reshapes are views
        qdata[r0:r1].reshape(nb, -1)[...] = q
        scales[r0:r1].reshape(nb, -1)[...] = s
        if mins is not None and m is not None:
            mins[r0:r1].reshape(nb, -1)[...] = m
    return QuantizedWeight(torch.from_numpy(qdata), torch.from_numpy(scales), None if mins is None else torch.from_numpy(mins), bits, group, qtype)


def rope_row_order(n_rows: int, n_head: int) -> np.ndarray:
    """The row order (int64 ``[n_rows]``) that undoes llama.cpp's convert-time permutation of Q/K
    rows: ``w[rope_row_order(N, h)]`` is ``gguf_names._unpermute_rope(w, h)``, and for a repacked
    weight ``qw.permuted_rows(torch.from_numpy(order))``."""
    if n_head <= 0 or n_rows % (2 * n_head):
        raise ValueError(f"{n_rows} rows do not split into {n_head} heads of row pairs")
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).transpose(0, 2, 1).reshape(-1)


def _float_tensor(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float GGUF tensor in its own dtype (a copy: the reader's memmap is read-only)."""
    if qtype == "BF16":
        return torch.from_numpy(np.array(raw, copy=True).view("<i2").reshape(shape)).view(torch.bfloat16)
    dtype = np.float32 if qtype == "F32" else np.float16
    return torch.from_numpy(np.array(raw.view(dtype).reshape(shape), copy=True))


def _tensor_data(mm: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """A tensor's bytes in the file's memmap as ``gguf.GGUFReader`` shapes them (F32 / F16 as
    their dtype, every other type as uint8 ``[..., bytes_per_row]``)."""
    import gguf

    data = mm[spec.start : spec.end]
    dims = tuple(reversed(spec.shape))
    if spec.dtype in ("F32", "F16"):
        return data.view(np.float32 if spec.dtype == "F32" else np.float16).reshape(dims)
    return data.reshape(gguf.quants.quant_shape_to_byte_shape(dims, gguf.GGMLQuantizationType[spec.dtype]))


def iterate_gguf_tensors(
    path: str, num_heads: int, num_kv_heads: int, arch: str, quantized: bool = True
) -> Iterator[tuple[str, Union[QuantizedWeight, torch.Tensor]]]:
    """A GGUF file's tensors one at a time, with HF names (as ``files.iterate_gguf_arrays``).

    With ``quantized`` (the default) a 2-D tensor of a quantized type comes out as a
    :class:`QuantizedWeight` (see :func:`repack`), an F32 / F16 / BF16 tensor as a torch tensor
    of that dtype (float32 / float16 / bfloat16), and a 1-D tensor of any type (norms, biases) as
    a float tensor (float32 for a quantized one). Without it every tensor is float32, the values
    of ``iterate_gguf_arrays``. A quantized 3-D MoE expert stack ``[E, out, in]`` comes as the 2-D
    ``[E * out, in]`` weight. For ``arch`` llama (and mixtral, a llama-arch file) the Q/K rows are un-permuted (llama.cpp
    interleaves them at conversion). The file's header is read and checked first
    (:func:`~pagedserve.model.file_headers.read_gguf_header`), then each tensor is read from a
    read-only memmap of the file and converted on its own.

    Raises:
        ModelFileError: a malformed header or a tensor with no HF name; (``quantized``) a tensor
            type outside SUPPORTED_GGUF_TYPES, found before any tensor is yielded, or a quantized
            tensor of more than 2 dimensions; Q/K rows that do not split into the given heads.
    """
    import gguf

    from pagedserve.model.gguf_names import GGUF_CONFIG_TENSORS, GGUF_PERMUTED_ARCHS, _gguf_hf_name, gguf_norm_shift

    header = read_gguf_header(path)
    names: dict[str, str] = {}
    for spec in header.tensors.values():
        if spec.name in GGUF_CONFIG_TENSORS.get(arch, ()):  # config (phi3's rope factors), not weights
            continue
        try:
            names[spec.name] = _gguf_hf_name(spec.name, arch)
        except KeyError:
            raise ModelFileError(path, f"tensor {short(spec.name)} is not a llama-family weight pagedserve knows") from None
        if quantized and spec.dtype not in SUPPORTED_GGUF_TYPES:
            raise ModelFileError(
                path, f"tensor {short(spec.name)} has ggml type {spec.dtype}; pagedserve loads only {', '.join(SUPPORTED_GGUF_TYPES)}"
            )
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for spec in header.tensors.values():
        if spec.name not in names:
            continue
        name, qtype = names[spec.name], spec.dtype
        shape = tuple(int(d) for d in reversed(spec.shape))
        data = _tensor_data(mm, spec)
        heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads if name.endswith("k_proj.weight") else None
        if arch in GGUF_PERMUTED_ARCHS and heads is not None:
            # Un-permuted before the conversion: a GGUF row holds one output row's blocks, so
            # reordering the raw rows is QuantizedWeight.permuted_rows (and _unpermute_rope) on
            # the result, on fewer bytes and without torch's gather.
            try:
                data = data[rope_row_order(shape[0], heads)]
            except ValueError as e:
                raise ModelFileError(path, f"tensor {short(spec.name)}: {e}") from None
        out: Union[QuantizedWeight, torch.Tensor]
        if quantized and qtype in FLOAT_GGUF_TYPES:
            out = _float_tensor(data, qtype, shape)
        elif quantized and len(shape) == 2:
            out = repack(data, qtype, (shape[0], shape[1]), where=f"{path}: tensor {spec.name}")
        elif quantized and len(shape) == 3 and ".experts." in name:
            # An MoE expert stack [E, out, in]: its rows are whole blocks, so it is the 2-D
            # [E * out, in] weight whose row slices are the experts (moe.canonical_weights).
            out = repack(data, qtype, (shape[0] * shape[1], shape[2]), where=f"{path}: tensor {spec.name}")
        elif quantized and len(shape) > 2:
            raise ModelFileError(path, f"tensor {short(spec.name)} of type {qtype} has {len(shape)} dimensions; quantized weights must be 2-D")
        else:  # float32, as iterate_gguf_arrays
            try:
                arr = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
            except NotImplementedError:
                raise ModelFileError(path, f"tensor {short(spec.name)} has ggml type {qtype}, which gguf cannot dequantize") from None
            out = torch.from_numpy(np.array(np.asarray(arr, dtype=np.float32).reshape(shape), dtype=np.float32, order="C", copy=True))
        del data
        shift = gguf_norm_shift(arch, name)
        if shift and isinstance(out, torch.Tensor):  # Gemma's norms, stored as 1 + w
            out = out.float() - shift
        yield name, out
