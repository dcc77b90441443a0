"""Sliding-window attention in the CPU paged-attention kernel (``window`` of
:func:`paged_attention_cpu`) against a float64 masked reference.

HF's rule (Mistral, Gemma 2/3): the query at position ``p`` reads key ``k`` iff
``p - window < k <= p``, i.e. a token with ``token_lens = n`` reads keys ``[max(0, n - window), n)``.
Every slot no token of the call may read is NaN (K, V, and the int8 cache's scales), and blocks
wholly before a sequence's window are NaN too, as a freed and reused block could be: an output
that reads one is NaN. Windows 1, 5, 16, 17, 40 around block size 16 (and 32 for AMX's 32-key
P.V steps), decode rows, prefill chunks with and without cached context, GQA groups 1/3/4 and 8
(generic), head_dim 64/128 and 48 (generic), bf16, float32 and the int8 cache. Batched rows must
be the same bits as each row alone (one task per token vs per (token, KV head)), and a prefill
row the same bits as its decode row. The host's own path runs in-process; every other ISA unit
in a child with ``PAGEDSERVE_CPU_ISA`` capping the level (read once per library).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from pagedserve.ops import cpu as cpu_kernels
from pagedserve.ops import kv_int8

pytestmark = pytest.mark.skipif(cpu_kernels.get_lib() is None, reason="no C compiler: CPU kernels unavailable")

WINDOWS = [1, 5, 16, 17, 40]
SHAPES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype, int8 cache)
    (9, 3, 64, 16, torch.bfloat16, False),  # AMX / AVX512-BF16 / AVX2, group 3
    (16, 4, 128, 16, torch.bfloat16, False),  # head_dim 128, group 4
    (4, 4, 64, 32, torch.bfloat16, False),  # group 1, 32-token blocks
    (8, 1, 64, 16, torch.bfloat16, False),  # group 8: generic (AMX takes it)
    (6, 2, 48, 16, torch.float32, False),  # head_dim 48: generic
    (8, 2, 64, 16, torch.float32, False),
    (9, 3, 64, 16, torch.bfloat16, True),  # int8 cache (AMX, AVX512-BF16, generic)
    (8, 2, 128, 16, torch.float32, True),
]
DECODE_LENS = [1, 2, 15, 16, 17, 33, 100, 257]
PREFILL_PARTS = [(0, 40), (23, 18), (0, 1), (64, 33)]  # (cached context, chunk)


def _first_key(n: int, window: int) -> int:
    return max(0, n - window) if window > 0 else 0


def _case(seq_lens, reads, num_kv_heads, head_dim, block_size, dtype, int8, seed):
    """A paged cache with scattered blocks: ``(cache, tables, dense K/V per sequence)``. Only
    the slots of ``reads[i] = (lo, hi)`` (keys any token of sequence i may read) are finite;
    every other slot, every block wholly outside them, and the blocks of no sequence are NaN.
    ``dense[i]``: float64 ``[2, num_kv_heads, n, head_dim]`` as the kernel should see it."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nbs) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for nb in nbs:
        tables.append(perm[at : at + nb])
        at += nb
    x = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=g)
    if int8:
        cache = torch.zeros(*kv_int8.cache_shape(num_blocks, num_kv_heads, block_size, head_dim), dtype=torch.int8)
        for i in range(2):
            values, scales = kv_int8.split(cache[i], block_size, head_dim)
            q, s = kv_int8.quantize(x[i].to(dtype))
            values.copy_(q)
            scales.copy_(s)
        deq = torch.stack([kv_int8.dequantize(*kv_int8.split(cache[i], block_size, head_dim), torch.float64) for i in range(2)])
    else:
        cache = x.to(dtype)
        deq = cache.double()
    keep = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for table, (lo, hi) in zip(tables, reads):
        for k in range(lo, hi):
            keep[table[k // block_size], k % block_size] = True
    dense = [deq[:, t].permute(0, 2, 1, 3, 4).reshape(2, num_kv_heads, -1, head_dim)[:, :, :n] for t, n in zip(tables, seq_lens)]
    if int8:  # the scales of unread rows: NaN dequantizes every value of the row to NaN
        for i in range(2):
            _, scales = kv_int8.split(cache[i], block_size, head_dim)
            scales.masked_fill_(~keep[:, None, :], float("nan"))
    else:
        cache.masked_fill_(~keep[None, :, None, :, None], float("nan"))
    max_blocks = max(nbs)
    bt = torch.tensor([t + [perm[-1]] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)  # padding: a NaN block
    return cache, bt, dense


def _reference(q, kv, n, window, scale, softcap=0.0):
    """``q [H, hd]`` over keys ``[max(0, n - window), n)`` of ``kv [2, nkv, >=n, hd]`` (scaled
    scores capped to ``softcap * tanh(s / softcap)`` with a softcap); float64."""
    lo = _first_key(n, window)
    k, v = kv[0, :, lo:n], kv[1, :, lo:n]
    rep = q.shape[0] // k.shape[0]
    s = torch.einsum("hd,hnd->hn", q.double(), k.repeat_interleave(rep, 0)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return torch.einsum("hn,hnd->hd", s.softmax(-1), v.repeat_interleave(rep, 0))


def _tolerance(dtype):
    return 3e-2 if dtype == torch.bfloat16 else 1e-5


def _check_rows_alone(q, cache, bt, token_seq, lens, scale, out, block_size, window, rows, softcap=0.0):
    """Rows of a batched call equal each row in a call of its own (one task per KV head)."""
    for t in rows:
        one = torch.empty_like(q[t : t + 1])
        table = bt[t : t + 1] if token_seq is None else bt[token_seq[t : t + 1]]
        ok = cpu_kernels.paged_attention_cpu(
            q[t : t + 1].contiguous(), cache, table.contiguous(), None, lens[t : t + 1].contiguous(), scale, one, block_size, window, softcap
        )
        assert ok
        assert torch.equal(one[0], out[t]), (t, window)


def check_decode(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window, softcap=0.0):
    reads = [(_first_key(n, window), n) for n in DECODE_LENS]
    cache, bt, dense = _case(DECODE_LENS, reads, num_kv_heads, head_dim, block_size, dtype, int8, seed=window)
    g = torch.Generator().manual_seed(100 + window)
    q = (torch.randn(len(DECODE_LENS), num_heads, head_dim, generator=g) * (4 if softcap else 1)).to(dtype)
    lens = torch.tensor(DECODE_LENS)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, None, lens, scale, out, block_size, window, softcap)
    assert torch.isfinite(out.float()).all(), window
    for i, n in enumerate(DECODE_LENS):
        want = _reference(q[i], dense[i], n, window, scale, softcap)
        torch.testing.assert_close(out[i].double(), want, atol=_tolerance(dtype), rtol=_tolerance(dtype))
    _check_rows_alone(q, cache, bt, None, lens, scale, out, block_size, window, (0, 4, 7), softcap)


def check_prefill(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window, softcap=0.0):
    seq_lens = [c + m for c, m in PREFILL_PARTS]
    reads = [(_first_key(c + 1, window), c + m) for c, m in PREFILL_PARTS]
    cache, bt, dense = _case(seq_lens, reads, num_kv_heads, head_dim, block_size, dtype, int8, seed=50 + window)
    T = sum(m for _, m in PREFILL_PARTS)
    g = torch.Generator().manual_seed(200 + window)
    q = (torch.randn(T, num_heads, head_dim, generator=g) * (4 if softcap else 1)).to(dtype)
    token_seq = torch.tensor([i for i, (_, m) in enumerate(PREFILL_PARTS) for _ in range(m)])
    lens = torch.tensor([p + 1 for c, m in PREFILL_PARTS for p in range(c, c + m)])
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, token_seq, lens, scale, out, block_size, window, softcap)
    assert torch.isfinite(out.float()).all(), window
    for t in range(T):
        want = _reference(q[t], dense[int(token_seq[t])], int(lens[t]), window, scale, softcap)
        torch.testing.assert_close(out[t].double(), want, atol=_tolerance(dtype), rtol=_tolerance(dtype))
    # the chunk's rows as decodes of the same positions: the same bits
    alone = torch.empty_like(q)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt[token_seq].contiguous(), None, lens, scale, alone, block_size, window, softcap)
    assert torch.equal(alone, out), window
    _check_rows_alone(q, cache, bt, token_seq, lens, scale, out, block_size, window, (0, 39, 41, 58, 59, T - 1), softcap)


def run_all() -> None:
    """Every shape with windows 1 and 40 (one key; several blocks), a softcap with window 17 (a
    block and one) and alone: what a child process under an ISA cap runs."""
    for shape in SHAPES:
        for window in (1, 40):
            check_decode(*shape, window)
            check_prefill(*shape, window)
        check_decode(*shape, 17, 5.0)
        check_prefill(*shape, 0, 5.0)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,int8", SHAPES)
def test_window_matches_masked_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window):
    check_decode(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window)
    check_prefill(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window)


