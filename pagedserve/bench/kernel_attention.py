"""``pagedserve bench kernels --op attention``: paged attention (decode and prefill) against its peers."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch  # imported where used: the CLI parser (and a server front) must not load torch

from pagedserve.bench.kernel_common import BLOCK, CAP_AVX512BF16, CAP_SCALAR, HEAD_DIM, _case, _kernel_class, _rev_csrc, alternate, build_variant


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
