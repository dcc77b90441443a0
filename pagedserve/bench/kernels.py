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
import ctypes
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch  # imported where used: the CLI parser (and a server front) must not load torch


OPS = ("matmul", "attention", "fused", "kv_int8", "step", "sampler")
MATMUL_SHAPES = {  # (out, in) of qkv, o, gate_up, down; layers
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 4),
}
HEAD_DIM, BLOCK = 64, 16


def add_kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", required=True, help=f"one or more of {', '.join(OPS)} (commas), or all")
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run (tiny sizes, 2 rounds); figures mean nothing")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per side (default 9; --tiny: 2)")
    p.add_argument("--threads", type=int, default=None, help="OpenMP / torch threads (default: torch's, one per core)")
    p.add_argument("--rows", default=None, help="matmul: row counts (default 1,4,16,32,64,256,2048; --dtype float32: 1,32,256)")
    p.add_argument("--shapes", choices=sorted(MATMUL_SHAPES), default="smollm2", help="matmul: whose projections")
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


# -- timing --------------------------------------------------------------------------------
def alternate(fns: dict[str, Callable[[], Any]], rounds: int, reps: int = 1) -> dict[str, dict[str, float]]:
    """One warm-up call of each side, then ``rounds`` rounds alternating the sides (each ``reps``
    calls); per side the median and minimum ms per call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t0) / reps * 1e3)
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v)} for k, v in times.items()}


def _case(op: str, case: str, sides: dict[str, dict[str, float]], base: str, work: Optional[dict[str, float]] = None, **extra: Any) -> dict[str, Any]:
    """A result: the sides' times, each side's median over ``base``'s, and per side the rate of
    ``work`` (e.g. ``{"GB/s": bytes / 1e9}``: units per second)."""
    b = sides[base]["median_ms"]
    for s in sides.values():
        for unit, amount in (work or {}).items():
            s[unit] = amount / (s["median_ms"] / 1e3)
    res = {
        "op": op,
        "case": case,
        "base": base,
        "sides": sides,
        "ratio_to_base": {k: v["median_ms"] / b for k, v in sides.items() if k != base},
        **extra,
    }
    rates = lambda s: "".join(f", {s[u]:.1f} {u}" for u in (work or {}))  # noqa: E731
    line = ", ".join(f"{k} {v['median_ms']:.3f} ms ({'min %.3f' % v['min_ms']}{rates(v)})" for k, v in sides.items())
    ratios = "; ".join(f"{k} / {base} = {r:.2f}x" for k, r in res["ratio_to_base"].items())
    print(f"{op} | {case}: {line}" + (f"; {ratios}" if ratios else ""), flush=True)
    return res


# -- building peers --------------------------------------------------------------------------
def _rev_csrc(rev: str, tmp: str) -> str:
    """``csrc/`` of git revision ``rev``, extracted under ``tmp``."""
    from pagedserve.ops.cpu import build

    root = build._CSRC
    for _ in range(4):  # the checkout: csrc is pagedserve/ops/cpu/csrc
        root = os.path.dirname(root)
    rel = os.path.relpath(build._CSRC, root)
    out = os.path.join(tmp, "rev")
    os.makedirs(out, exist_ok=True)
    tree = subprocess.run(["git", "archive", rev, rel], cwd=root, check=True, stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-f", "-", "-C", out], input=tree, check=True)
    return os.path.join(out, rel)


_variants: dict[str, ctypes.CDLL] = {}
# Each library's one source before csrc/ was split into units (176ec54): --rev of an older revision.
_UNITY_SOURCES = {"paged_attention": "paged_attention.c", "fused_ops": "fused_ops.c", "decode": "decode_step.c"}
# Build-time caps (``-DPS_ISA_CAP``, csrc/common/cpu.h): the same units, run at a lower ISA level.
CAP_AVX512BF16 = "-DPS_ISA_CAP=PS_ISA_AVX512BF16"  # no AMX: the AVX-512 (AVX512-BF16) paths
CAP_SCALAR = "-DPS_ISA_CAP=PS_ISA_SCALAR"  # the generic C loops


def build_variant(lib: str, flags: list[str], tmp: str, tag: str, csrc: Optional[str] = None) -> ctypes.CDLL:
    """The engine's library ``lib`` ("paged_attention", "fused_ops", "decode") built as the engine
    builds it (``build.build_library``: its units, each with its ISA's flags) with ``flags`` added
    to every unit (e.g. ``CAP_AVX512BF16``: the same code capped below AMX), from ``csrc`` (default
    this tree's), its functions declared. A ``csrc`` from before the units (one source per
    library, as ``--rev`` of an older revision gives) is built as it was then: that source with
    ``-march=native`` and ``flags``. Kept under ``$PAGEDSERVE_CACHE/kernels/bench/``, keyed by
    the sources, the flags, the compiler and the CPU as the engine's own builds are (the units'
    objects under ``kernels/obj/``, shared with the engine's where the flags are the same)."""
    import hashlib

    from pagedserve.ops.cpu import build

    src_dir = csrc or build._CSRC
    units = build._units(lib)
    unity = not all(os.path.exists(os.path.join(src_dir, src)) for src, _ in units)
    if unity:
        single = os.path.join(src_dir, _UNITY_SOURCES[lib])
        if not os.path.exists(single):
            raise SystemExit(f"{src_dir}: neither this tree's kernel units nor the single {_UNITY_SOURCES[lib]} of older revisions")
        recipe: Any = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *build._LIBS[lib][0], *flags]
    else:
        recipe = [(src, unit_flags + list(flags)) for src, unit_flags in units]
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(build._sources_digest(src_dir) + repr((recipe, cc)).encode() + build._cpu_identity()).hexdigest()[:16]
    if key in _variants:
        return _variants[key]
    from pagedserve.platform import cache_dir

    out_dir = os.path.join(cache_dir(), "kernels", "bench")
    so = os.path.join(out_dir, f"{lib}-{tag}-{key}.so")
    if not os.path.exists(so):
        os.makedirs(out_dir, exist_ok=True)
        print(
            f"building {lib} ({tag}: {' '.join(flags) or 'the engine flags'}" + (f", one source: {_UNITY_SOURCES[lib]}" if unity else "") + ") ...",
            flush=True,
        )
        try:
            if unity:
                part = os.path.join(tmp, os.path.basename(so))
                subprocess.run([cc, *recipe, single, "-o", part, "-lm"], check=True, capture_output=True)
                shutil.move(part, so)
            else:
                build.build_library(lib, so, tuple(flags), src_dir)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"building {lib} ({tag}) failed:\n{(e.stderr or b'').decode(errors='replace')[-3000:]}") from None
    dll = ctypes.CDLL(so)
    build._declare(lib, dll)
    _variants[key] = dll
    return dll


