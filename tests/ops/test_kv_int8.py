"""The int8 KV cache (``kv_cache_dtype="int8"``): the C quantizer writes the bytes PyTorch's
reference writes, the attention kernel matches attention over the dequantized cache, the pool
holds ~1.9x the blocks, greedy output does not depend on batching, chunking or prefix hits,
blocks move between instances with their scales, and real SmolLM2 text stays close to bf16's."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.ops import kv_int8
from pagedserve.ops.cpu import get_fused_lib, get_lib
from pagedserve.ops.cpu import kernels as cpu_kernels
from pagedserve.model.layers import rotate_half
from pagedserve.model.packed_linear import packing_available
from pagedserve.worker.model_runner import kv_cache_bytes_per_block

needs_kernels = pytest.mark.skipif(get_lib() is None or get_fused_lib() is None, reason="no compiled CPU kernels")


def test_quantize_round_trip_and_layout():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * 3
    q, s = kv_int8.quantize(x)
    assert q.dtype == torch.int8 and s.shape == (5, 3) and int(q.abs().max()) == 127
    err = (kv_int8.dequantize(q, s, torch.float32) - x).abs()
    assert bool((err <= s.unsqueeze(-1) / 2 + 1e-6).all())  # at most half a step
    zq, zs = kv_int8.quantize(torch.zeros(2, 64))
    assert not zq.any() and not zs.any()
    cache = torch.zeros(4, 3, kv_int8.cell_bytes(16, 64), dtype=torch.int8)
    values, scales = kv_int8.split(cache, 16, 64)
    values[2, 1, 5] = q[0, 0]
    scales[2, 1, 5] = s[0, 0]
    assert torch.equal(cache[2, 1, 5 * 64:6 * 64], q[0, 0])
    assert cache[2, 1, 16 * 64 + 20:16 * 64 + 24].view(torch.float32).item() == s[0, 0].item()


def test_int8_pool_holds_more_than_1_8x_the_blocks_of_bf16(smollm2_dir):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(smollm2_dir)
    bf16 = kv_cache_bytes_per_block(cfg, 16, torch.bfloat16)
    int8 = kv_cache_bytes_per_block(cfg, 16, torch.bfloat16, "int8")
    assert bf16 == 2 * 30 * 3 * 16 * 64 * 2 and int8 == 2 * 30 * 3 * (16 * 64 + 16 * 4)
    assert bf16 / int8 >= 1.8


def test_refused_kv_cache_dtypes():
    with pytest.raises(ValueError, match="fp8 KV caches are not supported"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="auto or int8"):
        EngineConfig(kv_cache_dtype="int4")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 64), (2, 1, 6)])
def test_c_rope_write_is_the_reference_quantization(dtype, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(2)
    T, bs, nb, max_pos = 23, 16, 8, 200
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, max_pos, (T,))
    slots = torch.randperm(nb * bs)[:T]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([torch.outer(torch.arange(max_pos).float(), inv_freq)] * 2, dim=-1)
    cos_t, sin_t = emb.cos().contiguous(), emb.sin().contiguous()
    cache = torch.zeros(*kv_int8.cache_shape(nb, num_kv_heads, bs, head_dim), dtype=torch.int8)
    qk_end = (num_heads + num_kv_heads) * head_dim
    q = cpu_kernels.rope_write_kv(qkv[:, :qk_end], qkv[:, qk_end:], positions, slots, cos_t, sin_t, cache, num_heads, bs)
    cos, sin = cos_t[positions].to(dtype)[:, None], sin_t[positions].to(dtype)[:, None]
    qk = qkv[:, :qk_end].view(T, num_heads + num_kv_heads, head_dim)
    rotated = qk * cos + rotate_half(qk) * sin
    assert torch.equal(q, rotated[:, :num_heads])
    blk, off = slots // bs, slots % bs
    for i, x in ((0, rotated[:, num_heads:]), (1, qkv[:, qk_end:].view(T, num_kv_heads, head_dim))):
        values, scales = kv_int8.split(cache[i], bs, head_dim)
        want_q, want_s = kv_int8.quantize(x)
        assert torch.equal(values[blk, :, off], want_q) and torch.equal(scales[blk, :, off], want_s)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 64), (32, 8, 64), (6, 1, 32)])
def test_c_attention_matches_attention_over_the_dequantized_cache(dtype, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(3)
    nb, bs = 12, 16
    cache = torch.zeros(*kv_int8.cache_shape(nb, num_kv_heads, bs, head_dim), dtype=torch.int8)
    for i in range(2):
        values, scales = kv_int8.split(cache[i], bs, head_dim)
        q, s = kv_int8.quantize(torch.randn(nb, num_kv_heads, bs, head_dim).to(dtype))
        values.copy_(q)
        scales.copy_(s)
    deq = [kv_int8.dequantize(*kv_int8.split(cache[i], bs, head_dim), torch.float32) for i in range(2)]
    lens = [1, 15, 16, 17, 70, 192]  # partial blocks, exact blocks, a tail of one
    tables = torch.stack([torch.randperm(nb) for _ in lens]).to(torch.int64)
    query = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    out = torch.empty_like(query)
    scale = 1 / math.sqrt(head_dim)
    assert cpu_kernels.paged_attention_cpu(query, cache, tables, None, torch.tensor(lens), scale, out, bs)
    group = num_heads // num_kv_heads
    for t, n in enumerate(lens):
        k, v = (d[tables[t]].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :n] for d in deq)
        qq = query[t].float().view(num_kv_heads, group, head_dim)
        want = (torch.softmax(qq @ k.transpose(1, 2) * scale, -1) @ v).reshape(num_heads, head_dim)
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16 output rounding
        torch.testing.assert_close(out[t].float(), want, atol=tol, rtol=tol)
    # prefill rows (token_seq): the same numbers per row whatever else is in the call
    token_seq = torch.tensor([5, 5, 4, 1], dtype=torch.int64)
    token_lens = torch.tensor([190, 192, 3, 15], dtype=torch.int64)
    q2 = torch.randn(4, num_heads, head_dim).to(dtype)
    out2 = torch.empty_like(q2)
    assert cpu_kernels.paged_attention_cpu(q2, cache, tables, token_seq, token_lens, scale, out2, bs)
    alone = torch.empty_like(q2[1:2])
    assert cpu_kernels.paged_attention_cpu(q2[1:2].contiguous(), cache, tables, token_seq[1:2].contiguous(), token_lens[1:2].contiguous(), scale, alone, bs)
    assert torch.equal(alone, out2[1:2])
    # 24 rows in one call (AVX512-BF16: one task per token over all KV heads) equal each row alone
    seq3 = torch.arange(24, dtype=torch.int64) % len(lens)
    lens3 = torch.tensor(lens, dtype=torch.int64)[seq3]
    q3 = torch.randn(24, num_heads, head_dim).to(dtype)
    out3 = torch.empty_like(q3)
    assert cpu_kernels.paged_attention_cpu(q3, cache, tables, seq3, lens3, scale, out3, bs)
    for i in (0, 5, 11, 23):
        one = torch.empty_like(q3[i : i + 1])
        assert cpu_kernels.paged_attention_cpu(q3[i : i + 1].contiguous(), cache, tables, seq3[i : i + 1].contiguous(), lens3[i : i + 1].contiguous(), scale, one, bs)
        assert torch.equal(one, out3[i : i + 1]), i
    # a wrong block size is refused, not read out of bounds
    assert not cpu_kernels.paged_attention_cpu(query, cache, tables, None, torch.tensor(lens), scale, out, 32)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(20, 90, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _greedy(llm, prompts, max_tokens=12):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


@pytest.mark.parametrize("dtype,hidden", [("bfloat16", 256), ("float32", 128)])
def test_greedy_output_does_not_depend_on_batch_chunks_or_prefix_hits(tiny_model_factory, dtype, hidden):
    from conftest import assert_engine_idle

    if dtype == "bfloat16" and not packing_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("bf16 weights are not packed here (neither oneDNN nor the AVX2 matmul): bf16 projections run on F.linear, whose sums depend on M")
    model = tiny_model_factory("llama", hidden_size=hidden, intermediate_size=2 * hidden)
    prompts = _prompts(20)
    llm = LLM(model, dtype=dtype, kv_cache_dtype="int8", num_threads=1, num_kv_blocks=400)
    assert llm.llm_engine.core.worker.model_runner.kv_cache.dtype == torch.int8
    batched = _greedy(llm, prompts)  # 20 decodes a step: the layer-by-layer path
    again = _greedy(llm, prompts)  # every full block now a prefix-cache hit
    alone = [_greedy(llm, [p])[0] for p in prompts[:3]]  # one C call per decode step (bf16)
    assert_engine_idle(llm)
    del llm
    chunked = LLM(model, dtype=dtype, kv_cache_dtype="int8", num_threads=1, num_kv_blocks=400, max_num_batched_tokens=32,
                  enable_prefix_caching=False)
    assert _greedy(chunked, prompts) == batched
    assert again == batched and alone == batched[:3]


def test_int8_blocks_move_between_instances_with_their_scales(tiny_model_factory):
    from kv_utils import add, idle, run
    from server_utils import free_port
    from pagedserve.engine.core import EngineCore

    model = tiny_model_factory("llama", hidden_size=256, intermediate_size=512)

    def core(role=None):
        kv = {"kv_transfer_config": {"kv_role": role, "kv_port": free_port(), "kv_load_failure_policy": "fail"}} if role else {}
        return EngineCore(EngineConfig(model=model, dtype="bfloat16", kv_cache_dtype="int8", num_threads=1, num_kv_blocks=32, **kv))

    P, D, C = core("kv_producer"), core("kv_consumer"), core()
    try:
        add(P, "p7", 1, {"do_remote_decode": True})
        final = [o for o in run([P, D], lambda: not P.scheduler.requests)[id(P)] if o.finish_reason][-1]
        add(D, "d7", 8, final.kv_transfer_params)
        got = [t for o in run([P, D], lambda: idle(P) and idle(D))[id(D)] if o.request_id == "d7" for t in o.new_token_ids]
        add(C, "p7", 8, None)
        want = [t for o in run([C], lambda: idle(C))[id(C)] for t in o.new_token_ids]
        assert got == want and len(got) == 8
        assert D.get_stats().kv_transfer_received_tokens == 64 and not D.get_stats().kv_transfer_failures
    finally:
        for c in (P, D, C):
            c.shutdown()


@needs_kernels
def test_smollm2_int8_cache_stays_close_to_bf16_on_real_text(smollm2_dir):
    """The issue's bar: over 8 prompts x 64 greedy tokens, the first 8 tokens equal bf16's on at
    least 6 prompts and the mean common prefix is at least 24 tokens."""
    import pydoc_data.topics
    from transformers import AutoTokenizer

    if not cpu_kernels.prefill_kernel_preferred(torch.bfloat16, 9, 3, 64):
        pytest.skip("no vectorised bf16 attention (AVX512-BF16, or AVX2 + FMA without AVX-512): bf16 SmolLM2 would be too slow here")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok("\n".join(pydoc_data.topics.topics.values())[:60_000])["input_ids"]
    prompts = [ids[i * 997: i * 997 + 200] for i in range(8)]
    outs = {}
    for kvd in ("auto", "int8"):
        llm = LLM(dtype="bfloat16", quantization="none", kv_cache_dtype=kvd, num_threads=2, kv_cache_memory_bytes=64 << 20, max_model_len=1024)
        outs[kvd] = _greedy(llm, prompts, 64)
        del llm
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 64) for x, y in zip(outs["auto"], outs["int8"])]
    assert sum(c >= 8 for c in common) >= 6 and sum(common) / 8 >= 24, common


@needs_kernels
def test_tiny_rows_are_stored_as_zeros_by_both_quantizers():
    """127 / max|x| overflows below ~3.7e-37: such rows become zeros, the same bytes in C and PyTorch."""
    nkv, bs, hd = 1, 16, 64
    cache = torch.zeros(*kv_int8.cache_shape(2, nkv, bs, hd), dtype=torch.int8)
    v = torch.zeros(1, hd)
    v[0, :2] = torch.tensor([1e-37, 5e-38])
    qkv = torch.cat([torch.ones(1, 2 * hd), v], 1)  # 1 query head, 1 KV head, then V
    cos_sin = torch.ones(4, hd), torch.zeros(4, hd)
    cpu_kernels.rope_write_kv(qkv[:, :2 * hd], qkv[:, 2 * hd:], torch.zeros(1, dtype=torch.int64), torch.tensor([3]),
                              *cos_sin, cache, 1, bs)
    values, _ = kv_int8.split(cache[1], bs, hd)
    q, _ = kv_int8.quantize(v)
    assert not q.any() and not values[0, 0, 3].any()
