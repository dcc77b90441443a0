"""The small-M bf16 matmul on oneDNN's packed weights (``csrc/small_gemm.c``) and the one-call
C decode step (``csrc/decode_step.c``): bit-identical to the oneDNN / layer-by-layer paths, so
a sequence's greedy tokens do not depend on how many sequences were decoded with it.

Skipped where the kernels cannot run (no C compiler, no AVX512-BF16, packing disabled)."""
from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from conftest import assert_engine_idle
from cpu_utils import cpu_flags
from pagedserve import LLM, SamplingParams
from pagedserve.ops import cpu as cpu_kernels
from pagedserve.ops.cpu import matmul
from pagedserve.model.packed_linear import PackedLinear, onednn_packs, pack_weight, packed_linear, packing_available


def _onednn_bf16() -> bool:
    """oneDNN packs bf16 weights here (elsewhere bf16 takes the AVX2 matmul or F.linear)."""
    return packing_available(torch.device("cpu"), torch.bfloat16) and onednn_packs(torch.bfloat16)


def _packing_or_skip():
    if not _onednn_bf16() or cpu_kernels.get_small_gemm_lib() is None:
        pytest.skip("oneDNN packing (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT) or the C kernels are unavailable")


def _pack_or_skip(w):
    _packing_or_skip()
    return pack_weight(w)


def _plan_or_skip(packed, n, k, bias=None):
    _packing_or_skip()
    plan = cpu_kernels.calibrate_small_gemm(packed, n, k, bias)
    if plan is None:
        pytest.skip("no small-M summation plan matches oneDNN on this CPU (its AMX kernels, or no AVX512-BF16)")
    return plan


def _onednn_batched(x, packed, bias, extra_rows=28):
    """oneDNN's result for the rows of ``x`` computed inside a larger batch (the batched numerics)."""
    g = torch.Generator().manual_seed(7)
    rest = torch.randn(extra_rows, x.shape[1], generator=g).to(torch.bfloat16)
    return torch.ops.mkldnn._linear_pointwise(torch.cat([x, rest]), packed, bias, "none", [], "")[: x.shape[0]]


# SmolLM2's four projection shapes and its tied LM head, plus Qwen2-0.5B-like shapes (qkv bias,
# K = 896 and 4864) whose partial-sum structure differs.
SHAPES = [(960, 576, False), (576, 576, False), (3072, 576, False), (576, 1536, False), (49152, 576, False), (1152, 896, True), (896, 4864, False)]


@pytest.mark.parametrize("n,k,has_bias", SHAPES)
def test_small_gemm_bit_identical_to_onednn_batched(n, k, has_bias):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if has_bias else None
    packed = _pack_or_skip(w)
    plan = _plan_or_skip(packed, n, k, bias)
    for m in (1, 2, 3, 4, 7, 16, 33, cpu_kernels.SMALL_GEMM_MAX_ROWS, 300 if n < 10000 else 70):  # the C step's prefill sizes
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        got = cpu_kernels.small_gemm(x, packed, bias, n, plan)
        assert torch.equal(got, _onednn_batched(x, packed, bias)), (n, k, m)
    # and close to the float64 product (a layout or indexing bug would not be)
    x = torch.randn(4, k, generator=g).to(torch.bfloat16)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    got = cpu_kernels.small_gemm(x, packed, bias, n, plan).double()
    assert (got - exact).abs().max() <= 0.01 * exact.abs().max() + 1e-3