@pytest.mark.parametrize("window", [0, 17])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,int8", SHAPES)
def test_softcap_matches_capped_reference(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window):
    """Gemma 2's attention-logit softcap (``cap * tanh(s / cap)`` of the scaled scores, cap 5 on
    scores of several units, so that it bites) in every unit, alone and with a window."""
    check_decode(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window, 5.0)
    check_prefill(num_heads, num_kv_heads, head_dim, block_size, dtype, int8, window, 5.0)


def test_softcap_changes_the_result():
    """Guard against the softcap tests passing vacuously: the capped reference differs."""
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(4, 64, generator=g) * 4, torch.randn(2, 2, 30, 64, generator=g).double()
    assert (_reference(q, kv, 30, 0, 0.125, 5.0) - _reference(q, kv, 30, 0, 0.125)).abs().max() > 0.1


def test_window_zero_is_full_attention_and_negative_is_refused():
    """``window = 0`` is the old entry point's full attention, bit for bit; a window covering
    every key gives the same numbers through the window entry; a negative window is refused."""
    lens = [5, 40, 100]
    cache, bt, _ = _case(lens, [(0, n) for n in lens], 3, 64, 16, torch.bfloat16, False, seed=7)
    q = torch.randn(len(lens), 9, 64).to(torch.bfloat16)
    full, wide = torch.empty_like(q), torch.empty_like(q)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, None, torch.tensor(lens), 0.125, full, 16)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, None, torch.tensor(lens), 0.125, wide, 16, 100)
    assert torch.equal(full, wide)
    assert not cpu_kernels.paged_attention_cpu(q, cache, bt, None, torch.tensor(lens), 0.125, wide, 16, -1)


