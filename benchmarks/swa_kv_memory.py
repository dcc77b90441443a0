"""KV bytes per request with sliding-window attention, with and without the window's freeing
(issue 49's benchmark: a Gemma-3-shaped model at a 16k context).

Only the KV shape matters, so the models are configs, not weights (transformers builds each
config, pagedserve's registry reads its per-layer windows):
- gemma3-4b-shaped: 34 layers, 5 local : 1 global (``layer_types`` as transformers writes them),
  window 1024, 4 KV heads of 256, bf16: hybrid. pagedserve's one block table frees nothing;
  per-group tables (vLLM's hybrid allocator) are computed for comparison.
- the same shape with every layer local: pure sliding window, freed by pagedserve.
- mistral-7b-v0.1-shaped: 32 layers, window 4096, 8 KV heads of 128: pure.
The freeing is measured by driving the core's allocator (``pagedserve.bench.window_memory``)
through one request: its prompt in chunks of ``--chunk`` tokens (the default token budget),
then ``--num-decode`` decodes up to ``--context``.

    PYTHONPATH=. .venv/bin/python benchmarks/swa_kv_memory.py [--context 16384] [--block-size 16] [--chunk 2048] [--tiny]

Prints one line per model and the figures as JSON; appends them to
benchmarks/results/swa_kv_memory.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from pagedserve.bench.results import record  # noqa: E402
from pagedserve.bench.window_memory import describe_report, window_report  # noqa: E402


def configs() -> dict:
    """name -> (HF config, KV bytes per token per layer)."""
    import transformers

    gemma = dict(
        num_hidden_layers=34, sliding_window=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_size=64, intermediate_size=128
    )
    bf16_kv = 2 * 2  # K and V, 2 bytes each
    return {
        "gemma3-4b-shaped (5 local : 1 global)": (transformers.Gemma3TextConfig(**gemma), bf16_kv * 4 * 256),
        "gemma3-4b-shaped, every layer local": (transformers.Gemma3TextConfig(**gemma, layer_types=["sliding_attention"] * 34), bf16_kv * 4 * 256),
        "mistral-7b-v0.1-shaped": (
            transformers.MistralConfig(
                num_hidden_layers=32, sliding_window=4096, num_key_value_heads=8, head_dim=128, hidden_size=64, intermediate_size=128
            ),
            bf16_kv * 8 * 128,
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=16384, help="tokens of one request (prompt + decodes)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (the token budget)")
    p.add_argument("--num-decode", type=int, default=256, help="decodes at the end of the request")
    p.add_argument("--tiny", action="store_true", help="smoke run: a 2,048-token context, chunks of 256, 16 decodes")
    args = p.parse_args()
    if args.tiny:
        args.context, args.chunk, args.num_decode = 2048, 256, 16
    from pagedserve.model.registry import layer_windows

    results = {}
    for name, (cfg, per_token_layer) in configs().items():
        r = window_report(layer_windows(cfg), per_token_layer, args.context, args.block_size, args.chunk, args.num_decode)
        results[name] = r
        print(f"{name}: {describe_report(r)}")
    print(json.dumps(results, indent=1))
    where = record("swa_kv_memory", results, tiny=args.tiny)
    if where:
        print(f"appended to {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
