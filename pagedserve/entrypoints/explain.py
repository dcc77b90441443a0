"""``pagedserve explain SCENARIO``: run a small scripted scenario on the real engine and print
what the scheduler did, step by step, from the engine's step trace (``pagedserve.core.trace``).

Scenarios:
    chunked-prefill  ``--decoders`` requests are decoding when a ``--prompt-tokens`` prompt
                     arrives under a ``--token-budget``: each step runs one token per decoder and
                     a chunk of the prompt (design.md's worked example: 6, 12, 2).
    prefix-caching   two requests share a ``--prefix-tokens`` system prompt: the second one
                     reuses the first one's cached blocks.
    preemption       ``--num-requests`` requests grow in a pool too small for all of them: who
                     is preempted and when it is recomputed.

The script only adds requests and steps the engine; every number printed comes from the trace.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

SCENARIOS = ("chunked-prefill", "prefix-caching", "preemption")

# Plain English to cut prompts from (any text works: the scenarios only count tokens).
_TEXT = (
    "The scheduler decides every step which requests run and how many of their tokens it computes. "
    "Requests that are already running come first: a request that is decoding costs one token, and a "
    "request in the middle of its prompt takes what the token budget leaves. Then waiting requests are "
    "admitted in the order they arrived, each after its prefix-cache hit. When the key-value cache runs "
    "out of blocks, the request admitted last is preempted: its blocks are freed and it is computed "
    "again later from its tokens. A block holds sixteen tokens, and a full block is named by a hash of "
    "its tokens and of every token before it, so two requests that start with the same text share it. "
)


@dataclass
class Explanation:
    """One scenario's run.

    Attributes:
        scenario: its name.
        records: the engine's step records of the scenario (``pagedserve.core.trace``).
        labels: request id -> what it is ("12-token prompt", ...), in column order.
        notes: summary lines, each computed from ``records``.
        block_size: tokens per block of the engine.
    """

    scenario: str
    records: list[dict[str, Any]]
    labels: dict[str, str]
    notes: list[str] = field(default_factory=list)
    block_size: int = 16


def _prompt(tokenizer, n: int, offset: int) -> list[int]:
    ids = tokenizer(_TEXT, add_special_tokens=False)["input_ids"]
    out = []
    while len(out) < n:
        out.extend(ids[(offset + len(out)) % len(ids) :])
    return out[:n]


def _params(max_tokens: int):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run(engine, until: Callable[[], bool], max_steps: int = 10_000) -> set[str]:
    """Step until ``until()``; returns the ids that got any output."""
    seen: set[str] = set()
    for _ in range(max_steps):
        if until() or not engine.has_unfinished_requests():
            return seen
        seen.update(o.request_id for o in engine.step())
    raise RuntimeError("the scenario did not finish")


def _entry(rec: dict[str, Any], rid: str) -> Optional[dict[str, Any]]:
    return next((e for e in rec["scheduled"] if e["request_id"] == rid), None)


def chunked_prefill(make_engine, token_budget: int = 6, prompt_tokens: int = 12, decoders: int = 2) -> Explanation:
    if decoders < 0 or prompt_tokens < 1 or token_budget <= decoders:
        raise ValueError(f"need --token-budget ({token_budget}) > --decoders ({decoders}) and --prompt-tokens >= 1")
    eng = make_engine(max_num_batched_tokens=token_budget, max_num_seqs=decoders + 1)
    chunk = token_budget - decoders
    keep_going = 2 * token_budget + prompt_tokens // chunk + 8  # the decoders outlive the scenario (then aborted)
    dec_ids = [f"decoder-{i}" for i in range(decoders)]
    for i, rid in enumerate(dec_ids):
        eng.add_request(rid, {"prompt_token_ids": _prompt(eng.tokenizer, 3, 40 * i + 7)}, _params(keep_going))
    started: set[str] = set()
    while not set(dec_ids) <= started:  # the decoders' prompts first: they must be decoding
        started |= {o.request_id for o in eng.step()}
    arrival = eng.get_step_trace()[-1]["step"] + 1
    eng.add_request("long", {"prompt_token_ids": _prompt(eng.tokenizer, prompt_tokens, 400)}, _params(2))
    _run(eng, lambda: "long" not in eng.core.scheduler.requests)
    eng.abort_request(dec_ids)
    recs = eng.get_step_trace()
    labels = {"long": f"{prompt_tokens}-token prompt", **{rid: "decoding" for rid in dec_ids}}
    ex = Explanation("chunked-prefill", recs, labels, block_size=eng.config.block_size)
    after = [r for r in recs if r["step"] >= arrival]
    chunks = [(r["step"], e["num_tokens"]) for r in after for e in [_entry(r, "long")] if e and e["phase"] == "prefill"]
    stalled = [r["step"] for r in after if any(_entry(r, d) is None for d in dec_ids) and _entry(r, "long") is not None]
    ex.notes.append(f"The {prompt_tokens}-token prompt arrived before step {arrival}; steps before it prefill the decoders' 3-token prompts.")
    ex.notes.append(
        f"Its prefill ran in {len(chunks)} chunks of {', '.join(str(n) for _, n in chunks)} tokens (steps {chunks[0][0]}-{chunks[-1][0]}), "
        f"beside one token for each of the {decoders} decoders; its first token came at step {chunks[-1][0]}."
    )
    ex.notes.append("Every decoder got its token in every step." if not stalled else f"Decoders stalled in steps {stalled}.")
    return ex


def prefix_caching(make_engine, prefix_tokens: int = 64, suffix_tokens: int = 8, max_tokens: int = 4) -> Explanation:
    eng = make_engine()
    B = eng.config.block_size
    system = _prompt(eng.tokenizer, prefix_tokens, 0)
    for i, rid in enumerate(("first", "second")):
        eng.add_request(rid, {"prompt_token_ids": system + _prompt(eng.tokenizer, suffix_tokens, 200 + 50 * i)}, _params(max_tokens))
        _run(eng, lambda: False)
    recs = eng.get_step_trace()
    n = prefix_tokens + suffix_tokens
    ex = Explanation(
        "prefix-caching",
        recs,
        {"first": f"{prefix_tokens} shared + {suffix_tokens}", "second": f"{prefix_tokens} shared + {suffix_tokens}"},
        block_size=B,
    )
    for rid in ("first", "second"):
        rec = next(r for r in recs if (e := _entry(r, rid)) is not None and e["admitted"])
        e = _entry(rec, rid)
        hit = e["prefix_hit_tokens"]
        ex.notes.append(
            f"{rid}: admitted at step {rec['step']} with a prefix hit of {hit} tokens ({hit // B} blocks of {B}) of its {n}-token prompt; "
            f"it computed {n - hit} prompt tokens. Cached-evictable blocks in the pool before: "
            f"{recs[recs.index(rec) - 1]['num_cached_free_blocks'] if recs.index(rec) else 0}."
        )
    ex.notes.append(f"Only full blocks are shared: {prefix_tokens} shared tokens make {prefix_tokens // B} full blocks of {B}.")
    return ex


def preemption(
    make_engine, num_requests: int = 3, prompt_tokens: int = 20, max_tokens: int = 40, num_kv_blocks: Optional[int] = None, block_size: int = 16
) -> Explanation:
    per_request = -(-(prompt_tokens + max_tokens) // block_size)
    blocks = num_kv_blocks or max(per_request, (num_requests * per_request) // 2)
    eng = make_engine(num_kv_blocks=blocks, max_model_len=blocks * block_size)
    ids = [f"r{i}" for i in range(num_requests)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, {"prompt_token_ids": _prompt(eng.tokenizer, prompt_tokens, 31 * i)}, _params(max_tokens))
    _run(eng, lambda: False)
    recs = eng.get_step_trace()
    ex = Explanation("preemption", recs, {rid: f"{prompt_tokens}+{max_tokens} tokens" for rid in ids}, block_size=eng.config.block_size)
    ex.notes.append(
        f"Pool: {blocks} blocks of {block_size} tokens; each request needs up to {per_request} blocks, all {num_requests} together {num_requests * per_request}."
    )
    computed: dict[str, int] = {}  # tokens in the cache per request, followed through the trace
    preempted: set[str] = set()
    recomputed = 0
    for r in recs:
        for rid in r["preempted"]:
            preempted.add(rid)
            ex.notes.append(f"step {r['step']}: {rid} preempted with {computed.pop(rid, 0)} tokens in the cache (its blocks freed, back to waiting).")
        for e in r["scheduled"]:
            rid = e["request_id"]
            if e["admitted"]:
                computed[rid] = e["prefix_hit_tokens"]
                if rid in preempted:
                    preempted.discard(rid)
                    recomputed += e["num_tokens"]
                    ex.notes.append(
                        f"step {r['step']}: {rid} resumed: {e['prefix_hit_tokens']} tokens from the prefix cache, "
                        f"{e['num_tokens']} recomputed ({e['phase']})."
                    )
            computed[rid] = computed.get(rid, 0) + e["num_tokens"]
    n = sum(len(r["preempted"]) for r in recs)
    ex.notes.append(
        f"{n} preemptions, {recomputed} tokens recomputed; every request finished: "
        f"{sorted(f['request_id'] for r in recs for f in r['finished']) == sorted(ids)}."
    )
    return ex


# -- output --------------------------------------------------------------------------------
def _cell(rec: dict[str, Any], rid: str) -> str:
    parts = []
    e = _entry(rec, rid)
    if e is not None:
        s = f"{e['phase']} {e['num_tokens']}"
        if e["admitted"] and e["prefix_hit_tokens"]:
            s += f" (+{e['prefix_hit_tokens']} hit)"
        parts.append(s)
    if rid in rec["preempted"]:
        parts.append("PREEMPTED")
    for f in rec["finished"]:
        if f["request_id"] == rid:
            parts.append(f"done ({f['finish_reason']})")
    return ", ".join(parts) or "-"


def _quiet(rec: dict[str, Any]) -> bool:
    return not rec["preempted"] and not rec["finished"] and all(e["phase"] == "decode" and not e["admitted"] for e in rec["scheduled"])


def format_table(ex: Explanation) -> str:
    """The step table (runs of plain decode steps with the same requests folded into one row)
    and the notes."""
    ids = list(ex.labels)
    head = ["step"] + [f"{rid} ({ex.labels[rid]})" for rid in ids] + ["tokens/budget", "run/wait", "blocks used/free/cached"]
    rows: list[list[str]] = []
    i = 0
    recs = ex.records
    while i < len(recs):
        j = i
        if _quiet(recs[i]):
            while j + 1 < len(recs) and _quiet(recs[j + 1]) and [_cell(recs[j + 1], r) for r in ids] == [_cell(recs[i], r) for r in ids]:
                j += 1
        r = recs[j]
        step = str(recs[i]["step"]) if i == j else f"{recs[i]['step']}-{r['step']}"
        rows.append(
            [step]
            + [_cell(r, rid) for rid in ids]
            + [
                f"{r['num_scheduled_tokens']}/{r['token_budget']}",
                f"{r['num_running']}/{r['num_waiting']}",
                f"{r['num_used_blocks']}/{r['num_free_blocks']}/{r['num_cached_free_blocks']}",
            ]
        )
        i = j + 1
    widths = [max(len(x[k]) for x in [head] + rows) for k in range(len(head))]
    lines = [f"pagedserve explain {ex.scenario} (block size {ex.block_size}; every number is from the engine's step trace)", ""]
    for row in [head] + rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    lines.append("")
    lines += ex.notes
    return "\n".join(lines)


def explain(scenario: str, engine_kwargs: Optional[dict[str, Any]] = None, **params: Any) -> Explanation:
    """Run ``scenario`` (one of :data:`SCENARIOS`) on a fresh engine built from ``engine_kwargs``
    (fields of :class:`pagedserve.config.EngineConfig`; the scenario sets the token budget or
    the pool where it needs to) with the scenario's ``params``.

    Raises:
        ValueError: unknown scenario or parameters that cannot show it.
    """
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    base = dict(engine_kwargs or {})
    base["trace_buffer_steps"] = max(base.get("trace_buffer_steps") or 0, 100_000)

    def make_engine(**overrides: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(**{**base, **overrides}))

    if scenario == "chunked-prefill":
        return chunked_prefill(make_engine, **params)
    if scenario == "prefix-caching":
        return prefix_caching(make_engine, **params)
    if scenario == "preemption":
        return preemption(make_engine, block_size=base.get("block_size", 16), **params)
    raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")


_PARAMS = {
    "chunked-prefill": ("token_budget", "prompt_tokens", "decoders"),
    "prefix-caching": ("prefix_tokens", "suffix_tokens", "max_tokens"),
    "preemption": ("num_requests", "prompt_tokens", "max_tokens", "num_kv_blocks"),
}


def add_explain_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("explain", help="run a small scenario and print what the scheduler did, step by step")
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument("--json", action="store_true", help="print one JSON object per step (the engine's trace records)")
    g = p.add_argument_group("scenario")
    g.add_argument("--token-budget", type=int, default=None, help="chunked-prefill: tokens per step (default 6)")
    g.add_argument("--prompt-tokens", type=int, default=None, help="the long prompt (chunked-prefill, 12) or each prompt (preemption, 20)")
    g.add_argument("--decoders", type=int, default=None, help="chunked-prefill: requests decoding when the prompt arrives (default 2)")
    g.add_argument("--prefix-tokens", type=int, default=None, help="prefix-caching: shared system prompt (default 64)")
    g.add_argument("--suffix-tokens", type=int, default=None, help="prefix-caching: each request's own tokens (default 8)")
    g.add_argument("--num-requests", type=int, default=None, help="preemption: requests (default 3)")
    g.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (prefix-caching 4, preemption 40)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="preemption: pool size (default: half of what all requests need)")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--device", default="auto")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-threads", type=int, default=None)
    e.add_argument("--trace-file", default=None, help="also write the trace as JSON lines")
    p.set_defaults(func=cmd_explain)
    return p


def cmd_explain(args: argparse.Namespace) -> int:
    engine_kwargs = dict(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size, num_threads=args.num_threads, trace_file=args.trace_file
    )
    params = {k: getattr(args, k) for k in _PARAMS[args.scenario] if getattr(args, k) is not None}
    ex = explain(args.scenario, engine_kwargs, **params)
    if args.json:
        for rec in ex.records:
            print(json.dumps(rec))
    else:
        print(format_table(ex))
    return 0
