"""Fused C element-wise ops against the PyTorch ops they replace (HF's op order and rounding)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cpu_utils import cpu_flags
from pagedserve.ops import cpu as cpu_kernels
from pagedserve.model.layers import RMSNorm, rotate_half

pytestmark = pytest.mark.skipif(cpu_kernels.get_fused_lib() is None, reason="no C compiler: CPU kernels unavailable")

DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: within 2e-6 relative. bfloat16: at most one bf16 step apart, and bit-identical for
    at least 99 % of the values (the only differences come from fp32 summation order / exp
    rounding landing on the other side of a bf16 rounding boundary)."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
        return
    diff = (a.float() - b.float()).abs()
    step = b.float().abs().clamp_min(1e-30) * 2**-7
    assert bool((diff <= step * 1.01).all()), f"max diff {diff.max().item()}"
    assert (a != b).float().mean().item() <= 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 40])
def test_add_rms_norm_matches_hf_order(dtype, dim):
    torch.manual_seed(0)
    rows = 37
    x = (torch.randn(rows, dim) * 3).to(dtype)
    res = torch.randn(rows, dim).to(dtype)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    norm = norm.to(dtype)
    with torch.no_grad():
        want_res = res + x
        want = norm(want_res)
        got, got_res = cpu_kernels.add_rms_norm(x, res.clone(), norm.weight, 1e-5)
        assert torch.equal(got_res, want_res)
        _close(got, want, dtype)
        # first layer: no residual yet, the input is the residual
        got0, res0 = cpu_kernels.add_rms_norm(x, None, norm.weight, 1e-5)
        assert res0 is x
        _close(got0, norm(x), dtype)


def _rms_in_lane_order(x, res, weight, eps):
    """add_rms_norm's arithmetic spelled out in float32 ops: the sum of squares in 16 lanes
    (lane l takes columns l, l + 16, ..), the lanes added 0 to 15, then the tail columns."""
    v = x.float() if res is None else (x.float() + res.float()).bfloat16().float()
    rows, dim = v.shape
    body = dim - dim % 16
    lanes = torch.zeros(rows, 16)
    for i in range(0, body, 16):
        lanes = lanes + v[:, i : i + 16] * v[:, i : i + 16]
    sumsq = torch.zeros(rows)
    for lane in range(16):
        sumsq = sumsq + lanes[:, lane]
    for i in range(body, dim):
        sumsq = sumsq + v[:, i] * v[:, i]
    # numpy's float32 sqrt and division are correctly rounded, as sqrtf and / in C (torch's
    # vectorised sqrt / reciprocal are not always)
    s = sumsq.numpy()
    inv = torch.from_numpy(np.float32(1) / np.sqrt(s / np.float32(dim) + np.float32(eps)))
    return (weight.float() * (v * inv[:, None]).bfloat16().float()).bfloat16()


@pytest.mark.skipif("avx512_bf16" in cpu_flags(), reason="the AVX512-BF16 rows add their lanes as a tree")
@pytest.mark.parametrize("dim", [576, 2048, 48, 40])
def test_add_rms_norm_bf16_rows_keep_the_lane_order(dim):
    """bf16 rows (the AVX2 rows and the scalar loop) give the bits of the scalar order. The
    values span many magnitudes so that another order of the sum moves some outputs across a
    bf16 rounding boundary (a reversed lane sum changes ~10 of these outputs)."""
    g = torch.Generator().manual_seed(3)
    for rows in (1, 5, 3000):
        x = (torch.randn(rows, dim, generator=g) * torch.exp(torch.randn(rows, dim, generator=g) * 3)).bfloat16()
        res = torch.randn(rows, dim, generator=g).bfloat16()
        w = torch.randn(dim, generator=g).bfloat16()
        got, got_res = cpu_kernels.add_rms_norm(x, res.clone(), w, 1e-5)
        assert torch.equal(got, _rms_in_lane_order(x, res, w, 1e-5)), (dim, rows)
        assert torch.equal(got_res, x + res)
        got0, _ = cpu_kernels.add_rms_norm(x, None, w, 1e-5)
        assert torch.equal(got0, _rms_in_lane_order(x, None, w, 1e-5)), (dim, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 72])
def test_silu_mul_matches_torch(dtype, inter):
    torch.manual_seed(1)
    gu = (torch.randn(19, 2 * inter) * 4).to(dtype)
    gate, up = gu.split(inter, dim=-1)
    _close(cpu_kernels.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 1, 6), (3, 1, 80), (2, 2, 24)])
def test_rope_write_kv_matches_hf(dtype, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(2)
    T, block_size, num_blocks, max_pos = 23, 16, 8, 200
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim)
    zeros = torch.rand(qkv.shape) < 0.2  # +0 and -0 inputs: the rotation must keep HF's zero signs
    qkv[zeros] = torch.where(torch.rand(int(zeros.sum())) < 0.5, 0.0, -0.0)
    qkv = qkv.to(dtype)
    positions = torch.randint(0, max_pos, (T,))
    slots = torch.randperm(num_blocks * block_size)[:T]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([torch.outer(torch.arange(max_pos).float(), inv_freq)] * 2, dim=-1)
    cos_t, sin_t = emb.cos().contiguous(), emb.sin().contiguous()
    cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
    qk_end = (num_heads + num_kv_heads) * head_dim
    q = cpu_kernels.rope_write_kv(qkv[:, :qk_end], qkv[:, qk_end:], positions, slots, cos_t, sin_t, cache, num_heads)
    # HF apply_rotary_pos_emb with cos/sin cast to the model dtype
    cos, sin = cos_t[positions].to(dtype)[:, None], sin_t[positions].to(dtype)[:, None]
    qk = qkv[:, :qk_end].view(T, num_heads + num_kv_heads, head_dim)
    want = qk * cos + rotate_half(qk) * sin
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(q.view(bits), want[:, :num_heads].contiguous().view(bits))
    blk, off = slots // block_size, slots % block_size
    assert torch.equal(cache[0][blk, :, off].contiguous().view(bits), want[:, num_heads:].contiguous().view(bits))
    assert torch.equal(cache[1][blk, :, off], qkv[:, qk_end:].view(T, num_kv_heads, head_dim))


def test_fused_forward_checks_positions_and_slots(tiny_model_factory):
    """The fused RoPE + cache write indexes the RoPE table and the cache in C: out-of-range
    positions or slots must raise, not read or write outside them."""
    from pagedserve import LLM
    from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group

    if not cpu_kernels.prefill_kernel_preferred(torch.bfloat16, 4, 2, 64):
        pytest.skip("the fused RoPE path needs the bf16 kernel fast path (AVX512-BF16, or AVX2 + FMA without AVX-512)")
    llm = LLM(tiny_model_factory("llama", head_dim=64), dtype="bfloat16", num_kv_blocks=8, max_model_len=64)
    model = llm.llm_engine.core.worker.model_runner.model
    kv = llm.llm_engine.core.worker.model_runner.kv_caches
    group = build_attention_group(0, [2], [0], [[1]], 16, torch.device("cpu"))
    with torch.inference_mode():
        with pytest.raises(IndexError, match="positions"):
            model(torch.tensor([5, 6]), torch.tensor([0, 10**6]), kv, AttentionMetadata(torch.tensor([16, 17]), [group], 16))
        with pytest.raises(IndexError, match="slot_mapping"):
            model(torch.tensor([5, 6]), torch.tensor([0, 1]), kv, AttentionMetadata(torch.tensor([16, 8 * 16]), [group], 16))
        model(torch.tensor([5, 6]), torch.tensor([0, 1]), kv, AttentionMetadata(torch.tensor([16, 17]), [group], 16))


def test_argmax_bf16_rows_equals_torch_first_max():
    """The C greedy argmax picks torch.max's index: the first maximum on ties (many ties here,
    from a few distinct values), the first NaN in a row that has one, any row length."""
    g = torch.Generator().manual_seed(5)
    for rows, cols in ((64, 49152), (3, 31), (5, 17), (2, 1), (7, 1000)):
        x = torch.randint(0, 6, (rows, cols), generator=g).to(torch.bfloat16)
        assert torch.equal(cpu_kernels.argmax_bf16(x), x.max(-1).indices), (rows, cols)
        y = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        assert torch.equal(cpu_kernels.argmax_bf16(y), y.argmax(-1))
    z = torch.randn(4, 100, generator=g).to(torch.bfloat16)
    z[1, 40] = float("nan")
    z[1, 70] = float("nan")
    z[2, 3] = float("inf")
    got = cpu_kernels.argmax_bf16(z)
    assert got[1] == 40 and got[2] == 3 and torch.equal(got, z.max(-1).indices)
    for cols in (33, 47, 49, 100, 49153):  # a NaN in the tail after the 16-wide blocks
        t = torch.randn(3, cols, generator=g).to(torch.bfloat16)
        t[:, -1] = float("nan")
        t[1, cols // 2] = float("nan")
        assert torch.equal(cpu_kernels.argmax_bf16(t), t.max(-1).indices), cols
    wide = torch.randn(3, 300, generator=g).to(torch.bfloat16)
    assert torch.equal(cpu_kernels.argmax_bf16(wide[:, 10:260]), wide[:, 10:260].max(-1).indices)  # strided rows


def test_argmax_bf16_lanes_ties_and_early_nans():
    """The vector scans (16 columns a pass) against torch.max: a tie of two maxima at every pair of
    positions over 40 columns (across lanes, passes and the tail), +0 / -0 ties, rows of -inf,
    and a NaN at every position of a 48-column row (in the first pass included)."""
    cols = 40
    pairs = [(i, j) for i in range(cols) for j in range(i + 1, cols)]
    for hi, lo in ((2.0, 1.0), (0.0, -1.0), (float("inf"), 3.0)):
        x = torch.full((len(pairs), cols), lo)
        for r, (i, j) in enumerate(pairs):
            x[r, i] = x[r, j] = hi
        x = x.bfloat16()
        assert torch.equal(cpu_kernels.argmax_bf16(x), x.max(-1).indices), hi
    zeros = torch.zeros(len(pairs), cols)
    for r, (i, j) in enumerate(pairs):  # -0 first, +0 later: equal values, the first one wins
        zeros[r] = -1.0
        zeros[r, i], zeros[r, j] = -0.0, 0.0
    zeros = zeros.bfloat16()
    assert torch.equal(cpu_kernels.argmax_bf16(zeros), zeros.max(-1).indices)
    neg_inf = torch.full((3, 50), float("-inf")).bfloat16()
    assert torch.equal(cpu_kernels.argmax_bf16(neg_inf), torch.zeros(3, dtype=torch.int64))
    nan_rows = torch.randn(48, 48, generator=torch.Generator().manual_seed(6))
    nan_rows[torch.arange(48), torch.arange(48)] = float("nan")
    assert torch.equal(cpu_kernels.argmax_bf16(nan_rows.bfloat16()), torch.arange(48))
    with pytest.raises(ValueError, match="empty"):
        cpu_kernels.argmax_bf16(torch.zeros(2, 0, dtype=torch.bfloat16))


def test_rope_write_kv_refuses_odd_head_dim():
    qkv = torch.zeros(1, 3 * 17, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1, 1, 16, 17, dtype=torch.bfloat16)
    table = torch.zeros(4, 17)
    with pytest.raises(ValueError, match="even head_dim"):
        cpu_kernels.rope_write_kv(qkv[:, :34], qkv[:, 34:], torch.zeros(1, dtype=torch.int64),
                                  torch.zeros(1, dtype=torch.int64), table, table, cache, 1)
