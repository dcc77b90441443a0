"""GGUF tensors repacked into pagedserve's quantized layout (pagedserve.model.gguf_quant): every
supported type dequantizes to exactly what ``gguf.quants.dequantize`` gives (random valid blocks,
negative / zero / subnormal / largest fp16 scales), the 4-bit nibble order, the errors, the
reshaping operations, and the whole default model file against ``iterate_gguf_arrays``."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedserve.model import files as model_files  # noqa: E402
from pagedserve.model import gguf_quant  # noqa: E402
from pagedserve.model.file_headers import SUPPORTED_GGUF_TYPES as HEADER_TYPES  # noqa: E402
from pagedserve.model.file_headers import read_gguf_header  # noqa: E402
from pagedserve.model.gguf_quant import (  # noqa: E402
    QUANTIZED_GGUF_TYPES,
    SUPPORTED_GGUF_TYPES,
    iterate_gguf_tensors,
    repack,
    rope_row_order,
)
from pagedserve.model.validation import ModelFileError  # noqa: E402
from pagedserve.ops.quantized import QuantizedWeight, cat_rows  # noqa: E402

# Byte offsets of each type's fp16 fields (d, and dmin / m where there is one) in a block.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# fp16 bit patterns every test draws among: zeros, subnormals, the smallest normal, the largest, ones.
SPECIAL_FP16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00], dtype=np.uint16)


def block_sizes(qtype: str) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def random_fp16(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` finite fp16 bit patterns: a third special values, a third random bit patterns (any
    exponent, either sign), a third ordinary weights' scales."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf / nan -> a subnormal
    small = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint16)
    pick = rng.integers(0, 3, n)
    return np.where(pick == 0, SPECIAL_FP16[rng.integers(0, len(SPECIAL_FP16), n)], np.where(pick == 1, bits, small)).astype(np.uint16)


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """GGUF bytes of an ``[n, k]`` tensor as GGUFReader gives them: random bytes with finite fp16
    fields (every other byte pattern is a valid block)."""
    block, type_size = block_sizes(qtype)
    raw = rng.integers(0, 256, (n, k // block * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for off in FP16_FIELDS[qtype]:
        blocks[:, off : off + 2] = random_fp16(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return raw


def reference(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(shape)))


def test_supported_gguf_types():
    assert SUPPORTED_GGUF_TYPES is HEADER_TYPES
    assert SUPPORTED_GGUF_TYPES == ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
    assert QUANTIZED_GGUF_TYPES == SUPPORTED_GGUF_TYPES[3:]


LAYOUTS = {  # type -> bits, group, has mins
    "Q8_0": (8, 32, False),
    "Q4_0": (4, 32, True),
    "Q4_1": (4, 32, True),
    "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, True),
    "Q4_K": (4, 32, True),
    "Q5_K": (8, 32, True),
    "Q6_K": (8, 16, False),
}


@pytest.mark.parametrize("qtype", QUANTIZED_GGUF_TYPES)
def test_gguf_repack_matches_gguf_dequantize(qtype):
    """Bit-identical to gguf's float32 (Q4_0: equal, a zero's sign aside), over random blocks."""
    rng = np.random.default_rng(sum(map(ord, qtype)))
    block, _ = block_sizes(qtype)
    for n, k in ((1, block), (7, 3 * block), (64, 4 * block)):
        raw = random_blocks(rng, qtype, n, k)
        qw = repack(raw, qtype, (n, k))
        bits, group, has_mins = LAYOUTS[qtype]
        assert (qw.bits, qw.group, qw.mins is not None, qw.qtype, qw.shape) == (bits, group, has_mins, qtype, (n, k))
        got, want = qw.dequantize(), reference(raw, qtype, (n, k))
        assert torch.equal(got, want)
        same_bits = got.view(torch.int32) == want.view(torch.int32)
        if qtype == "Q4_0":  # d*(q-8) vs q*d + (-8*d): -0.0 and +0.0 where q == 8
            assert bool((same_bits | ((got == 0) & (want == 0))).all())
        else:
            assert bool(same_bits.all())


@pytest.mark.parametrize("qtype", QUANTIZED_GGUF_TYPES)
def test_gguf_repack_in_chunks(qtype, monkeypatch):
    """Rows are decoded a chunk at a time: chunks of 1 and of 3 rows give the same weight."""
    rng = np.random.default_rng(7)
    block, _ = block_sizes(qtype)
    n, k = 10, 2 * block
    raw = random_blocks(rng, qtype, n, k)
    whole = repack(raw, qtype, (n, k))
    for chunk in (1, 3 * k):
        monkeypatch.setattr(gguf_quant, "_CHUNK_ELEMENTS", chunk)
        part = repack(raw, qtype, (n, k))
        assert torch.equal(part.qdata, whole.qdata) and torch.equal(part.scales, whole.scales)
        assert (part.mins is None) == (whole.mins is None) and (part.mins is None or torch.equal(part.mins, whole.mins))


@pytest.mark.parametrize("qtype", QUANTIZED_GGUF_TYPES)
def test_gguf_repack_values(qtype):
    """``values()`` are the blocks' integers, the offset of the mapping applied: with every scale
    1 and every min 0, gguf's dequantized values are those integers."""
    rng = np.random.default_rng(1)
    block, type_size = block_sizes(qtype)
    n, k = 5, 2 * block
    raw = rng.integers(0, 256, (n, k // block * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    one, zero = np.array([0x3C00], dtype=np.uint16).view(np.uint8), np.zeros(2, dtype=np.uint8)
    blocks[:, FP16_FIELDS[qtype][0] : FP16_FIELDS[qtype][0] + 2] = one
    if len(FP16_FIELDS[qtype]) == 2:
        blocks[:, 2:4] = zero  # dmin / m
    if qtype in ("Q4_K", "Q5_K"):  # the 6-bit sub-block scales 1, the mins 0
        blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16] = 1, 0, 1
    if qtype == "Q6_K":
        blocks[:, 192:208] = 1
    want = reference(raw, qtype, (n, k)).to(torch.int16)
    offset = {"Q4_0": 8}.get(qtype, 0)  # Q5_0 / Q6_K store q - 16 / q - 32 already
    qw = repack(raw, qtype, (n, k))
    assert torch.equal(qw.values() - offset, want)
    lo, hi = {"Q8_0": (-128, 127), "Q5_0": (-16, 15), "Q6_K": (-32, 31), "Q5_1": (0, 31), "Q5_K": (0, 31)}.get(qtype, (0, 15))
    v = qw.values()
    assert int(v.min()) >= lo and int(v.max()) <= hi


def pack_q4(q: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """ggml's bytes of 4-bit values ``q`` (``[n, k]``, 0..15), random fp16 scales: an independent
    writer of the block layouts (Q4_0 / Q4_1: byte j of 32 = input j | input 16+j << 4; Q4_K:
    byte j of a 64-input chunk = input j | input 32+j << 4)."""
    n, k = q.shape
    block, type_size = block_sizes(qtype)
    nb = n * k // block
    qb = q.reshape(nb, block).astype(np.uint8)
    if qtype == "Q4_K":
        c = qb.reshape(nb, 4, 2, 32)
        qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(nb, 128)
        head = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
    else:
        c = qb.reshape(nb, 2, 16)
        qs = c[:, 0] | (c[:, 1] << 4)
        head = rng.integers(0, 256, (nb, type_size - 16), dtype=np.uint8)
    head[:, :2] = random_fp16(rng, nb).view(np.uint8).reshape(-1, 2)
    if qtype != "Q4_0":
        head[:, 2:4] = random_fp16(rng, nb).view(np.uint8).reshape(-1, 2)
    return np.concatenate((head, qs), axis=1).reshape(n, -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_repack_nibble_layout(qtype):
    """4-bit ``qdata``: in each group of 32 inputs k0.., byte k0//2 + j holds input k0+j low and
    k0+16+j high, whatever the source's order."""
    rng = np.random.default_rng(2)
    n, k = 6, 512
    q = rng.integers(0, 16, (n, k))
    qw = repack(pack_q4(q, qtype, rng), qtype, (n, k))
    assert torch.equal(qw.values(), torch.from_numpy(q).to(torch.int16))
    b = qw.qdata.numpy().reshape(n, k // 32, 16).astype(np.int64)
    g = q.reshape(n, k // 32, 32)
    assert np.array_equal(b & 0xF, g[:, :, :16]) and np.array_equal(b >> 4, g[:, :, 16:])


def test_gguf_repack_errors():
    rng = np.random.default_rng(3)
    for qtype in ("Q2_K", "Q3_K", "IQ4_NL", "TQ1_0", "MXFP4", "F64", "I8"):
        with pytest.raises(ModelFileError, match=rf"{qtype}.*Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"):
            repack(np.zeros((2, 84), dtype=np.uint8), qtype, (2, 256))
    for qtype in ("F32", "F16", "BF16"):
        with pytest.raises(ModelFileError, match=f"{qtype} is a float type"):
            repack(np.zeros((2, 512), dtype=np.uint8), qtype, (2, 256))
    with pytest.raises(ModelFileError, match="must be a positive multiple of its block of 256"):
        repack(np.zeros((2, 72), dtype=np.uint8), "Q4_K", (2, 128))
    with pytest.raises(ModelFileError, match="block of 32"):
        repack(np.zeros((2, 34), dtype=np.uint8), "Q8_0", (2, 48))
    with pytest.raises(ModelFileError, match=r"must be 288 bytes \(uint8\), got uint8 \(1, 144\)"):
        repack(random_blocks(rng, "Q4_K", 1, 256), "Q4_K", (2, 256))
    with pytest.raises(ModelFileError, match=r"^blk\.0\.x: "):
        repack(np.zeros((1, 10), dtype=np.uint8), "Q4_K", (1, 256), where="blk.0.x")
    # A type given as gguf's enum is the same as its name; any shape holding the bytes is taken.
    raw = random_blocks(rng, "Q6_K", 3, 512)
    a, b = repack(raw, gguf.GGMLQuantizationType.Q6_K, (3, 512)), repack(raw.reshape(-1), "Q6_K", (3, 512))
    assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scales, b.scales)


def test_gguf_repacked_reshaping_matches_floats():
    """rows / cols / permuted_rows / cat_rows of repacked weights (and the Q/K row order) are the
    same operations on the dequantized floats, exactly."""
    rng = np.random.default_rng(4)
    n, k = 16, 512
    parts = {qt: repack(random_blocks(rng, qt, n, k), qt, (n, k)) for qt in QUANTIZED_GGUF_TYPES}
    for qw in parts.values():
        w = qw.dequantize()
        assert torch.equal(qw.rows(3, 11).dequantize(), w[3:11])
        assert torch.equal(qw.cols(256, 512).dequantize(), w[:, 256:512])
        idx = torch.from_numpy(rng.permutation(n))
        assert torch.equal(qw.permuted_rows(idx).dequantize(), w[idx])
        order = rope_row_order(n, 2)
        assert torch.equal(qw.permuted_rows(torch.from_numpy(order)).dequantize(), torch.from_numpy(model_files._unpermute_rope(w.numpy(), 2)))
    for group in (["Q4_K", "Q6_K", "Q8_0"], ["Q4_0", "Q4_1"], ["Q5_0", "Q5_1", "Q5_K"], list(QUANTIZED_GGUF_TYPES)):
        fused = cat_rows([parts[qt] for qt in group])
        assert torch.equal(fused.dequantize(), torch.cat([parts[qt].dequantize() for qt in group]))


def test_gguf_rope_row_order_is_unpermute_rope():
    x = np.arange(24 * 3).reshape(24, 3)
    for heads in (1, 2, 3, 4, 6, 12):
        assert np.array_equal(x[rope_row_order(24, heads)], model_files._unpermute_rope(x, heads))
    with pytest.raises(ValueError):
        rope_row_order(24, 5)


def write_gguf(path: str, tensors: list[tuple[str, str, tuple[int, ...]]], seed: int = 5) -> str:
    """A GGUF file of ``(name, type, HF shape)`` tensors of random valid data."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    for name, qtype, shape in tensors:
        if qtype == "F32":
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
        elif qtype == "BF16":
            raw = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif qtype in FP16_FIELDS:
            raw = random_blocks(rng, qtype, shape[0] if len(shape) == 2 else 1, shape[-1])
            w.add_tensor(name, raw if len(shape) == 2 else raw.reshape(-1), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:  # any other quantized type: random bytes (no value is checked)
            block, type_size = block_sizes(qtype)
            w.add_tensor(
                name, rng.integers(0, 256, (shape[0], shape[1] // block * type_size), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType[qtype]
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MIXED = [
    ("token_embd.weight", "Q6_K", (64, 256)),
    ("output_norm.weight", "F32", (256,)),
    ("blk.0.attn_norm.weight", "F32", (256,)),
    ("blk.0.attn_q.weight", "Q4_K", (256, 256)),  # 4 heads of 64
    ("blk.0.attn_k.weight", "Q5_K", (128, 256)),  # 2 KV heads
    ("blk.0.attn_v.weight", "BF16", (128, 256)),
    ("blk.0.attn_output.weight", "F16", (256, 256)),
    ("blk.0.ffn_gate.weight", "Q5_0", (96, 256)),
    ("blk.0.ffn_up.weight", "Q5_1", (96, 256)),
    ("blk.0.ffn_down.weight", "Q4_0", (256, 96)),
    ("blk.1.attn_q.weight", "F16", (256, 256)),  # a float Q: un-permuted too
    ("blk.1.attn_k.weight", "Q8_0", (128, 256)),
    ("blk.1.attn_q_norm.weight", "Q8_0", (64,)),  # a quantized 1-D tensor: float32
]


def test_iterate_gguf_tensors_every_type(tmp_path):
    """A file of every supported type, Q/K un-permuted: each tensor equals ``iterate_gguf_arrays``'s
    array of the same name, quantized or not; floats keep their dtype."""
    path = write_gguf(str(tmp_path / "mixed.gguf"), MIXED)
    types = {model_files._gguf_hf_name(n): t for n, t, _ in MIXED}
    want = dict(model_files.iterate_gguf_arrays(path, 4, 2, "llama"))
    got = list(iterate_gguf_tensors(path, 4, 2, "llama"))
    assert [n for n, _ in got] == list(want)
    for name, t in got:
        qtype = types[name]
        if qtype in QUANTIZED_GGUF_TYPES and want[name].ndim == 2:
            assert isinstance(t, QuantizedWeight) and t.qtype == qtype
            assert torch.equal(t.dequantize(), torch.from_numpy(want[name])), name
        else:
            assert isinstance(t, torch.Tensor)
            assert t.dtype == {"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype, torch.float32), name
            assert torch.equal(t.float(), torch.from_numpy(want[name])), name
    for name, t in iterate_gguf_tensors(path, 4, 2, "llama", quantized=False):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous()
        assert torch.equal(t, torch.from_numpy(want[name])), name
    # Not llama: no row order applied (as iterate_gguf_arrays).
    q = dict(iterate_gguf_tensors(path, 4, 2, "qwen2"))["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight)
    assert torch.equal(
        q.dequantize(), torch.from_numpy(dict(model_files.iterate_gguf_arrays(path, 4, 2, "qwen2"))["model.layers.0.self_attn.q_proj.weight"])
    )


def test_gguf_unsupported_type_refused(tmp_path):
    """A file with a type outside SUPPORTED_GGUF_TYPES: a one-line error naming the tensor, its type
    and the supported ones, at resolve time (torch-free) and before any tensor is read."""
    path = write_gguf(str(tmp_path / "q2k.gguf"), [("blk.0.attn_norm.weight", "F32", (256,)), ("blk.0.ffn_up.weight", "Q2_K", (8, 256))])
    with pytest.raises(ModelFileError) as e:
        model_files._gguf_weight_names(read_gguf_header(path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(path) and "blk.0.ffn_up.weight" in msg and "Q2_K" in msg and ", ".join(SUPPORTED_GGUF_TYPES) in msg
    it = iterate_gguf_tensors(path, 4, 2, "llama")
    with pytest.raises(ModelFileError, match=r"'blk\.0\.ffn_up\.weight' has ggml type Q2_K; pagedserve loads only F32, F16, BF16"):
        next(it)
    # Dequantized, as iterate_gguf_arrays: whatever gguf can dequantize.
    assert [n for n, _ in iterate_gguf_tensors(path, 4, 2, "llama", quantized=False)] == [
        n for n, _ in model_files.iterate_gguf_arrays(path, 4, 2, "llama")
    ]
    bad = write_gguf(str(tmp_path / "heads.gguf"), [("blk.0.attn_q.weight", "Q8_0", (36, 64))])
    with pytest.raises(ModelFileError, match="do not split into 4 heads"):
        list(iterate_gguf_tensors(bad, 4, 2, "llama"))


@pytest.fixture
def one_thread():
    """torch on one thread: dequantizing the whole model file on two threads of a loaded 2-core
    machine is ~20x slower than on one (the threads wait on each other)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def default_heads(path: str) -> tuple[int, int]:
    meta = read_gguf_header(path).metadata
    return int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])


def test_gguf_default_model_repacks_exactly(one_thread):
    """The default model file (Q4_1, a Q8_0 token_embd): every tensor, quantized or not, equals
    iterate_gguf_arrays's float32 array of the same name."""
    path = model_files.default_model_path()
    heads, kv_heads = default_heads(path)
    want = model_files.iterate_gguf_arrays(path, heads, kv_heads, "llama")
    got = iterate_gguf_tensors(path, heads, kv_heads, "llama")
    plain = iterate_gguf_tensors(path, heads, kv_heads, "llama", quantized=False)
    seen = set()
    for (wn, w), (gn, g), (pn, p) in zip(want, got, plain, strict=True):
        assert wn == gn == pn
        ref = torch.from_numpy(w)
        if isinstance(g, QuantizedWeight):
            seen.add(g.qtype)
            assert torch.equal(g.dequantize(), ref), gn
        else:
            assert g.dtype == torch.float32 and torch.equal(g, ref), gn
        assert torch.equal(p, ref), pn
    assert seen == {"Q4_1", "Q8_0"}


def test_gguf_default_model_repack_memory():
    """Repacking the default file never makes a float32 copy of a quantized tensor, and holds one
    repacked tensor at a time: (traced) memory taken while a tensor is produced stays under 0.6 x
    its float32 size (it is ~0.3-0.45: the repacked tensor and its temporaries), and the peak
    over the file under the largest repacked tensor + 16 MiB (a float32 copy of it is 108 MiB)."""
    path = model_files.default_model_path()
    heads, kv_heads = default_heads(path)
    biggest, biggest_float32, n = 0, 0, 0
    it = iterate_gguf_tensors(path, heads, kv_heads, "llama")
    tracemalloc.start()
    try:
        while True:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            try:
                name, t = next(it)
            except StopIteration:
                break
            taken = tracemalloc.get_traced_memory()[1] - before
            if isinstance(t, QuantizedWeight):
                n += 1
                float32_bytes = 4 * t.out_features * t.in_features
                assert taken < 0.6 * float32_bytes, (name, taken, float32_bytes)
                if t.nbytes > biggest:
                    biggest, biggest_float32 = t.nbytes, float32_bytes
            del t
        tracemalloc.reset_peak()
        for _, t in iterate_gguf_tensors(path, heads, kv_heads, "llama"):
            del t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 211 and biggest + (16 << 20) < biggest_float32 / 2  # the bound means something
    assert peak <= biggest + (16 << 20), (peak, biggest)
