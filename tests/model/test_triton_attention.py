"""The Triton paged-attention kernel (``pagedserve/model/backends/triton_attention.py``) on CPU
tensors under Triton's interpreter, against a float64 reference built from the same paged cache
(gather through the block table + explicit causal softmax).

Every case: block tables shuffled over the pool, partial last blocks, every cache slot that no
sequence owns poisoned with NaN (a read past a sequence's end shows), and the output pre-filled
with NaN (a row the kernel forgets shows). float32 and float16 only: the interpreter computes
bfloat16 on the raw bits, so bf16 is checked on a GPU only.

``TRITON_INTERPRET=1`` is set before the kernel module is imported (``triton.jit`` reads it at
decoration) and restored right after, so it does not leak into other tests; the module is
reloaded if an earlier test imported it compiled.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group
from pagedserve.model.backends.torch_backend import TorchBackend, write_kv_cache
from pagedserve.ops import kv_int8

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="triton is not installed (make setup installs it on Linux x86-64)")
    from triton.runtime.interpreter import InterpretedFunction

    from pagedserve.model.backends import triton_attention as ta

    if not isinstance(ta._paged_attention_kernel, InterpretedFunction):
        ta = importlib.reload(ta)
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Interpreter mode while a test runs; and Triton 3.6's interpreter made to work with NumPy
    >= 2.4, which refuses ``int()`` of the 1-element arrays the interpreter keeps scalars in (a
    loop over runtime bounds fails): the upstream fix (triton-lang/triton#9171, PR #9172),
    applied for the test only."""
    from triton.runtime import interpreter

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    orig = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}
# decodes after 5, 17 and 40 cached tokens; a fresh 21-token prompt; a 9-token chunk after 23
MIXED = ([1, 1, 1, 21, 9], [5, 17, 40, 0, 23])