_CHILD = "import sys; sys.path.insert(0, 'tests/ops'); import test_attention_window as m; m.run_all(); print('ok', sys.argv[1])"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the ISA units are x86-64's")
@pytest.mark.parametrize("cap", ["scalar", "avx2", "avx512", "avx512bf16"])
def test_window_under_each_isa_cap(cap):
    """The same cases on the paths of older CPUs: the generic task (plain C, 8 and 16 lanes), the
    AVX2 tasks, the AVX512-BF16 tasks (a cap above the host's level runs the host's)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PAGEDSERVE_CPU_ISA=cap, OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", _CHILD, cap], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ok {cap}" in r.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(5, None), (17, None), (None, 3.0), (9, 3.0)])
def test_cpu_backend_runs_windowed_layers_in_the_kernel(dtype, window, softcap, monkeypatch):
    """``CpuBackend.attention`` with a window and/or Gemma 2's softcap: the kernel (not PyTorch's path) for decode rows,
    and for prefill chunks where the kernel takes them (bf16 fast path), equal to the PyTorch
    backend's windowed attention on one mixed step (decodes, then chunks with and without
    context), the cache filled by the real write path."""
    from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group
    from pagedserve.model.backends import CpuBackend, TorchBackend, cpu_backend
    from pagedserve.model.backends.torch_backend import write_kv_cache

    H, KVH, D, B = 6, 2, 64, 16
    g = torch.Generator().manual_seed(window or 0)
    ctx_all = [5, 31, 80, 0, 48]
    new_all = [1, 1, 1, 37, 20]
    lens = [c + m for c, m in zip(ctx_all, new_all)]
    ids = torch.randperm(sum(-(-n // B) for n in lens) + 1, generator=g).tolist()
    block_ids = []
    for n in lens:
        block_ids.append(ids[: -(-n // B)])
        ids = ids[-(-n // B) :]
    cache = torch.randn(2, len(ids) + sum(len(b) for b in block_ids), KVH, B, D, generator=g).to(dtype)
    groups, slots, start = [], [], 0
    for sl in (slice(0, 3), slice(3, None)):
        ql, cl, bl = new_all[sl], ctx_all[sl], block_ids[sl]
        groups.append(build_attention_group(start, ql, cl, bl, B, torch.device("cpu")))
        for q_, c_, b_ in zip(ql, cl, bl):
            slots.extend(b_[p // B] * B + p % B for p in range(c_, c_ + q_))
        start += sum(ql)
    meta = AttentionMetadata(torch.tensor(slots), groups, B)
    q, k, v = (torch.randn(start, h, D, generator=g).to(dtype) for h in (H, KVH, KVH))
    write_kv_cache(cache, k, v, meta)
    cpu = CpuBackend(dtype, H, KVH, D)
    seen = []
    real_sdpa = cpu_backend.sdpa_attention
    monkeypatch.setattr(cpu_backend, "sdpa_attention", lambda *a: (seen.append(a[5].is_decode), real_sdpa(*a)))
    a = cpu.attention(q, None if cpu.fused_rope else k, None if cpu.fused_rope else v, cache, meta, D**-0.5, window, softcap)
    assert seen == ([] if cpu.fused_rope else [False])  # decodes always in the kernel
    b = TorchBackend().attention(q, k, v, cache, meta, D**-0.5, window, softcap)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
