"""``pagedserve bench memory``: how much of the KV memory holds token states, paged against a
static (non-paged) reservation, on one workload: the PagedAttention paper's Fig. 2 (Kwon et al.,
SOSP 2023) on this engine.

The engine runs the workload once with its step trace on (``pagedserve.core.trace``). Output
lengths are unpredictable, as in serving: each request stops after a length drawn uniformly in
``[1, output_len]`` (``--output-len-dist uniform``, the default; or at the model's EOS with
``eos``), while a server that reserves memory per request must assume the ``max_tokens`` it was
sent (``output_len``). From the trace, after every step:

* tokens held = the sum over running requests of the tokens whose K/V is in the cache
  (followed through ``scheduled`` / ``preempted`` / ``finished``; a pure sliding-window model
  holds at most its window per request: older tokens' blocks went back to the pool);
* paged allocated = ``num_used_blocks * block_size``;
* static reserved = the sum over the same running requests of ``prompt + max_tokens``, and, for
  a server with one ``max_model_len`` slot per request, ``running * max_model_len``.

Utilization = sum of held / sum of allocated (or reserved) over all steps with a running request.
Shared prefix blocks count once in ``allocated`` but once per request in ``held``, so with a
prefix-sharing dataset paged utilization can exceed 1 (a block serves several requests).

How many requests fit at once in the same pool: paged = the most requests the engine ran at once
(measured); static = how many of the requests' ``prompt + max_tokens`` reservations fit, taken in
arrival order (and ``pool // max_model_len`` slots). The engine then runs the workload again with
``max_num_seqs`` set to the static number, and the throughput ratio is printed: the batch-size cost
of static reservation with everything else (kernels, scheduler) equal.

For a model with sliding-window layers it also reports KV bytes per request at
``--window-context`` tokens (default max_model_len) with the window's freeing and without
(:mod:`pagedserve.bench.window_memory`: measured on the core's allocator for a pure
sliding-window model; for a hybrid one, the one block table against per-group tables).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import random
import time
from typing import Any, Optional, Sequence

from pagedserve.bench.datasets import SampleRequest, build_requests, describe
from pagedserve.bench.throughput import apply_num_threads, build_engine, load_tokenizer_and_config, warm_up_engine, write_json
from pagedserve.bench.window_memory import describe_report, window_report

logger = logging.getLogger("pagedserve.bench")

PAPER = {
    "source": "Kwon et al., Efficient Memory Management for Large Language Model Serving with PagedAttention, SOSP 2023, Fig. 2",
    "token_states_existing_systems": [0.204, 0.382],  # Orca (Max) 20.4 % ... Orca (Oracle) 38.2 %
    "token_states_vllm": 0.963,  # under 4 % waste
}


def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output-len-dist",
        default="uniform",
        choices=["uniform", "fixed", "eos"],
        help="when a request stops: after a length uniform in [1, its output len], at its output len, or at the model's EOS",
    )
    p.add_argument(
        "--kv-budget-fraction",
        type=float,
        default=0.25,
        help="without --num-kv-blocks / --kv-cache-memory: a pool holding this fraction of all requests' prompt + max_tokens",
    )
    p.add_argument("--no-static-run", action="store_true", help="skip the second run with max_num_seqs limited to what static reservation fits")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up request")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="PNG: tokens held / allocated / reserved and utilization per step")
    p.add_argument(
        "--window-context", type=int, default=None, help="sliding-window models: KV bytes per request at this context (default max_model_len)"
    )


def stop_lengths(requests: Sequence[SampleRequest], dist: str, seed: int) -> list[int]:
    """Each request's real output length (the engine's max_tokens for it)."""
    rng = random.Random(seed + 1)
    if dist == "uniform":
        return [rng.randint(1, r.expected_output_len) for r in requests]
    return [r.expected_output_len for r in requests]


def run_traced(
    engine, requests: Sequence[SampleRequest], lengths: Sequence[int], stop_at_eos: bool
) -> tuple[float, int, list[dict[str, Any]], list[str]]:
    """Submit every request, step until all finish, reading the trace after each step.

    Returns (elapsed seconds, output tokens, the run's step records, request ids in order).
    """
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams

    last = engine.get_step_trace()
    since = last[-1]["step"] + 1 if last else 0
    ids: list[str] = []
    records: list[dict[str, Any]] = []
    out_tokens = 0
    t0 = time.perf_counter()
    for r, n in zip(requests, lengths):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=not stop_at_eos, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        ids.append(engine.add_request(None, {"prompt_token_ids": r.prompt_token_ids}, sp))
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    out_tokens += len(out.outputs[0].token_ids)
            new = engine.get_step_trace(since)
            if new:
                if new[0]["step"] != since:
                    raise RuntimeError("the step trace overflowed between two reads")
                records += new
                since = new[-1]["step"] + 1
    except BaseException:
        engine.abort_request(ids)
        raise
    return time.perf_counter() - t0, out_tokens, records, ids


def per_step_memory(
    records: Sequence[dict[str, Any]], reservation: dict[str, int], block_size: int, max_model_len: int, window: Optional[int] = None
) -> list[dict[str, int]]:
    """For each step with a running request: tokens held, paged allocated, static reserved
    (prompt + max_tokens; max_model_len per request), running requests. ``window``: a pure
    sliding-window model's window (tokens), which caps each request's held tokens."""
    held: dict[str, int] = {}
    out = []
    for rec in records:
        for rid in rec["preempted"]:
            held.pop(rid, None)
        for e in rec["scheduled"]:
            rid = e["request_id"]
            if e["admitted"]:
                held[rid] = e["prefix_hit_tokens"]
            held[rid] = held.get(rid, 0) + e["num_tokens"]
        for f in rec["finished"]:
            held.pop(f["request_id"], None)
        if len(held) != rec["num_running"]:
            logger.warning("step %d: %d running requests in the trace, %d followed", rec["step"], rec["num_running"], len(held))
        if not held:
            continue
        out.append(
            {
                "step": rec["step"],
                "held": sum(held.values()) if window is None else sum(min(h, window) for h in held.values()),
                "paged": rec["num_used_blocks"] * block_size,
                "static": sum(reservation[rid] for rid in held),
                "static_max_len": len(held) * max_model_len,
                "running": len(held),
            }
        )
    return out


def _ratio(rows: Sequence[dict[str, int]], key: str) -> float:
    den = sum(r[key] for r in rows)
    return sum(r["held"] for r in rows) / den if den else 0.0


def static_fit(reservations: Sequence[int], pool_tokens: int) -> int:
    """How many requests' reservations fit in the pool at once, taken in arrival order (>= 1)."""
    total, k = 0, 0
    for r in reservations:
        if total + r > pool_tokens:
            break
        total += r
        k += 1
    return max(1, k)


def _plot(path: str, rows: Sequence[dict[str, int]], pool_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    a.plot(steps, [r["static"] for r in rows], label="static: prompt + max_tokens reserved", color="tab:red")
    a.plot(steps, [r["paged"] for r in rows], label="paged: blocks in use x block size", color="tab:blue")
    a.plot(steps, [r["held"] for r in rows], label="token states (computed tokens)", color="black", lw=1)
    a.axhline(pool_tokens, ls="--", color="gray", label="KV pool")
    a.set_ylabel("KV tokens")
    a.legend(fontsize=8)
    b.plot(steps, [r["held"] / r["paged"] if r["paged"] else 0 for r in rows], label="paged", color="tab:blue")
    b.plot(steps, [r["held"] / r["static"] for r in rows], label="static (prompt + max_tokens)", color="tab:red")
    b.axhspan(
        PAPER["token_states_existing_systems"][0],
        PAPER["token_states_existing_systems"][1],
        color="tab:red",
        alpha=0.15,
        label="paper: existing systems 20-38 %",
    )
    b.set_ylim(0, 1.05)
    b.set_ylabel("token states / KV memory")
    b.set_xlabel("engine step")
    b.legend(fontsize=8)
    fig.suptitle("KV memory holding token states: paged vs static reservation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"Plot written to {path}")


def sliding_window_report(hf_config, block_bytes: int, block_size: int, context: int, chunk: Optional[int]) -> Optional[dict[str, Any]]:
    """:func:`window_report` for the served model (``block_bytes``: K and V of one block, all
    layers; ``chunk``: the prefill chunk, None without chunked prefill), None without windows."""
    from pagedserve.model.registry import layer_windows

    windows = layer_windows(hf_config)
    if all(w is None for w in windows):
        return None
    num_decode = min(256, context - 1)
    per_token_layer = block_bytes // (block_size * len(windows))
    return window_report(windows, per_token_layer, context, block_size, chunk or context - num_decode, num_decode)


def cmd_memory(args: argparse.Namespace) -> int:
    apply_num_threads(args)
    model_dir, tok, hf_config = load_tokenizer_and_config(args.model)
    requests = build_requests(args, tok, args.seed)
    lengths = stop_lengths(requests, args.output_len_dist, args.seed)
    B = args.block_size
    reservations = [r.prompt_len + r.expected_output_len for r in requests]
    if args.num_kv_blocks is None and args.kv_cache_memory_bytes is None:
        if not 0.0 < args.kv_budget_fraction <= 1.0:
            raise ValueError(f"--kv-budget-fraction must be in (0, 1], got {args.kv_budget_fraction}")
        args.num_kv_blocks = max(math.ceil(max(reservations) / B), math.ceil(args.kv_budget_fraction * sum(reservations) / B))
    args.trace_buffer_steps = max(args.trace_buffer_steps, 1024)
    print(
        f"Workload: {args.dataset_name}: {describe(requests)}; each stops after {min(lengths)}-{max(lengths)} output tokens "
        f"({args.output_len_dist}; {sum(lengths)} in all); max_tokens sent = the output len"
    )

    engine = build_engine(args)
    pool_blocks = engine.core.info.num_blocks
    pool_tokens = pool_blocks * B
    max_len = engine.config.max_model_len
    window = sliding_window_report(
        hf_config,
        engine.core.info.block_bytes,
        B,
        args.window_context or max_len,
        engine.config.max_num_batched_tokens if engine.config.enable_chunked_prefill else None,
    )
    if not args.no_warmup:
        warm_up_engine(engine, requests)
    elapsed, out_tokens, records, ids = run_traced(engine, requests, lengths, args.output_len_dist == "eos")
    stats = engine.get_stats()
    from pagedserve.model.registry import sliding_window

    rows = per_step_memory(records, dict(zip(ids, reservations)), B, max_len, sliding_window(hf_config))
    paged_u, static_u, maxlen_u = _ratio(rows, "paged"), _ratio(rows, "static"), _ratio(rows, "static_max_len")
    max_paged = max((r["running"] for r in rows), default=0)
    mean_paged = sum(r["running"] for r in rows) / len(rows) if rows else 0.0
    max_static = static_fit(reservations, pool_tokens)
    max_static_len = max(1, pool_tokens // max_len)
    paged_tp = {
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "max_num_seqs": engine.config.max_num_seqs,
        "num_preemptions": stats.num_preemptions,
    }
    del engine
    gc.collect()
    static_tp: Optional[dict[str, Any]] = None
    if not args.no_static_run:
        args.max_num_seqs = min(max_static, paged_tp["max_num_seqs"])
        engine = build_engine(args)
        if not args.no_warmup:
            warm_up_engine(engine, requests)
        e2, t2, _, _ = run_traced(engine, requests, lengths, args.output_len_dist == "eos")
        static_tp = {"elapsed_s": e2, "output_tokens": t2, "output_tokens_per_s": t2 / e2, "max_num_seqs": args.max_num_seqs}
        del engine
        gc.collect()
    ratio = paged_tp["output_tokens_per_s"] / static_tp["output_tokens_per_s"] if static_tp else None

    print(f"KV pool: {pool_blocks} blocks x {B} tokens = {pool_tokens} tokens; max_model_len {max_len}; {len(rows)} steps with requests running")
    print("Share of KV memory holding token states (sum over steps of computed tokens of running requests / memory for them):")
    for label, u in (
        (f"paged (pagedserve, blocks of {B})", paged_u),
        ("static, prompt + max_tokens per request", static_u),
        (f"static, max_model_len ({max_len}) per request", maxlen_u),
    ):
        print(f"  {label:<46} {100 * u:5.1f} %" + (f"  (waste {100 * (1 - paged_u):.1f} %)" if u is paged_u else ""))
    print("  PagedAttention paper (Fig. 2): 20.4-38.2 % in the systems it measured (Orca Max / Pow2 / Oracle), vLLM 96.3 % (under 4 % waste)")
    print(
        f"Requests at once in the same pool: paged {max_paged} (measured, mean {mean_paged:.1f}, {stats.num_preemptions} preemptions); "
        f"static prompt + max_tokens {max_static}; static max_model_len slots {max_static_len}"
    )
    if static_tp:
        print(
            f"Throughput: paged {paged_tp['output_tokens_per_s']:.1f} output tok/s (max_num_seqs {paged_tp['max_num_seqs']}), "
            f"limited to the static batch {static_tp['output_tokens_per_s']:.1f} tok/s (max_num_seqs {static_tp['max_num_seqs']}): {ratio:.2f}x"
        )
    if window is not None:
        print(describe_report(window))
    if args.plot:
        _plot(args.plot, rows, pool_tokens)
    if args.output_json:
        write_json(
            args.output_json,
            {
                "command": "memory",
                "model": model_dir,
                "dataset": args.dataset_name,
                "num_prompts": len(requests),
                "output_len_dist": args.output_len_dist,
                "total_prompt_tokens": sum(r.prompt_len for r in requests),
                "total_max_tokens": sum(r.expected_output_len for r in requests),
                "total_output_tokens": out_tokens,
                "block_size": B,
                "num_kv_blocks": pool_blocks,
                "kv_pool_tokens": pool_tokens,
                "max_model_len": max_len,
                "steps": len(rows),
                "paged_utilization": paged_u,
                "static_utilization": static_u,
                "static_max_len_utilization": maxlen_u,
                "max_concurrent_paged": max_paged,
                "mean_concurrent_paged": mean_paged,
                "max_concurrent_static": max_static,
                "max_concurrent_static_max_len": max_static_len,
                "throughput": {"paged": paged_tp, "static": static_tp, "ratio_output_tokens_per_s": ratio},
                "paper": PAPER,
                "sliding_window": window,
                "seed": args.seed,
            },
        )
    return 0