def _cpu_class() -> str:
    from pagedserve.bench.results import host_info

    return host_info()["class"]


_LEVELS = ("other", "avx2", "avx512", "avx512bf16", "amx")  # cpu_class's, lowest first


def _kernel_class() -> str:
    """The class whose kernel paths run here: this CPU's, or lower where ``PAGEDSERVE_CPU_ISA``
    caps the kernels (e.g. ``avx2`` on an AMX host: its peers are then an AVX2 CPU's)."""
    cls = _cpu_class()
    cap = os.environ.get("PAGEDSERVE_CPU_ISA", "")
    cap = "other" if cap == "scalar" else cap
    if cls in _LEVELS and cap in _LEVELS and _LEVELS.index(cap) < _LEVELS.index(cls):
        return cap
    return cls


# -- matmul ----------------------------------------------------------------------------------
def op_matmul(args: argparse.Namespace, tmp: str) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagedserve.model.packed_linear import PackedLinear, attach_small_gemm, onednn_packs, pack_weight, packed_linear
    from pagedserve.ops.cpu import matmul as mm

    shapes, layers = MATMUL_SHAPES[args.shapes]
    if args.tiny:
        layers = 2
    default_rows = "1,32" if args.tiny else ("1,32,256" if args.dtype == "float32" else "1,4,16,32,64,256,2048")
    rows = [int(r) for r in (args.rows or default_rows).split(",")]
    g = torch.Generator().manual_seed(0)
    dims = [(n, k) for _ in range(layers) for n, k in shapes]
    if args.lm_head:
        dims.append((49152, 576))
    weights = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for n, k in dims]
    params = sum(n * k for n, k in dims)
    cases = []
    if args.dtype == "float32":
        wf = [w.float() for w in weights]
        packed = [pack_weight(w) for w in wf]
        for m in rows:
            xs = {k: torch.randn(m, k, generator=g) for _, k in dims}
            torch.testing.assert_close(packed_linear(xs[wf[0].shape[1]], packed[0]), F.linear(xs[wf[0].shape[1]], wf[0]), rtol=1e-4, atol=1e-4)
            sides = alternate(
                {
                    "oneDNN fp32": lambda: [packed_linear(xs[w.shape[1]], p) for w, p in zip(wf, packed)],
                    "F.linear fp32": lambda: [F.linear(xs[w.shape[1]], w) for w in wf],
                },
                args.rounds,
            )
            cases.append(
                _case(
                    "matmul",
                    f"{args.shapes} fp32, {len(dims)} weights, M = {m}",
                    sides,
                    "oneDNN fp32",
                    {"GB/s": params * 4 / 1e9, "GFLOP/s": 2 * m * params / 1e9},
                    rows=m,
                    dtype="float32",
                )
            )
        return cases

    engine = []
    plans: dict = {}
    for w in weights:
        pl = PackedLinear(w)
        attach_small_gemm(pl, plans)
        engine.append(pl)
    kind = "AMX" if engine[0].amx_weight is not None else "AVX2 bf16" if engine[0].avx2_weight is not None else "oneDNN"
    onednn = [pack_weight(w) for w in weights] if onednn_packs(torch.bfloat16) and kind != "oneDNN" else None
    if onednn is not None:
        for p in onednn:
            mm.collapse_to_huge_pages(*mm._packed_address(p))
    avx2_host = kind == "AVX2 bf16"
    f32 = [pack_weight(w.float()) for w in weights] if avx2_host else None
    rev_fn = None
    if args.rev:
        lib = build_variant("decode", [], tmp, "rev", _rev_csrc(args.rev, tmp))
        rev_fn = {"AMX": lib.amx_gemm_bf16, "AVX2 bf16": lib.avx2_gemm_bf16, "oneDNN": lib.small_gemm_bf16}[kind]
    print(
        f"matmul: {len(dims)} weights of {args.shapes} ({params / 1e6:.1f} M params, bf16), the engine's kernel: {kind}"
        + ("" if kind != "oneDNN" else f" (small-M plans {sorted(set(v for v in plans.values() if v))})"),
        flush=True,
    )

    for m in rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in dims}
        small = kind == "oneDNN" and m <= mm.SMALL_GEMM_MAX_ROWS and all(pl.small_plan for pl in engine)
        if kind == "oneDNN":
            name = "small-M" if small else "oneDNN"
            if small:
                calls = [(xs[pl.in_features], pl.packed_weight, pl.out_features, pl.small_plan) for pl in engine]
                fns = {name: lambda calls=calls: [mm.small_gemm(x, p, None, n, plan) for x, p, n, plan in calls]}
                fns["oneDNN"] = lambda: [packed_linear(xs[pl.in_features], pl.packed_weight) for pl in engine]
            else:
                fns = {name: lambda: [packed_linear(xs[pl.in_features], pl.packed_weight) for pl in engine]}
        else:
            name = kind
            gemm = mm.amx_gemm if kind == "AMX" else mm.avx2_gemm
            own = [pl.amx_weight if kind == "AMX" else pl.avx2_weight for pl in engine]
            fns = {name: lambda gemm=gemm, own=own: [gemm(xs[w.shape[1]], o, None, w.shape[0]) for w, o in zip(weights, own)]}
            if onednn is not None:
                fns["oneDNN bf16"] = lambda: [packed_linear(xs[w.shape[1]], p) for w, p in zip(weights, onednn)]
        if f32 is not None:
            xf = {k: v.float() for k, v in xs.items()}
            fns["oneDNN fp32"] = lambda xf=xf: [packed_linear(xf[w.shape[1]], p) for w, p in zip(weights, f32)]
            if m <= 64:
                fns["F.linear bf16"] = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]
        if rev_fn is not None and (kind != "oneDNN" or small):
            ys = [torch.empty(m, w.shape[0], dtype=torch.bfloat16) for w in weights]
            if kind == "oneDNN":
                calls = [
                    (
                        xs[pl.in_features].data_ptr(),
                        pl.in_features,
                        torch.ops.mkldnn.data_ptr(pl.packed_weight),
                        y.data_ptr(),
                        pl.out_features,
                        *pl.small_plan,
                    )
                    for pl, y in zip(engine, ys)
                ]
                run = lambda calls=calls: [rev_fn(x, m, k, w, None, y, n, c, b) for x, k, w, y, n, c, b in calls]  # noqa: E731
            else:
                calls = [(xs[w.shape[1]].data_ptr(), w.shape[1], o.data_ptr(), y.data_ptr(), w.shape[0]) for w, o, y in zip(weights, own, ys)]
                run = lambda calls=calls: [rev_fn(x, m, k, w, None, y, n) for x, k, w, y, n in calls]  # noqa: E731
            fns[f"{name}@{args.rev}"] = run
        # Checks, once: the engine's side against oneDNN bit for bit (small-M) or a float32 product.
        got = fns[name]()
        w0 = weights[0]
        ref = xs[w0.shape[1]].float() @ w0.float().t()
        torch.testing.assert_close(got[0].float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        if small:
            ref_bits = fns["oneDNN"]()
            if any(not torch.equal(a, b) for a, b in zip(got, ref_bits)):
                raise SystemExit(f"M = {m}: the small-M kernel's output differs from oneDNN's")
        if rev_fn is not None and f"{name}@{args.rev}" in fns:
            fns[f"{name}@{args.rev}"]()
            if any(not torch.equal(a, b) for a, b in zip(got, ys)):
                raise SystemExit(f"M = {m}: {name} at {args.rev} gives other bits than this tree's")
        sides = alternate(fns, args.rounds, reps=max(1, 16 // m) if not args.tiny else 1)
        cases.append(
            _case(
                "matmul",
                f"{args.shapes} bf16, {len(dims)} weights, M = {m}",
                sides,
                name,
                {"GB/s": params * 2 / 1e9, "GFLOP/s": 2 * m * params / 1e9},
                rows=m,
                dtype="bfloat16",
                kernel=name,
            )
        )
    return cases


# -- attention -------------------------------------------------------------------------------
def _attention_sides(args: argparse.Namespace, tmp: str, phase: str) -> dict[str, Callable]:
    """name -> the ``paged_attention_{bf16,f32}`` function of each side (the engine's first)."""
    from pagedserve.ops.cpu import build

    fn_name = "paged_attention_f32" if args.dtype == "float32" else "paged_attention_bf16"
    lib = build.get_lib()
    if lib is None:
        raise SystemExit("the attention kernel is not available here (no C compiler, or PAGEDSERVE_CPU_KERNELS=0)")
    cls = _kernel_class()
    sides = {"engine": getattr(lib, fn_name)}
    if args.rev:
        sides[f"engine@{args.rev}"] = getattr(build_variant("paged_attention", [], tmp, "rev", _rev_csrc(args.rev, tmp)), fn_name)
    if args.tiny:  # builds of the peers take ~30 s of CPU each; a smoke run times the engine's kernel alone
        return sides
    if cls == "amx":
        sides["no AMX (AVX-512)"] = getattr(build_variant("paged_attention", [CAP_AVX512BF16], tmp, "noamx"), fn_name)
    elif phase == "decode" and cls in ("avx512bf16", "avx2"):
        sides["per (token, KV head)"] = getattr(build_variant("paged_attention", ["-DTOKEN_TASKS_PER_THREAD=1000000"], tmp, "head"), fn_name)
    if cls == "avx2" and phase == "decode":
        sides["generic C"] = getattr(build_variant("paged_attention", [CAP_SCALAR], tmp, "generic"), fn_name)
    return sides


def op_attention(args: argparse.Namespace, tmp: str) -> list[dict]:
    heads, kv_heads = (int(x) for x in args.heads.split(","))
    cases = []
    if args.phase in ("decode", "both"):
        cases += _attention_decode(args, tmp, heads, kv_heads)
    if args.phase in ("prefill", "both"):
        cases += _attention_prefill(args, tmp, heads, kv_heads)
    return cases


def _decode_rows(seqs: int, seed: int = 1) -> tuple[torch.Tensor, list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(148, 561, (seqs,), generator=g)
    return lens, [math.ceil(int(n) / BLOCK) for n in lens]


def _layouts(nblocks: list[int], pool: int, g: torch.Generator, tiny: bool) -> dict[str, torch.Tensor]:
    """Block ids in use per layout: in order (as after a prefill), W1's (prompt blocks in order,
    the last 8 of each sequence interleaved with the others', as decodes append them), scattered."""
    import torch

    seqs = len(nblocks)
    prompt_blocks = [max(nb - 8, 0) for nb in nblocks]
    starts = [sum(prompt_blocks[:i]) for i in range(seqs)]
    w1 = [
        b
        for i, nb in enumerate(nblocks)
        for b in list(range(starts[i], starts[i] + prompt_blocks[i])) + [sum(prompt_blocks) + j * seqs + i for j in range(nb - prompt_blocks[i])]
    ]
    scattered = torch.randperm(pool, generator=g)[: sum(nblocks)]
    if tiny:
        return {"blocks scattered": scattered}
    return {"blocks in order": torch.arange(sum(nblocks)), "W1's layout": torch.tensor(w1), "blocks scattered": scattered}


def _tables(nblocks: list[int], ids: torch.Tensor) -> torch.Tensor:
    import torch

    tables = torch.zeros(len(nblocks), max(nblocks), dtype=torch.int64)
    at = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = ids[at : at + nb]
        at += nb
    return tables


def _attention_decode(args, tmp, heads, kv_heads) -> list[dict]:
    import torch

    seqs, layers = (4, 2) if args.tiny else (32, 30)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    fns = _attention_sides(args, tmp, "decode")
    lens, nblocks = _decode_rows(seqs)
    pool = args.pool_blocks or int(sum(nblocks) * 1.5)
    if pool < sum(nblocks):
        raise SystemExit(f"--pool-blocks must be at least the {sum(nblocks)} blocks in use")
    g = torch.Generator().manual_seed(2)
    caches = [torch.randn(2, pool, kv_heads, BLOCK, HEAD_DIM, generator=g).to(dtype) for _ in range(layers)]
    q = torch.randn(seqs, heads, HEAD_DIM, generator=g).to(dtype)
    nbytes = sum(int(n) for n in lens) * kv_heads * HEAD_DIM * caches[0].element_size() * 2 * layers
    cases = []
    for layout, ids in _layouts(nblocks, pool, g, args.tiny).items():
        tables = _tables(nblocks, ids)
        outs = {name: torch.empty_like(q) for name in fns}

        def run(name, tables=tables, outs=outs):
            fn, out = fns[name], outs[name]
            for c in caches:
                k = c.data_ptr()
                rc = fn(
                    q.data_ptr(),
                    k,
                    k + c.stride(0) * c.element_size(),
                    tables.data_ptr(),
                    tables.shape[1],
                    None,
                    lens.data_ptr(),
                    out.data_ptr(),
                    seqs,
                    heads,
                    kv_heads,
                    HEAD_DIM,
                    BLOCK,
                    1 / math.sqrt(HEAD_DIM),
                )
                assert rc == 0, name

        for name in fns:
            run(name)
        _check_decode(q, caches[-1], tables, lens, nblocks, outs["engine"])
        same = [k for k in fns if k not in ("engine", "generic C", "no AMX (AVX-512)") and not torch.equal(outs[k], outs["engine"])]
        if same:
            raise SystemExit(f"attention {layout}: {same} give other bits than the engine's kernel")
        sides = alternate({name: (lambda name=name: run(name)) for name in fns}, args.rounds)
        cases.append(
            _case(
                "attention",
                f"decode, {seqs} rows of 148-560 tokens, {heads}/{kv_heads} heads, {layers} layers, {args.dtype}, {layout}",
                sides,
                "engine",
                {"GB/s": nbytes / 1e9},
                phase="decode",
                layout=layout,
            )
        )
    return cases


def _check_decode(q, cache, tables, lens, nblocks, got) -> None:
    """The engine's output against softmax(QK^T)V in float32 over the last layer."""
    import torch

    seqs, heads, d = q.shape
    kv_heads = cache.shape[2]
    want = torch.empty(q.shape)
    for t in range(seqs):
        k, v = (cache[i][tables[t, : nblocks[t]]].transpose(0, 1).reshape(kv_heads, -1, d)[:, : int(lens[t])].float() for i in (0, 1))
        qq = q[t].view(kv_heads, heads // kv_heads, d).float()
        want[t] = (torch.softmax(qq @ k.transpose(1, 2) / math.sqrt(d), -1) @ v).reshape(heads, d)
    tol = 1e-4 if q.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol * 10, atol=tol)


def _prefill_case(prompt_len: int, step_tokens: int, heads: int, kv_heads: int, seed: int = 0):
    """Cache, block tables, queries, token_seq and token_lens of one prefill step. The values span
    2^-8..2^8 around a large shared term, so that a change in the order of any sum shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seqs = max(1, step_tokens // prompt_len)
    per_seq = -(-prompt_len // BLOCK)
    wide = lambda x: x * torch.exp2(torch.randint(-8, 9, x.shape, generator=g).float())  # noqa: E731
    cache = wide(torch.randn(2, seqs * per_seq, kv_heads, BLOCK, HEAD_DIM, generator=g))
    cache[0, ..., 0] = 2.0**11
    cache = cache.bfloat16()
    tables = torch.randperm(seqs * per_seq, generator=g).reshape(seqs, per_seq).contiguous()
    q = wide(torch.randn(seqs * prompt_len, heads, HEAD_DIM, generator=g))
    q[..., 0] = 2.0**11
    token_seq = torch.arange(seqs, dtype=torch.int64).repeat_interleave(prompt_len).contiguous()
    token_lens = (torch.arange(prompt_len, dtype=torch.int64) + 1).repeat(seqs).contiguous()
    return cache, tables, q.bfloat16(), token_seq, token_lens


def _attention_prefill(args, tmp, heads, kv_heads) -> list[dict]:
    import torch
    import torch.nn.functional as F

    if args.dtype != "bfloat16":
        print("attention --phase prefill: bf16 only (the kernel's prefill path); skipped", flush=True)
        return []
    step_tokens = 256 if args.tiny else 2048
    prompt_lens = [128, 64] if args.tiny else [int(x) for x in args.prompt_lens.split(",")]
    fns = _attention_sides(args, tmp, "prefill")
    scale = 2.0**-13
    cases = []
    for p in prompt_lens:
        cache, tables, q, token_seq, token_lens = _prefill_case(p, step_tokens, heads, kv_heads)
        outs = {name: torch.empty_like(q) for name in fns}

        def run(name, cache=cache, tables=tables, q=q, token_seq=token_seq, token_lens=token_lens, outs=outs):
            k = cache.data_ptr()
            rc = fns[name](
                q.data_ptr(),
                k,
                k + cache.stride(0) * 2,
                tables.data_ptr(),
                tables.shape[1],
                token_seq.data_ptr(),
                token_lens.data_ptr(),
                outs[name].data_ptr(),
                q.shape[0],
                heads,
                kv_heads,
                HEAD_DIM,
                BLOCK,
                scale,
            )
            assert rc == 0, name

        seqs = tables.shape[0]

        def sdpa(cache=cache, tables=tables, q=q, p=p, seqs=seqs):
            for s in range(seqs):
                k, v = (cache[i][tables[s]].transpose(0, 1).reshape(kv_heads, -1, HEAD_DIM)[:, :p] for i in (0, 1))
                qq = q[s * p : (s + 1) * p].transpose(0, 1)
                F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale, enable_gqa=True)

        for name in fns:
            run(name)
        differ = [k for k in fns if k not in ("engine", "no AMX (AVX-512)") and not torch.equal(outs[k], outs["engine"])]
        if differ:
            raise SystemExit(f"prefill attention, prompts of {p}: {differ} give other bits than the engine's kernel")
        sides = alternate({**{name: (lambda name=name: run(name)) for name in fns}, "PyTorch SDPA": sdpa}, args.rounds)
        flop = float(token_lens.sum()) * 4 * HEAD_DIM * heads
        cases.append(
            _case(
                "attention",
                f"prefill, {seqs} prompts of {p} tokens, {heads}/{kv_heads} heads, one layer",
                sides,
                "engine",
                {"GFLOP/s": flop / 1e9},
                phase="prefill",
                prompt_len=p,
            )
        )
    return cases


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


_RUN = {"matmul": op_matmul, "attention": op_attention, "fused": op_fused, "kv_int8": op_kv_int8, "step": op_step, "sampler": op_sampler}


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
