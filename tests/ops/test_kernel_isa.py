"""The CPU kernels' ISA units (``pagedserve/ops/cpu/build.py``): every ISA's code compiles on any
x86-64 host (the CI check), and with ``PAGEDSERVE_CPU_ISA`` capping what the kernels may use,
this host runs the paths of an older CPU (AVX-512 without BF16, AVX2, plain C) without crashing
and with correct results: what a host without AMX or AVX-512 would run. (A cap above the host's
own level runs the host's level.)"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

from pagedserve.ops.cpu import build

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


@needs_cc
def test_every_isa_unit_compiles_with_werror():
    """``python -m pagedserve.ops.cpu --check-all-isas`` (``make check-kernels``, run first by
    .ci/run): each unit with its ISA's flags and -Wall -Werror, each library linked with no
    undefined symbol. Quick once the kernels are built: it checks the same (cached) objects."""
    assert build.check_all_isas() == []


# Run in a child process: the cap is read once per library.
_CAPPED = r"""
import sys
import torch
import torch.nn.functional as F
from pagedserve import platform as pf
from pagedserve.ops import cpu as ck
from pagedserve.ops.cpu import build, matmul

cap = sys.argv[1]
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
dec = build.get_decode_lib()
assert build.get_lib() is not None and build.get_fused_lib() is not None and dec is not None
# the level the kernels run at: the cap, or less on a host without it
level = min(["scalar", "avx2", "avx512", "avx512bf16", "amx"].index(cap), ["other", "avx2", "avx512", "avx512bf16", "amx"].index(pf.cpu_class()))
assert not (level < 4 and (dec.amx_gemm_available() or matmul.amx_available())), "AMX past the cap"
assert bool(dec.avx2_gemm_available()) == (level >= 1)
fast = ck.get_lib().paged_attention_bf16_fast_path(2, 64)
assert fast == (level >= 3 or level == 1), (cap, fast)

# attention: decode rows and a prefill chunk, against softmax(QK^T)V in float32
h, kvh, d, bs = 8, 2, 64, 16
for dtype in (torch.bfloat16, torch.float32):
    lens = [37, 5, 80, 16, 1, 50, 23, 64, 9]
    n = len(lens)
    cache = torch.randn(2, 64, kvh, bs, d, generator=g).to(dtype)
    bt = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(n)])
    q = torch.randn(n, h, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    assert ck.paged_attention_cpu(q, cache, bt, None, torch.tensor(lens), 0.125, out)
    for t, ln in enumerate(lens):
        blocks = bt[t, : (ln + bs - 1) // bs]
        k = cache[0, blocks].transpose(0, 1).reshape(kvh, -1, d)[:, :ln].float().repeat_interleave(h // kvh, 0)
        v = cache[1, blocks].transpose(0, 1).reshape(kvh, -1, d)[:, :ln].float().repeat_interleave(h // kvh, 0)
        p = torch.softmax(q[t].float()[:, None] @ k.transpose(1, 2) * 0.125, -1)
        torch.testing.assert_close(out[t].float(), (p @ v)[:, 0], atol=2e-2, rtol=2e-2)
    # a prefill chunk of one sequence: each row as its decode row alone (same bits)
    seq_lens = torch.arange(40, 72)
    chunk = torch.empty(len(seq_lens), h, d, dtype=dtype)
    qc = torch.randn(len(seq_lens), h, d, generator=g).to(dtype)
    assert ck.paged_attention_cpu(qc, cache, bt[:1], torch.zeros(len(seq_lens), dtype=torch.int64), seq_lens, 0.125, chunk)
    alone = torch.empty_like(chunk)
    assert ck.paged_attention_cpu(qc, cache, bt[:1].expand(len(seq_lens), -1).contiguous(), None, seq_lens, 0.125, alone)
    assert torch.equal(chunk, alone), (cap, dtype)

# fused ops against PyTorch
x = torch.randn(5, 576, generator=g).to(torch.bfloat16)
r = torch.randn(5, 576, generator=g).to(torch.bfloat16)
w = torch.randn(576, generator=g).to(torch.bfloat16)
s = (x + r).float()
want = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
got, res = ck.add_rms_norm(x, r.clone(), w, 1e-5)
torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
gu = torch.randn(3, 2 * 1536, generator=g).to(torch.bfloat16)
torch.testing.assert_close(ck.silu_mul(gu).float(), (F.silu(gu[:, :1536].float()).to(torch.bfloat16) * gu[:, 1536:]).float(), atol=2e-2, rtol=2e-2)
logits = torch.randn(4, 49152, generator=g).to(torch.bfloat16)
assert torch.equal(ck.argmax_bf16(logits), logits.float().argmax(-1))

# the matmuls each level has, and none past it
xm = torch.randn(3, 576, generator=g).to(torch.bfloat16)
wm = (0.05 * torch.randn(64, 576, generator=g)).to(torch.bfloat16)
ym = torch.empty(3, 64, dtype=torch.bfloat16)
assert (dec.small_gemm_bf16(xm.data_ptr(), 3, 576, wm.data_ptr(), None, ym.data_ptr(), 64, 256, 256) == 0) == (level >= 3)
if level >= 1:
    y = matmul.avx2_gemm(xm, matmul.avx2_layout(wm), None, 64)
    torch.testing.assert_close(y.float(), xm.float() @ wm.float().T, atol=2e-2, rtol=2e-2)
else:
    assert dec.avx2_gemm_bf16(xm.data_ptr(), 3, 576, wm.data_ptr(), None, ym.data_ptr(), 64) == -1
assert dec.stream_read(logits.data_ptr(), 4 * 49152 * 2) == dec.stream_read(logits.data_ptr(), 4 * 49152 * 2)
print("ok", cap)
"""


@needs_cc
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the ISA units are x86-64's")
@pytest.mark.parametrize("cap", ["scalar", "avx2", "avx512", "avx512bf16"])
def test_capped_isa_runs_an_older_cpus_paths(cap):
    env = dict(os.environ, PAGEDSERVE_CPU_ISA=cap, OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", _CAPPED, cap], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ok {cap}" in r.stdout