def make_case(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, int8=False, seed=0, device="cpu", window=None):
    """A flat batch and its paged cache: ``(query [T, Hq, D], kv_cache, block_tables int32,
    query_start_loc int32, seq_lens int32)``. Sequence i's blocks are drawn from a shuffled pool
    (with spare blocks); slots no sequence owns hold NaN (NaN scales in the int8 cache), and with
    a ``window`` so do the slots before the first key any of the sequence's new tokens reads."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    nblk = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seq_lens), max(nblk) + 1, dtype=torch.int32)  # a spare column: entries past the end
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, (n, L) in enumerate(zip(nblk, seq_lens)):
        ids, perm = perm[:n], perm[n:]
        table[i, :n] = torch.tensor(ids, dtype=torch.int32)
        first = 0 if window is None else max(0, ctx_lens[i] - window + 1)
        for p in range(first, L):
            owned[ids[p // block_size], p % block_size] = True
    kv = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=g)
    if int8:
        cache = torch.zeros(kv_int8.cache_shape(num_blocks, num_kv_heads, block_size, head_dim), dtype=torch.int8)
        for i in range(2):
            values, scales = kv_int8.split(cache[i], block_size, head_dim)
            qv, sc = kv_int8.quantize(kv[i])
            values.copy_(qv)
            scales.copy_(torch.where(owned[:, None, :], sc, torch.nan))
    else:
        cache = torch.where(owned[None, :, None, :, None], kv, torch.nan).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    dev = torch.device(device)
    return query.to(dev), cache.to(dev), table.to(dev), starts.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev)


def reference(query, kv_cache, block_tables, query_lens, ctx_lens, block_size, scale, window=None, softcap=None):
    """float64 attention of each sequence's new tokens to its gathered K/V (causal; with a
    ``window`` the query at ``p`` reads keys ``(p - window, p]``; ``softcap``: Gemma 2's
    ``cap * tanh(s / cap)`` of the scaled scores)."""
    head_dim, num_heads = query.shape[2], query.shape[1]
    if kv_cache.dtype == torch.int8:
        parts = [kv_int8.split(kv_cache[i].cpu(), block_size, head_dim) for i in range(2)]
        kv = torch.stack([v.double() * s.double()[..., None] for v, s in parts])
    else:
        kv = kv_cache.cpu().double()
    out = torch.empty(query.shape, dtype=torch.float64)
    t = 0
    for i, (ql, cl) in enumerate(zip(query_lens, ctx_lens)):
        L = ql + cl
        ids = block_tables[i, : -(-L // block_size)].long().cpu()
        k, v = (kv[j][ids].permute(0, 2, 1, 3).reshape(-1, kv.shape[2], head_dim)[:L] for j in range(2))  # [L, Hkv, D]
        rep = num_heads // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        q = query[t : t + ql].cpu().double()
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        q_pos = (cl + torch.arange(ql))[:, None]
        allowed = torch.arange(L)[None, :] <= q_pos
        if window is not None:
            allowed &= torch.arange(L)[None, :] > q_pos - window
        # keys outside every window are NaN in the cache: zero them so 0 * NaN stays out
        v = torch.where(allowed.any(0)[:, None, None], v, 0.0)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        out[t : t + ql] = torch.einsum("hqk,khd->qhd", p, v)
        t += ql
    return out


def run_kernel(case, query_lens, block_size=16, num_splits=None, window=None, softcap=None):
    query, cache, table, starts, seq_lens = case
    out = torch.full_like(query, float("nan"))
    max_seq = int(seq_lens.max())
    ta.triton_paged_attention(
        query,
        cache,
        table,
        starts,
        seq_lens,
        query.shape[2] ** -0.5,
        out,
        block_size,
        max(query_lens),
        max_seq,
        num_splits=num_splits,
        window=window,
        softcap=softcap,
    )
    assert not out.isnan().any(), f"{int(out.isnan().any(-1).any(-1).sum())} rows unwritten or read NaN"
    return out


def check(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, int8=False, block_size=16, num_splits=None, window=None, softcap=None):
    case = make_case(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size, int8, window=window)
    out = run_kernel(case, query_lens, block_size, num_splits, window, softcap)
    ref = reference(case[0], case[1], case[2], query_lens, ctx_lens, block_size, head_dim**-0.5, window, softcap)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("qpk,head_dim", [(1, 64), (3, 64), (4, 64), (1, 128), (3, 128), (4, 128)])
def test_triton_mixed_batch_matches_float64(dtype, qpk, head_dim):
    """Decodes, a fresh prompt and a chunk after cached context in one launch, GQA 1/3/4."""
    check(*MIXED, num_heads=2 * qpk, num_kv_heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_int8_cache_matches_float64(dtype):
    """The int8 cache dequantized in the kernel (per-token K scales on the scores, V scales on
    the probabilities) against float64 attention over the dequantized cache."""
    check(*MIXED, num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype, int8=True)


def test_triton_odd_block_size_and_head_dim():
    """A block size that is not a power of 2 nor a divisor of the key tile, and head_dim 80
    (padded to 128 inside the kernel)."""
    check([1, 6], [30, 11], num_heads=4, num_kv_heads=1, head_dim=80, dtype=torch.float32, block_size=12)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32-cache", "int8-cache"])
def test_triton_split_kv_matches_float64_and_unsplit(int8):
    """Split-KV decode (4 shares, some empty for the short sequence) equals the float64
    reference and the one-share launch."""
    lens = ([1, 1, 1], [150, 260, 7])
    split = check(*lens, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, int8=int8, num_splits=4)
    whole = check(*lens, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, int8=int8, num_splits=1)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_triton_sliding_window_matches_float64(window):
    """A sliding window (HF's rule) in the mixed batch: decodes, a fresh prompt longer than the
    window and a chunk after context, GQA 3; every slot before a sequence's first read key NaN
    (a key read before the window shows)."""
    check(*MIXED, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32, window=window)


@pytest.mark.parametrize("qpk,head_dim,dtype", [(1, 128, torch.float32), (4, 64, torch.float16)], ids=["gqa1-128-fp32", "gqa4-64-fp16"])
def test_triton_sliding_window_other_shapes(qpk, head_dim, dtype):
    check(*MIXED, num_heads=2 * qpk, num_kv_heads=2, head_dim=head_dim, dtype=dtype, window=17)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_sliding_window_int8_and_split_kv(num_splits):
    """The int8 cache (NaN scales outside the windows) and split-KV decode under a window: the
    shares divide the key tiles from the window's first, one sequence shorter than the window."""
    check([1, 1, 1], [150, 260, 7], num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, int8=True, num_splits=num_splits, window=40)
    check([1, 1, 1], [150, 260, 7], num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, num_splits=num_splits, window=100)


@pytest.mark.parametrize("window", [None, 17])
def test_triton_softcap_matches_float64(window):
    """Gemma 2's attention-logit softcap (scores scaled up so that the cap bites), with and
    without a window, float32 and the int8 cache."""
    for int8 in (False, True):
        case = make_case(*MIXED, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.float32, int8=int8, window=window)
        case = (case[0] * 8, *case[1:])  # scores of tens: tanh far from linear at cap 20
        out = run_kernel(case, MIXED[0], window=window, softcap=20.0)
        ref = reference(case[0], case[1], case[2], *MIXED, 16, 64**-0.5, window, 20.0)
        torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
        plain = reference(case[0], case[1], case[2], *MIXED, 16, 64**-0.5, window)
        assert (plain - ref).abs().max() > 1e-2  # the cap changes the result


def test_triton_choose_num_splits():
    assert ta.choose_num_splits(1, 8, 1, 4096, 132) == 16
    assert ta.choose_num_splits(4, 8, 1, 4096, 132) == 4
    assert ta.choose_num_splits(1, 8, 1, 300, 132) == 2  # 9 tiles: two shares of >= 4
    assert ta.choose_num_splits(1, 8, 1, 100, 132) == 1  # too short to split
    assert ta.choose_num_splits(1, 8, 7, 4096, 132) == 1  # prefill tokens: no split
    assert ta.choose_num_splits(64, 8, 1, 4096, 132) == 1  # fills the GPU already
    assert ta.choose_num_splits(1, 8, 1, 4096, 0) == 1  # not a GPU


@pytest.mark.parametrize("window,softcap", [(None, None), (17, None), (9, 2.0)], ids=["full", "window", "window-softcap"])
@pytest.mark.parametrize("int8", [False, True], ids=["fp32-cache", "int8-cache"])
def test_triton_backend_matches_torch_backend(int8, window, softcap):
    """TritonBackend.attention on a step's AttentionMetadata (a decode group, then a prefill
    group with a fresh prompt and a chunk after context) equals TorchBackend's gather + SDPA,
    also for a windowed (and softcapped) layer, which the kernel now takes itself."""
    B, H, KVH, D = 16, 6, 2, 64
    dec_q, dec_c = [1, 1], [20, 33]
    pre_q, pre_c = [18, 5], [0, 37]
    num_blocks = 24
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows = []
    for n in [q + c for q, c in zip(dec_q + pre_q, dec_c + pre_c)]:
        k = -(-n // B)
        rows.append(perm[:k])
        perm = perm[k:]
    groups = [
        build_attention_group(0, dec_q, dec_c, rows[:2], B, torch.device("cpu")),
        build_attention_group(2, pre_q, pre_c, rows[2:], B, torch.device("cpu")),
    ]
    slots = [rows[i][p // B] * B + p % B for i, (q, c) in enumerate(zip(dec_q + pre_q, dec_c + pre_c)) for p in range(c + q)]
    shape = kv_int8.cache_shape(num_blocks, KVH, B, D) if int8 else (2, num_blocks, KVH, B, D)
    cache = torch.zeros(shape, dtype=torch.int8 if int8 else torch.float32)
    # the whole context, then the step's tokens (the flat batch is each sequence's last q tokens)
    all_meta = AttentionMetadata(torch.tensor(slots), [], B)
    write_kv_cache(cache, torch.randn(len(slots), KVH, D, generator=g), torch.randn(len(slots), KVH, D, generator=g), all_meta)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), groups, B)
    query = torch.randn(sum(dec_q + pre_q), H, D, generator=g)
    want = TorchBackend().attention(query, None, None, cache, meta, D**-0.5, window, softcap)
    got = ta.TritonBackend().attention(query, None, None, cache, meta, D**-0.5, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_triton_backend_chosen_for_cuda_only(monkeypatch):
    """select_backend: TritonBackend for a CUDA device (nothing launched), not with the switch
    off, never on the CPU."""
    from types import SimpleNamespace

    from pagedserve.model.backends import select_backend

    attn = SimpleNamespace(num_heads=8, num_kv_heads=2, head_dim=64)
    model = SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)], config=SimpleNamespace(hidden_size=512))
    assert type(select_backend(model, torch.device("cuda"), torch.bfloat16)).__name__ == "TritonBackend"
    monkeypatch.setenv("PAGEDSERVE_TRITON_ATTENTION", "0")
    assert type(select_backend(model, torch.device("cuda"), torch.bfloat16)) is TorchBackend
    monkeypatch.delenv("PAGEDSERVE_TRITON_ATTENTION")
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    assert type(select_backend(model, torch.device("cpu"), torch.float32)) is TorchBackend
