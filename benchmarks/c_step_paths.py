"""One engine step through the one-call C step (``csrc/decode_step.c``) against the
layer-by-layer path (Python over the C element-wise ops, oneDNN or the other matmuls), in the
same process, alternating: a prefill-only step, a mixed step (decodes beside a prefill chunk, as
``--max-step-ms`` makes them) and a decode-only step, on the default model (or ``--model``).
Both paths run the model's forward on the same inputs (fresh random prompts, blocks in order);
their hidden states are compared bit for bit before timing. Prints medians in ms and the ratio.

    .venv/bin/python benchmarks/c_step_paths.py [--rounds 7] [--shapes 2048:0,232:24,0:32] [--context 300]

A shape is ``prefill tokens:decodes``; decodes attend to ``--context`` tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM
from pagedserve.model.attn_metadata import AttentionMetadata, build_attention_group


def step_inputs(prefill: int, decodes: int, context: int, block_size: int, vocab: int, g: torch.Generator):
    """(input_ids, positions, metadata) of a step: ``decodes`` sequences at position ``context``
    (blocks 0..), then one prompt of ``prefill`` tokens from position 0 (the next blocks)."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default="2048:0,232:24,0:32")
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    runner = llm.llm_engine.core.worker.model_runner
    model, kv_caches, backend = runner.model, runner.kv_caches, runner.model.backend
    real = backend.decode_step
    paths = {"layer-by-layer": lambda *a: False, "C step": real}
    g = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, backend {backend.name}, decodes at {args.context} tokens of context")
    for shape in args.shapes.split(","):
        prefill, decodes = (int(v) for v in shape.split(":"))
        ids, positions, meta = step_inputs(prefill, decodes, args.context, runner.block_size, model.config.vocab_size, g)
        outs = {}
        for name, fn in paths.items():
            backend.decode_step = fn
            outs[name] = model(ids, positions, kv_caches, meta).clone()
        if not torch.equal(*outs.values()):
            raise SystemExit(f"{shape}: the two paths' hidden states differ")
        times = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                backend.decode_step = fn
                t0 = time.perf_counter()
                model(ids, positions, kv_caches, meta)
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{prefill:5d} prefill + {decodes:3d} decodes: " + ", ".join(f"{k} {v:8.2f} ms" for k, v in med.items())
              + f"; layer-by-layer / C step = {med['layer-by-layer'] / med['C step']:.2f}x", flush=True)
    backend.decode_step = real


if __name__ == "__main__":
    main()
