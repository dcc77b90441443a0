"""``pagedserve bench {throughput,latency,serve,memory,kernels}``, hooked into the main CLI.

Examples::

    pagedserve bench throughput --backend both --dtype bfloat16        # W1: 32 x (64-512 in, 128 out)
    pagedserve bench throughput --dataset-name prefix-repetition --num-prompts 64 \\
        --prefix-len 512 --suffix-len 64 --num-prefixes 4 --output-len 64
    pagedserve bench latency --input-len 512 --output-len 128
    pagedserve bench serve --base-url http://127.0.0.1:8000 --request-rates 1,2,4,inf --plot sweep.png
    pagedserve bench memory --output-json mem.json --plot mem.png    # KV memory holding tokens: paged vs static
    pagedserve bench kernels --op matmul --rows 1,32,256                # the CPU kernels against their peers
    pagedserve bench kernels --op all --tiny                            # every kernel benchmark in seconds (smoke)
"""

from __future__ import annotations

import argparse

from pagedserve.config import EngineConfig


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one that its help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if "default" in h or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from pagedserve.bench.datasets import add_dataset_args
    from pagedserve.bench.kernels import add_kernels_args, cmd_kernels
    from pagedserve.bench.latency import add_latency_args, cmd_latency
    from pagedserve.bench.memory import add_memory_args, cmd_memory
    from pagedserve.bench.serve import add_serve_args, cmd_serve_bench
    from pagedserve.bench.throughput import add_throughput_args, cmd_throughput

    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, batch-1 latency, online serving")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    t = sub.add_parser(
        "throughput",
        help="offline throughput, all requests at once (pagedserve, HF generate, or both)",
        formatter_class=_HelpFormatter,
    )
    add_throughput_args(t)
    add_dataset_args(t)
    EngineConfig.add_cli_args(t)
    t.set_defaults(func=cmd_throughput)

    lat = sub.add_parser("latency", help="batch-1 prefill and decode tokens/s", formatter_class=_HelpFormatter)
    add_latency_args(lat)
    EngineConfig.add_cli_args(lat)
    lat.set_defaults(func=cmd_latency)

    s = sub.add_parser(
        "serve",
        help="online benchmark against an OpenAI-compatible server (TTFT, TPOT, ITL, E2EL, goodput)",
        formatter_class=_HelpFormatter,
    )
    add_serve_args(s)
    s.set_defaults(func=cmd_serve_bench)

    m = sub.add_parser(
        "memory",
        help="share of KV memory holding token states, paged vs static reservation, and the batch size and throughput that follow",
        formatter_class=_HelpFormatter,
    )
    add_memory_args(m)
    add_dataset_args(m)
    EngineConfig.add_cli_args(m)
    m.set_defaults(func=cmd_memory)

    k = sub.add_parser(
        "kernels",
        help="the CPU kernels alone against their peers on this host: --op matmul|attention|fused|kv_int8|step|sampler|all",
        formatter_class=_HelpFormatter,
    )
    add_kernels_args(k)
    k.set_defaults(func=cmd_kernels)
    return bench