def test_calibration_distinguishes_partial_sum_orders():
    """K = 1536: one running sum over all of K (the obvious kernel) differs from oneDNN in a few
    outputs; the calibrated plan does not. Shows the calibration is what buys bit-identity."""
    n, k = 576, 1536
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    packed = _pack_or_skip(w)
    plan = _plan_or_skip(packed, n, k)
    x = torch.randn(64, k, generator=g).to(torch.bfloat16)
    ref = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    naive = (k // 2, k // 2)
    assert plan != naive
    mismatches = {p: sum(int((cpu_kernels.small_gemm(x[i : i + 4], packed, None, n, p) != ref[i : i + 4]).sum()) for i in range(0, 64, 4)) for p in (plan, naive)}
    assert mismatches[plan] == 0 and mismatches[naive] > 0, mismatches


@pytest.mark.parametrize("seed", range(6))
def test_calibration_reliable_for_narrow_weights(seed):
    """A 64-output weight with K = 1536: with a fixed 64 probe rows (4,096 outputs) a wrong plan
    passed about half the time; the probe now scales to 2^18 outputs and is confirmed twice."""
    n, k = 64, 1536
    g = torch.Generator().manual_seed(100 + seed)
    packed = _pack_or_skip((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
    plan = _plan_or_skip(packed, n, k)
    x = torch.randn(2048, k, generator=g).to(torch.bfloat16)
    ref = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    got = torch.cat([cpu_kernels.small_gemm(x[i : i + 16], packed, None, n, plan) for i in range(0, 2048, 16)])
    assert torch.equal(got, ref), plan


def test_zero_rows_and_env_change_after_load(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX", "0")  # the oneDNN buffer and its small-M plan
    _packing_or_skip()
    n, k = 128, 576
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    packed = PackedLinear.from_linear(lin)
    packed.small_plan = _plan_or_skip(packed.packed_weight, n, k)
    assert packed(torch.empty(0, k, dtype=torch.bfloat16)).shape == (0, n)
    x = torch.randn(2, k).to(torch.bfloat16)
    before = packed(x)
    monkeypatch.setenv("PAGEDSERVE_SMALL_GEMM", "0")  # plans made at load keep working
    assert torch.equal(packed(x), before)


def test_unsupported_shapes_fall_back_to_onednn():
    n, k = 100, 64  # N not a multiple of 64: oneDNN pads its layout
    w = torch.randn(n, k).to(torch.bfloat16)
    if not _onednn_bf16() or cpu_kernels.get_small_gemm_lib() is None:
        pytest.skip("oneDNN packing or the C kernels are unavailable")
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w.float())
    lin = lin.to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    assert cpu_kernels.calibrate_small_gemm(packed.packed_weight, n, k, None) is None
    x = torch.randn(1, k).to(torch.bfloat16)
    assert torch.equal(packed(x), packed_linear(x, packed.packed_weight))
    # the C entry point itself refuses what it cannot do (N % 64 != 0, odd K, no rows)
    lib = cpu_kernels.get_small_gemm_lib()
    y = torch.empty(2, 128, dtype=torch.bfloat16)
    xm = torch.randn(2, 64).to(torch.bfloat16)
    assert lib.small_gemm_bf16(xm.data_ptr(), 1, 64, 0, None, y.data_ptr(), 100, 32, 32) == -1
    assert lib.small_gemm_bf16(xm.data_ptr(), 1, 63, 0, None, y.data_ptr(), 128, 32, 32) == -1
    assert lib.small_gemm_bf16(xm.data_ptr(), 0, 64, 0, None, y.data_ptr(), 128, 32, 32) == -1


@pytest.mark.parametrize("k,chain,body", [(576, 256, 256), (2048, 50, 130), (2048, 512, 1024), (1088, 7, 0), (8192, 64, 4096), (96, 100, 48)])
def test_rows_together_equal_rows_alone_for_any_plan(k, chain, body):
    """More than 4 rows run the k loop in chunks of 64 pairs, carrying partial sums between
    chunks; 4 rows or fewer keep them in registers for the whole of K. The same plan must give
    the same bits either way, wherever its partial sums begin and end relative to the chunks
    (a wrong order shows in ~1 output in 10^3-10^4, hence 512 outputs a row), with a bias, and
    with a last group of 1, 2 or 3 rows. The weight is laid out here in the kernel's own layout
    (oneDNN packs another one on AMX CPUs), so this runs wherever the kernel is built."""
    if cpu_kernels.get_small_gemm_lib() is None or not cpu_flags() >= {"avx512f", "avx512_bf16"}:
        pytest.skip("the small-M kernel needs AVX512-BF16")
    n = 512
    g = torch.Generator().manual_seed(k + chain)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    laid = matmul.small_gemm_layout(w)
    assert laid.shape == (n // 64, k // 2, 64, 2) and torch.equal(laid[1, 3, 5], w[64 + 5, 6:8])
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(cpu_kernels.SMALL_GEMM_MAX_ROWS + 75, k, generator=g).to(torch.bfloat16)
    alone = torch.cat([cpu_kernels.small_gemm(x[i : i + 1], laid, None, n, (chain, body)) for i in range(x.shape[0])])
    for m in (5, 6, 7, 8, 13, 30, cpu_kernels.SMALL_GEMM_MAX_ROWS, cpu_kernels.SMALL_GEMM_MAX_ROWS + 75):  # past 64: pieces of 64
        assert torch.equal(cpu_kernels.small_gemm(x[:m], laid, None, n, (chain, body)), alone[:m]), m
    alone_b = torch.cat([cpu_kernels.small_gemm(x[i : i + 1], laid, bias, n, (chain, body)) for i in range(11)])
    assert torch.equal(cpu_kernels.small_gemm(x[:11], laid, bias, n, (chain, body)), alone_b)
    exact = x[:8].double() @ w.double().T
    assert (alone[:8].double() - exact).abs().max() <= 0.01 * exact.abs().max() + 1e-3


def test_small_gemm_only_on_its_own_layout(monkeypatch):
    """The engine reaches the small-M kernel only through a calibrated plan, and calibration
    refuses a weight oneDNN packed in another layout (AMX CPUs pack [N/32, K/2, 32, 2]): there
    the kernel would read garbage. Where oneDNN packs the kernel's layout, its buffer equals
    :func:`small_gemm_layout` of the weight."""
    if not _onednn_bf16() or cpu_kernels.get_small_gemm_lib() is None:
        pytest.skip("oneDNN packing or the C kernels are unavailable")
    n, k = 512, 576
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16)
    packed = pack_weight(w)
    ptr, nbytes = matmul._packed_address(packed)
    raw = torch.frombuffer((ctypes.c_int16 * (nbytes // 2)).from_address(ptr), dtype=torch.int16).view(torch.bfloat16)
    ours = torch.equal(raw, matmul.small_gemm_layout(w).flatten())
    assert matmul.small_gemm_layout_matches(packed, n, k) == ours
    if not ours:
        assert cpu_kernels.calibrate_small_gemm(packed, n, k, None) is None
        lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        from pagedserve.model.packed_linear import attach_small_gemm

        monkeypatch.setenv("PAGEDSERVE_AMX", "0")  # the oneDNN buffer, as the engine keeps it then
        layer = PackedLinear.from_linear(lin)
        attach_small_gemm(layer, {})
        assert layer.packed_weight is not None and layer.small_plan is None


def test_onednn_path_one_row_matches_batched():
    """Without a plan, one row goes through oneDNN as two (its one-row kernel sums K = 1536 in
    another order, ~1 output in 10^4), so it equals the row computed in a batch."""
    from pagedserve.model.packed_linear import packed_or_small_linear

    if not _onednn_bf16():
        pytest.skip("oneDNN packing unavailable")
    n, k = 576, 1536
    g = torch.Generator().manual_seed(11)
    packed = pack_weight((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(64, k, generator=g).to(torch.bfloat16)
    batched = packed_linear(x, packed)
    if any(not torch.equal(packed_linear(x[:m], packed), batched[:m]) for m in range(2, 64)):
        # AMX (Sapphire Rapids and later): oneDNN's kernels sum in an order that depends on the
        # batch size itself, so there is no "batched numerics" for one row to match.
        pytest.skip("oneDNN's batched kernel on this CPU is not batch-size invariant (AMX)")
    alone = torch.cat([packed_or_small_linear(x[i : i + 1], packed, None, n, None) for i in range(64)])
    assert torch.equal(alone, batched)


@pytest.mark.slow
@pytest.mark.parametrize("small_gemm", ["1", "0"])
def test_smollm2_bf16_alone_matches_batched(small_gemm, monkeypatch):
    """Before this, oneDNN's single-row matmul rounded differently from its batched one
    (K = 1536), and 3 of these 5 prompts decoded differently alone than together. Both the
    small-M path and the oneDNN path (``PAGEDSERVE_SMALL_GEMM=0``) are now invariant."""
    monkeypatch.setenv("PAGEDSERVE_SMALL_GEMM", small_gemm)
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    prompts = ["The capital of France is", "Write a poem about the sea:", "def fibonacci(n):", "Once upon a time", "List three colors:"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == batched
    assert_engine_idle(llm)


def _amx_or_skip():
    if not matmul.amx_available():
        pytest.skip("no AMX-BF16 here (or PAGEDSERVE_AMX=0)")


@pytest.mark.parametrize("n,k,has_bias", [(960, 576, False), (576, 1536, False), (64, 64, True), (1152, 896, True)])
def test_amx_matmul_matches_reference_and_is_row_invariant(n, k, has_bias):
    """The AMX layout is the one the kernel reads (products within bf16 rounding of float64),
    and a row's result is the same bits whatever M, which rows surround it, and whether it falls
    in a full tile of 16 rows, the zero-padded last one, or a later group of weights."""
    _amx_or_skip()
    from pagedserve.model.packed_linear import amx_copy

    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if has_bias else None
    copy = amx_copy(w, bias)
    assert copy.shape == (n // 32, k // 32, 2, 16, 16, 2)
    u, kb = n // 32 - 1, k // 32 - 1  # last unit, last k block: output 32u + 16 + 7, k pair 5
    assert torch.equal(copy[u, kb, 1, 5, 7], w[32 * u + 16 + 7, 32 * kb + 10 : 32 * kb + 12])
    x = torch.randn(300, k, generator=g).to(torch.bfloat16)
    y = matmul.amx_gemm(x, copy, bias, n)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert (y.double() - exact).abs().max() <= 0.01 * exact.abs().max() + 1e-3
    for lo, hi in ((0, 1), (7, 8), (0, 17), (3, 40), (20, 52), (0, 256), (250, 300)):
        assert torch.equal(matmul.amx_gemm(x[lo:hi].contiguous(), copy, bias, n), y[lo:hi]), (lo, hi)
    assert matmul.amx_gemm(x[:0], copy, bias, n).shape == (0, n)


def test_amx_refuses_shapes_it_cannot_do():
    """N or K not a multiple of 32: no AMX copy (oneDNN keeps the layer), and the C entry point
    refuses rather than reading past the buffers."""
    _amx_or_skip()
    from pagedserve.model.packed_linear import amx_copy

    assert amx_copy(torch.randn(100, 64).to(torch.bfloat16), None) is None
    assert amx_copy(torch.randn(64, 48).to(torch.bfloat16), None) is None
    lin = PackedLinear(torch.randn(100, 64).to(torch.bfloat16))
    assert lin.amx_weight is None and lin.packed_weight is not None
    lib = cpu_kernels.get_decode_lib()
    x = torch.randn(4, 64).to(torch.bfloat16)
    y = torch.empty(4, 128, dtype=torch.bfloat16)
    assert lib.amx_gemm_bf16(x.data_ptr(), 4, 64, 0, None, y.data_ptr(), 100) == -1
    assert lib.amx_gemm_bf16(x.data_ptr(), 4, 48, 0, None, y.data_ptr(), 128) == -1
    assert lib.amx_gemm_bf16(x.data_ptr(), 0, 64, 0, None, y.data_ptr(), 128) == -1


def test_smollm2_bf16_chunking_and_preemption_do_not_change_output():
    """With the AMX matmul and attention every row is computed independently of the rest of its
    step, so bf16 greedy output survives what float32 tests check elsewhere: prompts prefilled
    in 48-token chunks next to other requests' decodes, and preemption (recompute) in a pool
    too small for all of them, equal each prompt run alone."""
    if not matmul.amx_available():
        pytest.skip("no AMX here: bf16 invariance under chunking is only claimed for the AMX kernels")
    prompts = ["The capital of France is", "Write a poem about the sea:" * 6, "def fibonacci(n):" * 9, "Once upon a time", "List three colors:" * 12]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    ref_llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=512, enable_prefix_caching=False)
    alone = [ref_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    del ref_llm
    # (With PAGEDSERVE_AMX=0, oneDNN's kernels, the first prompt's answer differed here.)
    llm = LLM(dtype="bfloat16", quantization="none", num_kv_blocks=20, max_model_len=320, max_num_batched_tokens=48, enable_prefix_caching=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert_engine_idle(llm)


def test_onednn_row_buckets_are_few_and_cover_every_row_count():
    from pagedserve.model.packed_linear import ONEDNN_MAX_ROWS, onednn_rows

    sizes = [onednn_rows(m) for m in range(1, ONEDNN_MAX_ROWS + 1)]
    assert all(m <= s for m, s in zip(range(1, ONEDNN_MAX_ROWS + 1), sizes))
    assert 1 not in sizes and sizes[-1] == ONEDNN_MAX_ROWS
    assert len(set(sizes)) == 52  # the primitives oneDNN caches per weight
    assert max((s - m) / m for m, s in zip(range(65, 513), sizes[64:512])) < 0.125
    assert max(s - m for m, s in zip(range(1, 65), sizes)) <= 7  # decode sizes: small padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_and_cut_rows_equal_the_exact_product(dtype, monkeypatch):
    """Padding to onednn_rows and cutting at ONEDNN_MAX_ROWS change no bit (float32 and bf16,
    where oneDNN packs them and its rows do not depend on the row count)."""
    import pagedserve.model.packed_linear as pl

    if not (packing_available(torch.device("cpu"), dtype) and pl.onednn_packs(dtype)):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(200, 72, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    x = torch.randn(300, 72, generator=g).to(dtype)
    layer = PackedLinear(w, b)
    if not layer.pad_rows:
        pytest.skip(f"oneDNN's {dtype} rows depend on the row count on this CPU (AMX): no padding")
    monkeypatch.setattr(pl, "ONEDNN_MAX_ROWS", 128)
    exact = packed_linear(x, layer.packed_weight, b)
    # In inference mode (as the engine runs) padded inputs go through a scratch buffer made
    # there and reused; largest first, so that its padding rows hold earlier rows.
    monkeypatch.setattr(pl, "_pad_buffers", threading.local())
    with torch.inference_mode():
        first = layer(x[100:227])
        for m in (127, 126, 99, 65, 61, 5, 300):
            assert torch.equal(layer(x[:m]), exact[:m]), m
        assert torch.equal(first, exact[100:227])  # an earlier result is not a view of the buffer
    # Outside it, after it: no in-place update of an inference tensor.
    with torch.no_grad():
        assert torch.equal(layer(x[:61]), exact[:61])
    for m in (1, 3, 17, 63, 65, 128, 129, 300):
        assert torch.equal(layer(x[:m]), exact[:m]), m
    assert torch.equal(layer(x[:6].view(2, 3, 72)), exact[:6].view(2, 3, 200))
    assert layer(x[:0]).shape == (0, 200)
    assert torch.allclose(exact.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-2 * float(exact.float().abs().max()))

