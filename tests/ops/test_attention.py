"""The CPU paged-attention kernel against a plain PyTorch reference.

Each case builds a paged cache with scattered block tables, runs the kernel for decode rows and
for prefill chunks (with and without cached context), and compares with softmax(q k^T) v
computed in float64 over the same K/V gathered contiguously. Covers the bf16 fast path
(head_dim 64/128, GQA group <= 4, full 16-token chunks and tails) and the generic path.
"""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group
from pagedserve.model.backends import CpuBackend, TorchBackend
from pagedserve.model.backends.torch_backend import write_kv_cache
from cpu_utils import cpu_flags
from pagedserve.ops import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.get_lib() is None, reason="no C compiler: CPU kernels unavailable")


def _paged_case(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = []
    for nb in blocks_per_seq:
        tables.append([free.pop() for _ in range(nb)])
    return cache, tables


def _gather(cache, table, n):
    """[2, nkv, n, hd] K/V of one sequence, contiguous."""
    kv = cache[:, table]  # [2, nb, nkv, B, hd]
    return kv.permute(0, 2, 1, 3, 4).reshape(2, cache.shape[2], -1, cache.shape[4])[:, :, :n]


def _reference(q, k, v, scale):
    """One query row ``q [H, hd]`` attending to ``k, v [nkv, n, hd]``; float64 ``[H, hd]``."""
    H, nkv = q.shape[0], k.shape[0]
    kk = k.double().repeat_interleave(H // nkv, dim=0)
    vv = v.double().repeat_interleave(H // nkv, dim=0)
    s = torch.einsum("hd,hnd->hn", q.double(), kk) * scale
    return torch.einsum("hn,hnd->hd", s.softmax(-1), vv)


def _tolerance(dtype):
    return 3e-2 if dtype == torch.bfloat16 else 1e-5


CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype)
    (9, 3, 64, 16, torch.bfloat16),  # SmolLM2 shape: bf16 fast path
    (16, 8, 128, 16, torch.bfloat16),  # Qwen3-0.6B shape: fast path, head_dim 128
    (8, 2, 64, 16, torch.bfloat16),  # group 4
    (8, 1, 64, 16, torch.bfloat16),  # group 8: generic path
    (4, 4, 32, 16, torch.bfloat16),  # head_dim 32: generic path
    (9, 3, 64, 5, torch.bfloat16),  # odd block size: tails in every block
    (16, 1, 64, 32, torch.bfloat16),  # group 16, 32-token blocks (AMX: one row of tiles per token)
    (4, 2, 64, 32, torch.bfloat16),  # 32-token blocks read 16 keys at a time (AMX)
    (9, 3, 64, 16, torch.float32),
    (6, 2, 48, 7, torch.float32),
    (8, 2, 64, 16, torch.float32),  # group 4: AVX2, 2 keys a pass
    (7, 1, 32, 16, torch.float32),  # group 7: AVX2, 1 key a pass, one chain
    (16, 1, 32, 16, torch.float32),  # group 16: generic path
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", CASES)
def test_decode_rows_match_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    seq_lens = [1, 2, 15, 16, 17, 33, 100, 257]
    cache, tables = _paged_case(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=1)
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, None, torch.tensor(seq_lens), scale, out)
    for i, n in enumerate(seq_lens):
        k, v = _gather(cache, tables[i], n)
        ref = _reference(q[i], k, v, scale)
        torch.testing.assert_close(out[i].double(), ref, atol=_tolerance(dtype), rtol=_tolerance(dtype))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", CASES)
def test_prefill_rows_match_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    # (context, chunk) per sequence: fresh prompts, a chunk after cached context, a 1-token tail.
    parts = [(0, 40), (23, 18), (0, 1), (64, 33)]
    seq_lens = [c + q for c, q in parts]
    cache, tables = _paged_case(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=2)
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    T = sum(q for _, q in parts)
    q = torch.randn(T, num_heads, head_dim).to(dtype)
    token_seq = torch.tensor([i for i, (_, ql) in enumerate(parts) for _ in range(ql)])
    token_lens = torch.tensor([p + 1 for c, ql in parts for p in range(c, c + ql)])
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, token_seq, token_lens, scale, out)
    for t in range(T):
        i, n = int(token_seq[t]), int(token_lens[t])
        k, v = _gather(cache, tables[i], n)
        ref = _reference(q[t], k, v, scale)
        torch.testing.assert_close(out[t].double(), ref, atol=_tolerance(dtype), rtol=_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_pytorch_paths_agree(dtype):
    """The CPU-kernel backend's attention vs the PyTorch backend's, on one mixed step (decodes
    then prefill chunks with and without context), the cache filled by the real write path."""
    torch.manual_seed(0)
    H, KVH, D, B = 6, 2, 64, 16
    decode_ctx = [5, 31, 80]
    prefill = [(0, 37), (48, 20)]
    ctx_all = decode_ctx + [c for c, _ in prefill]
    new_all = [1] * len(decode_ctx) + [q for _, q in prefill]
    lens = [c + q for c, q in zip(ctx_all, new_all)]
    num_blocks = sum(-(-n // B) for n in lens) + 1
    ids = list(range(1, num_blocks))
    random.Random(0).shuffle(ids)
    block_ids = []
    for n in lens:
        nb = -(-n // B)
        block_ids.append(ids[:nb])
        ids = ids[nb:]
    cache = torch.zeros(2, num_blocks, KVH, B, D, dtype=dtype)
    # Fill the cached context through the cache layout directly.
    for bids, c in zip(block_ids, ctx_all):
        for p in range(c):
            cache[:, bids[p // B], :, p % B] = torch.randn(2, KVH, D).to(dtype)
    groups, slots, start = [], [], 0
    for sl in (slice(0, len(decode_ctx)), slice(len(decode_ctx), None)):
        ql, cl, bl = new_all[sl], ctx_all[sl], block_ids[sl]
        groups.append(build_attention_group(start, ql, cl, bl, B, torch.device("cpu")))
        for q_, c_, b_ in zip(ql, cl, bl):
            slots.extend(b_[p // B] * B + p % B for p in range(c_, c_ + q_))
        start += sum(ql)
    T = start
    meta = AttentionMetadata(torch.tensor(slots), groups, B)
    q = torch.randn(T, H, D).to(dtype)
    k = torch.randn(T, KVH, D).to(dtype)
    v = torch.randn(T, KVH, D).to(dtype)
    write_kv_cache(cache, k, v, meta)
    cpu = CpuBackend(dtype, H, KVH, D)
    a = cpu.attention(q, None if cpu.fused_rope else k, None if cpu.fused_rope else v, cache, meta, D**-0.5)
    b = TorchBackend().attention(q, k, v, cache, meta, D**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_kernel_refuses_wrong_dtypes_and_shapes():
    """The wrapper returns False instead of handing the C code memory it would misread: int32
    tables/lengths, an output of another dtype or shape, too few table rows (the backend then
    raises rather than compute garbage)."""
    cache, tables = _paged_case([20, 7], 2, 64, 16, torch.bfloat16, seed=3)
    bt = torch.tensor([t + [0] * (2 - len(t)) for t in tables], dtype=torch.int64)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    lens = torch.tensor([20, 7])
    ok = lambda *a: cpu_kernels.paged_attention_cpu(*a)  # noqa: E731
    assert ok(q, cache, bt, None, lens, 0.125, torch.empty_like(q))
    assert not ok(q, cache, bt.int(), None, lens, 0.125, torch.empty_like(q))
    assert not ok(q, cache, bt, None, lens.int(), 0.125, torch.empty_like(q))
    assert not ok(q, cache, bt, None, lens, 0.125, torch.empty(2, 4, 64))
    assert not ok(q, cache, bt, None, lens, 0.125, torch.empty(1, 4, 64, dtype=torch.bfloat16))
    assert not ok(q, cache, bt[:1], None, lens, 0.125, torch.empty_like(q))
    assert not ok(q, cache, bt, torch.zeros(2, dtype=torch.int32), lens, 0.125, torch.empty_like(q))


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size,head_dim", [(9, 3, 16, 64), (8, 2, 32, 64), (16, 1, 16, 64), (16, 8, 16, 128)])
def test_prefill_row_equals_decode_row(num_heads, num_kv_heads, block_size, head_dim):
    """A prefill chunk's row (computed with the other rows of its chunk, on AMX in tiles of
    several tokens; with AVX512-BF16 or AVX2, in one task per token over all KV heads) is the same bits
    as that token decoded alone (one task per KV head): chunking and batching do not change
    attention output."""
    parts = [(0, 40), (23, 18), (0, 1), (64, 33)]
    seq_lens = [c + q for c, q in parts]
    cache, tables = _paged_case(seq_lens, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=3)
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    T = sum(q for _, q in parts)
    q = torch.randn(T, num_heads, head_dim).to(torch.bfloat16)
    token_seq = torch.tensor([i for i, (_, ql) in enumerate(parts) for _ in range(ql)])
    token_lens = torch.tensor([p + 1 for c, ql in parts for p in range(c, c + ql)])
    chunk = torch.empty_like(q)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, token_seq, token_lens, 0.125, chunk)
    alone = torch.empty_like(q)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt[token_seq].contiguous(), None, token_lens, 0.125, alone)
    assert torch.equal(chunk, alone)
    for t in (0, 17, 40, 58, 59, T - 1):  # one at a time, too
        one = torch.empty_like(q[t : t + 1])
        assert cpu_kernels.paged_attention_cpu(q[t : t + 1].contiguous(), cache, bt[token_seq[t : t + 1]].contiguous(), None, token_lens[t : t + 1].contiguous(), 0.125, one)
        assert torch.equal(one[0], chunk[t]), t


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size,head_dim", [
    (9, 3, 16, 64), (8, 2, 32, 64), (4, 4, 16, 64), (8, 4, 16, 64), (16, 8, 16, 128), (6, 3, 48, 128),
    (14, 2, 16, 64), (10, 2, 16, 72), (24, 2, 16, 64), (9, 3, 12, 64), (8, 8, 16, 64)])
def test_prefill_tiles_equal_rows_alone(num_heads, num_kv_heads, block_size, head_dim):
    """A prefill chunk's rows run in tiles of several tokens that share each K/V block (AVX512-BF16:
    transposed keys, pre-paired values; AVX2: keys and values widened once, query rows of any
    token paired over whole blocks); every row must be the same bits as that token alone, also
    where fp32 rounding depends on the order of the sums (values spanning 2^-8..2^8 around a large
    shared term), so that a changed summation order shows in the output. The shapes cover every
    AVX2 keys-per-pass and chain count (groups 1, 2, 3, 4, 5, 7, 12), both value passes (head_dim
    72: 8 wide) and a block size that is not a multiple of 8. "Alone" is the batch of decodes
    (one task per token) and, for some tokens, a call of that token by itself (one task per KV
    head). (With AMX, head_dim 64 goes through attention_amx.c's tiles, which promise the same.)"""
    g = torch.Generator().manual_seed(11)
    parts = [(0, 57), (5, 40), (31, 16), (16, 3), (0, 1), (200, 35), (47, 18)]
    seq_lens = [c + n for c, n in parts]
    cache, tables = _paged_case(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, seed=5)
    cache = (cache * torch.exp2(torch.randint(-8, 9, cache.shape, generator=g).float())).to(torch.bfloat16)
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    T = sum(n for _, n in parts)
    q = torch.randn(T, num_heads, head_dim, generator=g)
    q = (q * torch.exp2(torch.randint(-8, 9, q.shape, generator=g).float())).to(torch.bfloat16)
    # A shared 2^22 term in every score (dimension 0 of q and K): the scores sit near 512 after
    # scaling, where an fp32 ulp is 2^-14, so a changed order of the sums moves probabilities by
    # more than bf16 rounding hides; the varying parts (a few units) keep the softmax spread.
    cache[0, ..., 0] = 2.0**11
    q[..., 0] = 2.0**11
    token_seq = torch.tensor([i for i, (_, n) in enumerate(parts) for _ in range(n)])
    token_lens = torch.tensor([p + 1 for c, n in parts for p in range(c, c + n)])
    scale = 2.0**-13
    chunk = torch.empty_like(q)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, token_seq, token_lens, scale, chunk)
    alone = torch.empty_like(q)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt[token_seq].contiguous(), None, token_lens, scale, alone)
    assert torch.isfinite(chunk.float()).all()
    assert torch.equal(chunk, alone)
    for t in (0, 56, 60, 100, 120, 131, T - 1):
        one = torch.empty_like(q[t : t + 1])
        assert cpu_kernels.paged_attention_cpu(q[t : t + 1].contiguous(), cache, bt[token_seq[t : t + 1]].contiguous(), None, token_lens[t : t + 1].contiguous(), scale, one)
        assert torch.equal(one[0], chunk[t]), t


@pytest.mark.skipif(not ({"avx2", "fma"} <= cpu_flags() and "avx512f" not in cpu_flags()), reason="the AVX2 attention task runs only on CPUs with AVX2 and no AVX-512")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2), (4, 4), (7, 1), (10, 2)])
def test_avx2_bf16_value_pass_equals_8_wide_pass(num_heads, num_kv_heads):
    """AVX2, bf16 cache: with head_dim % 16 == 0, P.V reads 16 dimensions a pass (even and odd
    values from one load); other head dims take the 8-wide pass. Both must give the same bits. The
    same cache with 8 more dimensions goes through the 8-wide pass, and its first 64 output
    dimensions must equal the 16-wide result. With q = 0 every key gets the same probability, and
    each sequence's first and last values are +-2^22 around small ones: the sum cancels to a few
    units, and the low bits the running sums lose show in bf16, so a changed order of the sums
    (or chains) fails. A random q then makes the rows of a group differ."""
    g = torch.Generator().manual_seed(13)
    seq_lens = [1, 2, 15, 16, 17, 33, 100, 257]
    cache, tables = _paged_case(seq_lens, num_kv_heads, 72, 16, torch.float32, seed=7)
    cache = cache * torch.exp2(torch.randint(-8, 3, cache.shape, generator=g).float())
    for table, n in zip(tables, seq_lens):
        if n > 1:
            cache[1, table[0], :, 0] = 2.0**22
            cache[1, table[(n - 1) // 16], :, (n - 1) % 16] = -(2.0**22)
    cache = cache.to(torch.bfloat16)
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    lens = torch.tensor(seq_lens)
    cache64 = cache[..., :64].contiguous()
    q_random = torch.randn(len(seq_lens), num_heads, 72, generator=g)
    q_random[..., 64:] = 0.0  # K's extra dimensions are nonzero: q's must be 0 for equal scores
    # q = 0 for the cancelling sums; a random q too, so that rows of a group differ (a row reading
    # another row's probabilities fails).
    for q in (torch.zeros(len(seq_lens), num_heads, 72), q_random):
        q = q.to(torch.bfloat16)
        wide = torch.empty_like(q)
        assert cpu_kernels.paged_attention_cpu(q, cache, bt, None, lens, 0.125, wide)
        out = torch.empty_like(q[..., :64])
        assert cpu_kernels.paged_attention_cpu(q[..., :64].contiguous(), cache64, bt, None, lens, 0.125, out)
        assert torch.isfinite(out.float()).all()
        assert torch.equal(out, wide[..., :64])


@pytest.mark.skipif(not ({"avx2", "fma"} <= cpu_flags() and "avx512f" not in cpu_flags()), reason="the AVX2 attention task runs only on CPUs with AVX2 and no AVX-512")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 64), (10, 2, 72), (24, 2, 64), (8, 8, 128)])
def test_avx2_token_tasks_equal_head_tasks(dtype, num_heads, num_kv_heads, head_dim):
    """AVX2: a batch of decodes (one task per token over all its KV heads, each block read whole)
    gives every row the same bits as that token alone (one task per KV head), for float32 and
    bf16 caches, the 16-wide and the 8-wide P.V passes and groups up to 12. Values of +-2^22 around
    small ones make the fp32 sums lose bits that show in the output, so a row summed in another
    order, or reading another head's scores or block slice, fails."""
    g = torch.Generator().manual_seed(17)
    seq_lens = [1 + (37 * i) % 300 for i in range(48)]  # 48 tokens: token tasks on up to 12 threads
    cache, tables = _paged_case(seq_lens, num_kv_heads, head_dim, 16, torch.float32, seed=9)
    cache = cache * torch.exp2(torch.randint(-8, 3, cache.shape, generator=g).float())
    for table, n in zip(tables, seq_lens):
        if n > 1:
            cache[1, table[0], :, 0] = 2.0**22
            cache[1, table[(n - 1) // 16], :, (n - 1) % 16] = -(2.0**22)
    cache = cache.to(dtype)
    max_blocks = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
    lens = torch.tensor(seq_lens)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    batch = torch.empty_like(q)
    assert cpu_kernels.paged_attention_cpu(q, cache, bt, None, lens, 0.125, batch)
    assert torch.isfinite(batch.float()).all()
    for t in range(len(seq_lens)):
        one = torch.empty_like(q[t : t + 1])
        assert cpu_kernels.paged_attention_cpu(q[t : t + 1].contiguous(), cache, bt[t : t + 1].contiguous(), None, lens[t : t + 1].contiguous(), 0.125, one)
        assert torch.equal(one[0], batch[t]), t
