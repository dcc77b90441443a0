"""``pagedserve bench kernels --op NAME``: the CPU kernels alone, each against its peers on this
host, in one process.

Ops (``--op``, several with commas, or ``all``):

matmul
    The bf16 matmul the engine uses here (``PackedLinear``'s choice: the AMX matmul, the AVX2
    bf16 matmul, the small-M kernel on oneDNN's buffers for 1-64 rows, or oneDNN) against the
    others this CPU has: oneDNN's packed bf16, and on AVX2-only CPUs oneDNN's packed float32 (the
    float32 path) and ``F.linear`` in bf16 (up to 64 rows). A model's projections (``--shapes
    smollm2``: SmolLM2-135M's, 30 layers; ``1b``: Llama-3.2-1B's, 4 layers; ``--lm-head`` adds
    SmolLM2's tied LM head), distinct weights read cold as in a step, on 2 MiB pages as the
    engine keeps them, at each of ``--rows``. ``--dtype float32``: ``F.linear`` (MKL) against
    oneDNN's packed float32. The small-M kernel must equal oneDNN bit for bit; the others are
    checked against a float32 product.
attention
    Paged attention from the cache (``csrc/attention/`` as the engine builds it) against the
    same units built without the path this CPU takes: capped below AMX (``-DPS_ISA_CAP``: the
    AVX-512 kernel) on AMX CPUs; one task per (token, KV head) instead of per token on
    AVX512-BF16 and AVX2 CPUs; capped to the generic C loops on AVX2 CPUs. The CPU's class is
    the one ``PAGEDSERVE_CPU_ISA`` leaves (``avx2`` on an AMX host: an AVX2 CPU's paths and
    peers). ``--phase decode``: 32 decode rows of
    148-560 tokens, 30 layers of distinct caches, blocks in order, as W1 leaves them and
    scattered over the pool; ``--phase prefill``: one 2,048-token prefill step of prompts of 512,
    256, 128 and 64 tokens, against PyTorch's SDPA on the gathered K/V too. The C sides must give
    the same bits. ``--heads 32,8``: the 1.1B model's heads.
fused
    RMSNorm + residual add, SiLU-and-mul and RoPE + KV-cache write (``csrc/fused/``) against the
    same in PyTorch ops, SmolLM2's widths, at 1, 32 and 2,048 rows.
kv_int8
    Decode attention over the int8 KV cache against the bf16 one (same rows, W1's lengths, 30
    layers), and the RoPE + KV write that quantizes against the bf16 write.
step
    One engine step through the one-call C step (``csrc/step/decode_step.c``) against the
    layer-by-layer path, on a model (``--model``, default SmolLM2): a prefill step, a mixed step
    (decodes beside a prefill chunk) and a decode step (``--step-shapes prefill:decodes``).
sampler
    What ``allowed_token_ids`` and ``bad_words`` cost a step (sampling metadata + sampler over
    32 greedy rows of SmolLM2's vocabulary), and the admission cost of n copies of a
    full-vocabulary ``allowed_token_ids``.
qmatmul
    The matmul on quantized weights (``csrc/quant/``'s qgemm, 4-bit and 8-bit) against the bf16
    matmul the engine uses, a model's projections (``--shapes``) at ``--rows`` (default 1, 4, 16,
    32, 64), with the weights' GB/s and their share of the memory-read bandwidth probe
    (:mod:`pagedserve.bench.kernel_quant`).

``--rev REV`` adds, for matmul and attention, the engine's kernel built from git revision REV's
``csrc/`` (A/B of a kernel change; the same bits are required where the kernel promises them):
built from its units as this tree builds them, or, for a revision from before the units
(176ec54), from its one source per library with ``-march=native``, as it was built then.

Method (that of the scripts this replaces): warm-up, then ``--rounds`` rounds that alternate the
sides, so a drifting machine hits every side alike; per side the median and minimum in ms, and
each peer's median over the engine kernel's (above 1: the engine's kernel is faster). Run it on
a quiet machine. ``--tiny`` runs every op in seconds (2 layers, 2 rounds, few rows): a smoke
run, its figures mean nothing. Each op appends one line to ``benchmarks/results/kernels.jsonl``
(:mod:`pagedserve.bench.results`); ``--output-json F`` writes everything to F too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from pagedserve.bench.kernel_attention import _decode_rows, _tables, op_attention
from pagedserve.bench.kernel_common import BLOCK, HEAD_DIM, MATMUL_SHAPES, OPS, _case, alternate
from pagedserve.bench.kernel_matmul import op_matmul
from pagedserve.bench.kernel_quant import op_qmatmul

if TYPE_CHECKING:
    import torch  # imported where used: the CLI parser (and a server front) must not load torch


def add_kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", required=True, help=f"one or more of {', '.join(OPS)} (commas), or all")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tiny sizes, 2 rounds); figures mean nothing")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per side (default 9; --tiny: 2)")
    p.add_argument("--threads", type=int, default=None, help="OpenMP / torch threads (default: torch's, one per core)")
    p.add_argument("--rows", default=None, help="matmul, qmatmul: row counts (matmul default 1,4,16,32,64,256,2048; --dtype float32: 1,32,256)")
    p.add_argument("--shapes", choices=sorted(MATMUL_SHAPES), default="smollm2", help="matmul, qmatmul: whose projections")
    p.add_argument("--lm-head", action="store_true", help="matmul: add SmolLM2's LM head (49152 x 576)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="matmul and attention")
    p.add_argument("--phase", choices=["decode", "prefill", "both"], default="both", help="attention")
    p.add_argument("--heads", default="9,3", help="attention: query heads,KV heads (9,3: SmolLM2; 32,8: the 1.1B model)")
    p.add_argument("--pool-blocks", type=int, default=None, help="attention: blocks per layer cache (default 1.5x those in use)")
    p.add_argument("--prompt-lens", default="512,256,128,64", help="attention --phase prefill: prompt lengths")
    p.add_argument("--rev", default=None, help="matmul, attention: also time the engine's kernel of this git revision")
    p.add_argument("--model", default=None, help="step: the model (default SmolLM2; --tiny: a tiny random one)")
    p.add_argument("--step-shapes", default="2048:0,232:24,0:32", help="step: prefill tokens:decodes, with commas")
    p.add_argument("--context", type=int, default=300, help="step: tokens each decode attends to")
    p.add_argument("--output-json", default=None, help="write every op's cases to this file")


# -- fused element-wise ops ---------------------------------------------------------------------
def op_fused(args: argparse.Namespace, tmp: str) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagedserve.ops.cpu import kernels as k

    x0 = torch.zeros(1, 576, dtype=torch.bfloat16)
    if not k.fused_ops_usable(x0):
        raise SystemExit("the fused C ops are not available here")
    hidden, inter, heads, kv_heads, eps = 576, 1536, 9, 3, 1e-5
    rows_list = [1, 32] if args.tiny else [1, 32, 2048]
    g = torch.Generator().manual_seed(0)
    cases = []
    pos_max = 4096
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    ang = torch.outer(torch.arange(pos_max).float(), inv)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).contiguous(), torch.cat([ang.sin(), ang.sin()], -1).contiguous()
    for rows in rows_list:
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        res = torch.randn(rows, hidden, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()

        def rms_torch():
            r = x + res
            h = r.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return w * h.to(torch.bfloat16), r

        def rms_c():
            return k.add_rms_norm(x, res.clone(), w, eps)

        torch.testing.assert_close(rms_c()[0], rms_torch()[0], rtol=1.6e-2, atol=1e-2)
        cases.append(
            _case(
                "fused",
                f"add + RMSNorm, {rows} x {hidden}",
                alternate({"C": rms_c, "PyTorch": rms_torch}, args.rounds, reps=50),
                "C",
                rows=rows,
                kernel="add_rms_norm",
            )
        )
        gu = torch.randn(rows, 2 * inter, generator=g).bfloat16()

        def silu_torch():
            a, b = gu.chunk(2, -1)
            return F.silu(a) * b

        torch.testing.assert_close(k.silu_mul(gu), silu_torch(), rtol=1.6e-2, atol=1e-2)
        cases.append(
            _case(
                "fused",
                f"SiLU-and-mul, {rows} x {2 * inter}",
                alternate({"C": lambda: k.silu_mul(gu), "PyTorch": silu_torch}, args.rounds, reps=50),
                "C",
                rows=rows,
                kernel="silu_mul",
            )
        )
        blocks = -(-rows // BLOCK) + 1
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * HEAD_DIM, generator=g).bfloat16()
        qk, v = qkv[:, : (heads + kv_heads) * HEAD_DIM], qkv[:, (heads + kv_heads) * HEAD_DIM :]
        positions = torch.arange(rows, dtype=torch.int64)
        slots = torch.randperm(blocks * BLOCK, generator=g)[:rows].contiguous()
        cache_c = torch.zeros(2, blocks, kv_heads, BLOCK, HEAD_DIM, dtype=torch.bfloat16)
        cache_t = cache_c.clone()

        def rope_torch():
            def rot(t):
                c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
                t32 = t.float()
                half = HEAD_DIM // 2
                rotated = torch.cat([-t32[..., half:], t32[..., :half]], -1)
                return (t32 * c + rotated * s).to(torch.bfloat16)

            qq = rot(qk[:, : heads * HEAD_DIM].reshape(rows, heads, HEAD_DIM))
            kk = rot(qk[:, heads * HEAD_DIM :].reshape(rows, kv_heads, HEAD_DIM))
            b, o = slots // BLOCK, slots % BLOCK
            cache_t[0, b, :, o] = kk
            cache_t[1, b, :, o] = v.reshape(rows, kv_heads, HEAD_DIM)
            return qq

        def rope_c():
            return k.rope_write_kv(qk, v, positions, slots, cos, sin, cache_c, heads)

        torch.testing.assert_close(rope_c(), rope_torch(), rtol=1.6e-2, atol=2e-2)
        torch.testing.assert_close(cache_c, cache_t, rtol=1.6e-2, atol=2e-2)
        cases.append(
            _case(
                "fused",
                f"RoPE + KV write, {rows} tokens, {heads}/{kv_heads} heads",
                alternate({"C": rope_c, "PyTorch": rope_torch}, args.rounds, reps=20),
                "C",
                rows=rows,
                kernel="rope_write_kv",
            )
        )
    return cases


# -- int8 KV cache -------------------------------------------------------------------------------
def op_kv_int8(args: argparse.Namespace, tmp: str) -> list[dict]:
    import torch

    from pagedserve.ops import kv_int8 as q8
    from pagedserve.ops.cpu import kernels as k

    heads, kv_heads = (int(x) for x in args.heads.split(","))
    seqs, layers = (4, 2) if args.tiny else (32, 30)
    lens, nblocks = _decode_rows(seqs)
    pool = int(sum(nblocks) * 1.5)
    g = torch.Generator().manual_seed(3)
    tables = _tables(nblocks, torch.randperm(pool, generator=g)[: sum(nblocks)])
    bf = [torch.randn(2, pool, kv_heads, BLOCK, HEAD_DIM, generator=g).bfloat16() for _ in range(layers)]
    i8 = []
    for c in bf:
        cache = torch.empty(q8.cache_shape(pool, kv_heads, BLOCK, HEAD_DIM), dtype=torch.int8)
        for i in (0, 1):
            vals, scales = q8.split(cache[i], BLOCK, HEAD_DIM)
            qv, s = q8.quantize(c[i])
            vals.copy_(qv)
            scales.copy_(s)
        i8.append(cache)
    q = torch.randn(seqs, heads, HEAD_DIM, generator=g).bfloat16()
    out_bf, out_i8 = torch.empty_like(q), torch.empty_like(q)
    scale = 1 / math.sqrt(HEAD_DIM)

    def run(caches, out, block_size):
        for c in caches:
            assert k.paged_attention_cpu(q, c, tables, None, lens, scale, out, block_size=block_size)

    run(bf, out_bf, None)
    run(i8, out_i8, BLOCK)
    torch.testing.assert_close(out_i8.float(), out_bf.float(), rtol=0.1, atol=0.05)
    tokens = sum(int(n) for n in lens)
    cases = [
        _case(
            "kv_int8",
            f"decode attention, {seqs} rows of 148-560 tokens, {heads}/{kv_heads} heads, {layers} layers",
            alternate({"int8": lambda: run(i8, out_i8, BLOCK), "bf16": lambda: run(bf, out_bf, None)}, args.rounds),
            "int8",
            bytes_per_token={"int8": 2 * kv_heads * q8.cell_bytes(BLOCK, HEAD_DIM) // BLOCK * layers, "bf16": 2 * kv_heads * HEAD_DIM * 2 * layers},
            tokens=tokens,
        )
    ]
    rows = 32 if args.tiny else 2048
    cos = torch.randn(4096, HEAD_DIM, generator=g)
    sin = torch.randn(4096, HEAD_DIM, generator=g)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * HEAD_DIM, generator=g).bfloat16()
    qk, v = qkv[:, : (heads + kv_heads) * HEAD_DIM], qkv[:, (heads + kv_heads) * HEAD_DIM :]
    positions = torch.arange(rows, dtype=torch.int64)
    slots = torch.randperm(pool * BLOCK, generator=g)[:rows].contiguous()
    c8, cb = i8[0].clone(), bf[0].clone()
    cases.append(
        _case(
            "kv_int8",
            f"RoPE + KV write, {rows} tokens",
            alternate(
                {
                    "int8": lambda: k.rope_write_kv(qk, v, positions, slots, cos, sin, c8, heads, block_size=BLOCK),
                    "bf16": lambda: k.rope_write_kv(qk, v, positions, slots, cos, sin, cb, heads),
                },
                args.rounds,
                reps=20,
            ),
            "int8",
            rows=rows,
        )
    )
    return cases


# -- the one-call C step -----------------------------------------------------------------------
def _step_inputs(prefill: int, decodes: int, context: int, block_size: int, vocab: int, g: torch.Generator):
    """(input_ids, positions, metadata) of a step: ``decodes`` sequences at position ``context``
    (blocks 0..), then one prompt of ``prefill`` tokens from position 0 (the next blocks)."""
    import torch

    from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group

    groups, slots, positions, start, block = [], [], [], 0, 0
    if decodes:
        per = -(-(context + 1) // block_size)
        tables = [list(range(block + i * per, block + (i + 1) * per)) for i in range(decodes)]
        groups.append(build_attention_group(0, [1] * decodes, [context] * decodes, tables, block_size, torch.device("cpu")))
        slots += [t[context // block_size] * block_size + context % block_size for t in tables]
        positions += [context] * decodes
        block, start = block + decodes * per, decodes
    if prefill:
        table = list(range(block, block + -(-prefill // block_size)))
        groups.append(build_attention_group(start, [prefill], [0], [table], block_size, torch.device("cpu")))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(prefill)]
        positions += list(range(prefill))
    ids = torch.randint(100, vocab, (prefill + decodes,), generator=g)
    return ids, torch.tensor(positions, dtype=torch.int64), AttentionMetadata(torch.tensor(slots, dtype=torch.int64), groups, block_size)


def op_step(args: argparse.Namespace, tmp: str) -> list[dict]:
    import torch

    from pagedserve import LLM

    model_path = args.model
    shapes = args.step_shapes
    context = args.context
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        model_path = model_path or tiny_model_dir()
        shapes, context = "64:0,24:4,0:8", 40
    llm = LLM(model_path, dtype="bfloat16", kv_cache_memory_bytes=(64 << 20) if args.tiny else (1 << 30), enable_prefix_caching=False)
    runner = llm.llm_engine.core.worker.model_runner
    model, kv_caches, backend = runner.model, runner.kv_caches, runner.model.backend
    real = getattr(backend, "decode_step", None)
    if real is None:
        raise SystemExit(f"backend {backend.name} has no one-call step")
    used = []

    def c_step(*a):
        ok = real(*a)
        used.append(ok)
        return ok

    paths = {"C step": c_step, "layer-by-layer": lambda *a: False}
    g = torch.Generator().manual_seed(0)
    cases = []
    try:
        for shape in shapes.split(","):
            prefill, decodes = (int(v) for v in shape.split(":"))
            ids, positions, meta = _step_inputs(prefill, decodes, context, runner.block_size, model.config.vocab_size, g)
            outs = {}
            with torch.inference_mode():
                for name, fn in paths.items():
                    backend.decode_step = fn
                    outs[name] = model(ids, positions, kv_caches, meta).clone()
                if not torch.equal(*outs.values()):
                    raise SystemExit(f"{shape}: the two paths' hidden states differ")
                took = bool(used and used[-1])

                def timed(fn):
                    def run():
                        backend.decode_step = fn
                        model(ids, positions, kv_caches, meta)

                    return run

                sides = alternate({name: timed(fn) for name, fn in paths.items()}, args.rounds)
            cases.append(
                _case(
                    "step",
                    f"{prefill} prefill + {decodes} decodes at {context} tokens",
                    sides,
                    "C step",
                    prefill=prefill,
                    decodes=decodes,
                    c_step_ran=took,
                )
            )
    finally:
        backend.decode_step = real
    return cases


# -- sampling with bans ------------------------------------------------------------------------
def op_sampler(args: argparse.Namespace, tmp: str) -> list[dict]:
    import numpy as np
    import torch

    try:
        from pagedserve import messages as serial
    except ImportError:  # before the msgpack codec moved
        from pagedserve.engine import serial
    from pagedserve.model.sampler import Sampler
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.worker.input_batch import CachedRequestState, InputBatch

    vocab = 49152
    rows = 4 if args.tiny else 32

    def batch_of(make_params):
        batch = InputBatch(rows, 1024, 64, vocab, torch.device("cpu"))
        ids = [
            batch.add_request(CachedRequestState(f"r{i}", make_params(i), [], None), list(range(300)), list(range(100)), [0], 0) for i in range(rows)
        ]
        return batch, np.array(ids, dtype=np.int64)

    def with_bad_words(i: int) -> SamplingParams:
        p = SamplingParams(temperature=0.0)
        rnd = random.Random(i)
        p._bad_words_token_ids = [[rnd.randrange(vocab) for _ in range(rnd.randint(1, 6))] for _ in range(128)]  # the cap: 64 words x 2
        return p

    logits = torch.randn(rows, vocab)
    sampler = Sampler()
    batches = {
        "unrestricted": batch_of(lambda i: SamplingParams(temperature=0.0)),
        "allowed 100 ids": batch_of(lambda i: SamplingParams(temperature=0.0, allowed_token_ids=list(range(100)))),
        "allowed all ids": batch_of(lambda i: SamplingParams(temperature=0.0, allowed_token_ids=list(range(vocab)))),
        "bad words 128 spellings": batch_of(with_bad_words),
    }
    sides = alternate(
        {k: (lambda b=b: sampler(logits, b[0].sampling_metadata(b[1]))) for k, b in batches.items()},
        args.rounds if args.tiny else max(args.rounds, 30),
    )
    cases = [_case("sampler", f"metadata + sampling, {rows} greedy rows, vocabulary {vocab}", sides, "unrestricted", rows=rows)]
    params = SamplingParams(allowed_token_ids=list(range(vocab)), n=5, max_tokens=8)
    t = time.perf_counter()
    kids = [params.clone() for _ in range(5)]
    clone = time.perf_counter() - t
    t = time.perf_counter()
    msgs = [serial.encode(kid) for kid in kids]
    enc = time.perf_counter() - t
    t = time.perf_counter()
    for m in msgs:
        serial.decode(m)
    dec = time.perf_counter() - t
    adm = {"clone_ms": clone * 1e3, "encode_ms": enc * 1e3, "decode_ms": dec * 1e3, "megabytes": sum(map(len, msgs)) / 1e6}
    print(
        f"sampler | n=5 copies of a full-vocabulary allowed_token_ids: clone {adm['clone_ms']:.1f} ms, encode {adm['encode_ms']:.1f} ms, "
        f"decode with checks {adm['decode_ms']:.1f} ms, {adm['megabytes']:.2f} MB",
        flush=True,
    )
    cases.append({"op": "sampler", "case": "admission of n=5 full-vocabulary allowed_token_ids", **adm})
    return cases


def _command(args: argparse.Namespace) -> str:
    """``pagedserve bench kernels`` and the flags that differ from their defaults."""
    import shlex

    ref = argparse.ArgumentParser()
    add_kernels_args(ref)
    parts = ["pagedserve", "bench", "kernels", "--op", args.op]
    for action in ref._actions:
        if not action.option_strings or action.dest in ("op", "help"):
            continue
        value = getattr(args, action.dest, action.default)
        if action.dest == "rounds" and value == (2 if args.tiny else 9):
            continue
        if value == action.default:
            continue
        flag = action.option_strings[0]
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


_RUN = {
    "matmul": op_matmul,
    "attention": op_attention,
    "fused": op_fused,
    "kv_int8": op_kv_int8,
    "step": op_step,
    "sampler": op_sampler,
    "qmatmul": op_qmatmul,
}


def cmd_kernels(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.bench.results import host_info, record

    ops = list(OPS) if args.op == "all" else [o.strip() for o in args.op.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise SystemExit(f"--op: unknown {unknown}; choose from {', '.join(OPS)} or all")
    if args.rounds is None:
        args.rounds = 2 if args.tiny else 9
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    threads = torch.get_num_threads()
    host = host_info()
    print(f"{host['cpu']} ({host['class']}), {threads} threads, {args.rounds} rounds" + (" [--tiny: smoke run]" if args.tiny else ""), flush=True)
    everything = []
    tmp = tempfile.mkdtemp(prefix="pagedserve-kernels-")
    try:
        for op in ops:
            cases = _RUN[op](args, tmp)
            figures = {"op": op, "threads": threads, "rounds": args.rounds, "cases": cases}
            if args.rev:
                figures["rev"] = args.rev
            record("kernels", figures, tiny=args.tiny, command=_command(args))
            everything.append(figures)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump({"host": host, "tiny": args.tiny, "ops": everything}, fh, indent=1)
    return 0
