"""The AVX2 bf16 matmul (``csrc/avx2_gemm.c``): bf16 weights widened to float32, FMA over k in
order. Checked bit for bit against the same arithmetic done by PyTorch (each bf16 x bf16
product is exact in float32, so a float32 running sum k by k is the kernel's sum), for any M,
N and K, and through the engine: bf16 greedy output alone equals batched.

Skipped where the kernel is not built (no AVX2 + FMA, no C compiler)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_engine_idle
from pagedserve import LLM, SamplingParams
from pagedserve.ops.cpu import matmul


def _avx2_or_skip():
    if not matmul.avx2_gemm_available():
        pytest.skip("the AVX2 bf16 matmul is not built here (no AVX2 + FMA, or PAGEDSERVE_AVX2_GEMM=0)")


def _same_arithmetic(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """float32 sum of the products k = 0, 1, ... in order, plus bias, rounded once to bf16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wf[:, k]  # the product is exact in float32
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("n,k,has_bias", [(64, 576, False), (37, 77, True), (960, 64, False), (40, 2048, True)])
def test_avx2_gemm_equals_the_same_arithmetic_bit_for_bit(n, k, has_bias):
    """Every row count of a 6-row tile and its remainders, the 1-3 row paths that take several
    panels a pass, N not a multiple of the 16-wide panel, K odd, and (K = 2048) more rows than
    one block of rows widened to float32."""
    _avx2_or_skip()
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if has_bias else None
    layout = matmul.avx2_layout(w)
    assert layout.shape == (-(-n // 16), k, 16)
    assert torch.equal(layout[-1, k - 1, (n - 1) % 16], w[n - 1, k - 1])
    x = torch.randn(70, k, generator=g).to(torch.bfloat16)
    y = matmul.avx2_gemm(x, layout, bias, n)
    assert torch.equal(y, _same_arithmetic(x, w, bias))
    for lo, hi in ((0, 1), (5, 6), (0, 2), (4, 7), (0, 7), (3, 16), (33, 70), (0, 48), (0, 49)):  # a row's bits never depend on its neighbours
        assert torch.equal(matmul.avx2_gemm(x[lo:hi].contiguous(), layout, bias, n), y[lo:hi]), (lo, hi)
    assert matmul.avx2_gemm(x[:0], layout, bias, n).shape == (0, n)


def test_avx2_gemm_rounds_nan_and_infinity_like_torch():
    _avx2_or_skip()
    w = torch.ones(16, 2, dtype=torch.bfloat16)
    x = torch.tensor([[float("nan"), 1.0], [float("inf"), 1.0], [3e38, 3e38]]).to(torch.bfloat16)
    y = matmul.avx2_gemm(x, matmul.avx2_layout(w), None, 16)
    assert y[0].isnan().all() and (y[1] == float("inf")).all() and (y[2] == float("inf")).all()


def test_bf16_projections_take_the_avx2_matmul_where_onednn_cannot_pack():
    from pagedserve.model.packed_linear import PackedLinear, avx2_bf16

    _avx2_or_skip()
    if not avx2_bf16(torch.bfloat16):
        pytest.skip("oneDNN packs bf16 weights on this CPU (AVX-512): the AVX2 matmul is not used")
    w = torch.randn(100, 64).to(torch.bfloat16)
    lin = PackedLinear(w)
    assert lin.avx2_weight is not None and lin.packed_weight is None and lin.amx_weight is None
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    assert torch.equal(lin(x), _same_arithmetic(x.reshape(15, 64), w, None).view(3, 5, 100))


def test_smollm2_bf16_on_avx2_alone_equals_batched_and_chunked():
    """Greedy bf16 output of each prompt alone equals the batched run, and the run with
    48-token prefill chunks and preemption in a small pool."""
    from pagedserve.model.packed_linear import avx2_bf16

    _avx2_or_skip()
    if not avx2_bf16(torch.bfloat16):
        pytest.skip("the AVX2 matmul is not used on this CPU")
    prompts = ["The capital of France is", "Write a poem about the sea:" * 6, "def fibonacci(n):" * 9, "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=512, enable_prefix_caching=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == alone
    del llm
    small = LLM(dtype="bfloat16", quantization="none", num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=48, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)] == alone
    assert small.llm_engine.get_stats().num_preemptions > 0
    assert_engine_idle(small)
