"""pagedserve vs llama.cpp on a mixture-of-experts model (issue 49's MoE benchmark): a random-weight
model with Qwen3-30B-A3B's layout scaled down, the same bf16 weights on both sides.

The model (model_type ``qwen3_moe``, transformers' ``Qwen3MoeForCausalLM``, HF's own init under a
fixed seed, built in bf16 by ``build_1b_model.build``): hidden 1,024, 24 layers, 16 query / 4 KV
heads of 64 (Qwen3-30B-A3B: hidden 2,048, 48 layers, 32 / 4 heads of 128, 128 experts, top 8), 32
experts per layer of intermediate 768, top-4 routing with ``norm_topk_prob``, q/k norms, an untied
LM head, rope_theta 1e6, SmolLM2's 49,152-token vocabulary and tokenizer (from pagedserve's default
model). 1.98 B parameters; 0.34 B active per token (attention, router, 4 of 32 experts, LM head;
the embedding row lookup not counted). Written to ~/.cache/pagedserve-bench/qwen3moe-2b-shapes/
(safetensors; about 4 GB, ~1-2 min and ~5 GB of RAM to build; reused when complete) and converted
there to ``model-bf16.gguf`` by llama.cpp's own converter (``llamacpp_setup.sh convert``).
pagedserve serves the safetensors folder (``--pagedserve-gguf``: the GGUF file), llama.cpp the GGUF.

Measurements, one process at a time, each engine on ``--threads`` threads (default 2), rounds
alternating which side goes first; before each run a quiet check (``gguf_vs_llamacpp.wait_quiet``:
waits for no build/test process and a low load) and, during it, the CPU time other processes used,
recorded, so that a figure taken on a busy machine says so:

    batch1  ``pagedserve bench latency --input-len 32 --output-len 128``'s decode tok/s ((n - 1) /
            the time after the first token) vs ``llama-bench -p 0 -n 128 -d 32`` (tg128 after the
            same 32-token context; llama.cpp's default weight repacking, ``--repack 0`` where that
            crashes). Target: pagedserve / llama-bench >= 1.0x.
    http    16 clients: 16 distinct 128-token prompts (token ids cut from real English text, seed
            0), 128 output tokens each, greedy, EOS ignored, non-streaming ``/v1/completions``,
            all in flight at once (``bench_procs.run_load``), after a warm-up at the same
            concurrency: ``pagedserve serve`` vs ``llama-server -np 16 --cont-batching``
            (``vs_llama_server.py``'s starters). Output tok/s = completion tokens / (last response
            - first send). Target: pagedserve / llama-server >= 1.5x.

    benchmarks/llamacpp_setup.sh build                   # llama-server, llama-bench (once)
    .venv/bin/python benchmarks/moe_vs_llamacpp.py [--threads 2] [--rounds 2] [--output-json F]
    .venv/bin/python benchmarks/moe_vs_llamacpp.py --tiny   # smoke run, ~2 min: 2 layers, 4 experts, hidden 128
    .venv/bin/python benchmarks/moe_vs_llamacpp.py --model-type qwen3   # dense stand-in, same attention

``--model-type qwen3`` builds a dense Qwen3 with the same attention and an MLP of intermediate
4 x 768 (the weights an MoE token touches), for checking the pipeline where pagedserve does not load
``qwen3_moe``; ``--skip-llamacpp`` / ``--skip-pagedserve`` measure one side. Prints a table and
appends one JSON line to benchmarks/results/moe_vs_llamacpp.jsonl (``--tiny``: only where
``$PAGEDSERVE_BENCH_RESULTS`` names a directory).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]  # this checkout's pagedserve, as its subprocesses run
from bench_procs import llama_server  # noqa: E402
from build_1b_model import _converter_unpacked, build, convert_gguf  # noqa: E402
from gguf_vs_llamacpp import OthersCpu, bench_latency, llama_bench, wait_quiet  # noqa: E402
from vs_llama_server import measure_http, pagedserve_server  # noqa: E402

BENCH_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-bench")
LLAMACPP_CACHE = os.environ.get("LLAMACPP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-llamacpp"))
ROPE_THETA = 1e6  # Qwen3-30B-A3B's

# Qwen3-30B-A3B's layout, scaled down (its own values in the module docstring).
MOE: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=768,
    intermediate_size=3072,  # the dense MLP of `mlp_only_layers` (none here), as 4 x 768
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    max_position_embeddings=8192,
    hidden_act="silu",
    initializer_range=0.02,
)
TINY_MOE = dict(
    MOE,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    intermediate_size=128,
)
_DENSE_DROP = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def model_spec(model_type: str, tiny: bool) -> tuple[str, str, dict, dict]:
    """(directory, transformers class, config fields, extra config.json keys) of the model to serve.
    The dense ``qwen3`` stand-in keeps the attention and takes intermediate = top-k x expert size."""
    shapes = TINY_MOE if tiny else MOE
    name = "qwen3moe-2b-shapes" if model_type == "qwen3_moe" else "qwen3-dense-moe-standin"
    out = os.path.join(BENCH_CACHE, name + ("-tiny" if tiny else ""))
    if model_type == "qwen3_moe":
        # transformers writes the expert count as num_local_experts; the hub's files (and readers
        # that follow them) say num_experts: write both.
        return out, "Qwen3MoeForCausalLM", shapes, {"num_experts": shapes["num_experts"]}
    dense = {k: v for k, v in shapes.items() if k not in _DENSE_DROP}
    dense["intermediate_size"] = shapes["num_experts_per_tok"] * shapes["moe_intermediate_size"]
    return out, "Qwen3ForCausalLM", dense, {}


def ensure_model(args: argparse.Namespace) -> tuple[str, Optional[str]]:
    """Build the model folder (and its bf16 GGUF unless llama.cpp is skipped) where missing."""
    out, arch, shapes, extra = model_spec(args.model_type, args.tiny)
    if not os.path.exists(os.path.join(out, ".complete")):
        os.makedirs(BENCH_CACHE, exist_ok=True)
        print(f"building {arch} into {out} (seed {args.seed})")
        build(out, args.seed, shapes, arch=arch, extra_json=extra, rope_theta=ROPE_THETA)
    return out, None if args.skip_llamacpp else convert_gguf(out)


def check_sides(args: argparse.Namespace) -> None:
    """Refuse a side that cannot run (pagedserve without this model_type, llama.cpp not built);
    ``--tiny`` skips it instead, saying why."""
    from pagedserve.model.file_headers import SUPPORTED_MODEL_TYPES

    why = {}
    if not args.skip_pagedserve and args.model_type not in SUPPORTED_MODEL_TYPES:
        why["skip_pagedserve"] = (
            f"this pagedserve does not load {args.model_type} (it loads {', '.join(SUPPORTED_MODEL_TYPES)})",
            "--skip-pagedserve measures llama.cpp alone, --model-type qwen3 runs the dense stand-in",
        )
    missing = [b for b in ("llama-server", "llama-bench") if not os.path.exists(os.path.join(args.llama_bin, b))]
    if not args.skip_llamacpp and (missing or not _converter_unpacked()):
        why["skip_llamacpp"] = (
            f"llama.cpp is not built ({', '.join(missing) or 'converter'} missing)",
            "benchmarks/llamacpp_setup.sh build, or --skip-llamacpp",
        )
    for flag, (what, hint) in why.items():
        if not args.tiny:
            raise SystemExit(f"{what}: {hint}")
        print(f"--tiny: {what}: that side is skipped")
        setattr(args, flag, True)
    if args.skip_llamacpp and args.skip_pagedserve:
        raise SystemExit("nothing to measure: neither pagedserve nor llama.cpp runs")
    if args.pagedserve_gguf and args.skip_llamacpp:
        raise SystemExit("--pagedserve-gguf needs the GGUF, which is made only where llama.cpp runs")


def param_counts(model_dir: str) -> dict[str, int]:
    """Exact parameter counts of the saved checkpoint (its safetensors headers): total, the
    token embedding, the LM head, the routed experts, and those active per token (everything
    but the embedding table and the unrouted experts: top-k of E)."""
    import math

    from pagedserve.model.file_headers import read_safetensors_header

    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = json.load(fh)
    specs: dict[str, Any] = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            specs.update(read_safetensors_header(os.path.join(model_dir, f)))
    n = {k: math.prod(s.shape) for k, s in specs.items()}
    experts = sum(v for k, v in n.items() if ".mlp.experts." in k)
    embed = n.get("model.embed_tokens.weight", 0)
    e = cfg.get("num_experts") or cfg.get("num_local_experts") or 1
    k = cfg.get("num_experts_per_tok") or 1
    total = sum(n.values())
    lm_head = n.get("lm_head.weight", embed)
    # A tied head is the embedding table itself: read once per token as the head.
    active = total - (embed if "lm_head.weight" in n else 0) - experts + experts * k // e
    return {"total": total, "active": active, "embedding": embed, "lm_head": lm_head, "routed_experts": experts, "num_experts": e, "top_k": k}


def _median(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def timed(label: str, fn: Callable[[], dict], args: argparse.Namespace) -> dict:
    """``fn()`` after the quiet check (not in --tiny), with the CPU others used meanwhile."""
    q = None if args.tiny else wait_quiet(label)
    with OthersCpu() as oc:
        r = fn()
    r.update(
        others_cores_during=oc.cores, loadavg_1min_before=None if q is None else q["loadavg_1min"], quiet=(q is None or q["quiet"]) and oc.cores < 0.3
    )
    return r


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import platform
    from pagedserve.bench.datasets import sample_random
    from pagedserve.model import loader

    t_start = time.time()
    host = f"{platform.cpu_model_name()} (class {platform.cpu_class()}, {len(os.sched_getaffinity(0))} usable cores)"
    print(f"host: {host}; {args.threads} threads per engine")
    model_dir, gguf = ensure_model(args)
    counts = param_counts(model_dir)
    experts = f", top {counts['top_k']} of {counts['num_experts']} experts" if counts["num_experts"] > 1 else ""
    print(
        f"model: {model_dir} ({args.model_type}): {counts['total']:,} parameters ({counts['total'] / 1e9:.3f} B), "
        f"{counts['active']:,} active per token ({counts['active'] / 1e9:.3f} B){experts}; embedding {counts['embedding']:,}, LM head {counts['lm_head']:,}, routed experts {counts['routed_experts']:,}"
    )
    ggf = gguf or ""  # "": llama.cpp skipped (its runners are then never called)
    ps_model = ggf if args.pagedserve_gguf else model_dir
    kind = "GGUF" if args.pagedserve_gguf else "safetensors"
    ps_what = "(skipped)" if args.skip_pagedserve else f"{ps_model} ({kind}, --dtype {args.dtype})"
    print(f"pagedserve serves {ps_what}; llama.cpp serves {gguf or '(skipped)'} (bf16)")
    tok = loader.load_tokenizer(model_dir)
    reqs = sample_random(tok, args.clients, (args.prompt_len, args.prompt_len), (args.output_len, args.output_len), args.seed)
    prompts = [r.prompt_token_ids for r in reqs]
    log_dir = tempfile.mkdtemp(prefix="moe_vs_llamacpp-")
    print(f"logs: {log_dir}")
    sides = [s for s, skip in (("pagedserve", args.skip_pagedserve), ("llama.cpp", args.skip_llamacpp)) if not skip]
    parts: dict[str, dict[str, Callable[[], dict]]] = {
        "batch1": {
            "pagedserve": lambda: bench_latency(ps_model, args, args.dtype, args.iters),
            "llama.cpp": lambda: llama_bench(ggf, args, args.iters),
        },
        "http": {
            "pagedserve": lambda: measure_http(pagedserve_server(args, ps_model, log_dir), prompts, args),
            "llama.cpp": lambda: measure_http(llama_server(args, ggf, log_dir), prompts, args),
        },
    }
    rate = {"batch1": "decode_tok_s", "http": "output_tokens_per_s"}
    res: dict[str, Any] = {p: {s: [] for s in sides} for p in parts}
    for i in range(args.rounds):
        order = sides if i % 2 == 0 else sides[::-1]
        for part in args.parts:
            for side in order:
                r = timed(f"{part} {side}", parts[part][side], args)
                res[part][side].append(r)
                busy = "" if r["quiet"] else f"  (BUSY: others used {r['others_cores_during']:.2f} cores)"
                print(f"round {i + 1} {part:6s} {side:10s} {r[rate[part]]:9.2f} tok/s{busy}")
                sys.stdout.flush()
    summary: dict[str, Any] = {}
    for part in args.parts:
        med = {s: _median([r[rate[part]] for r in res[part][s]]) for s in sides}
        a, b = med.get("pagedserve"), med.get("llama.cpp")
        ratio = a / b if a is not None and b else None
        summary[part] = {"median_tok_s": med, "ratio": ratio, "quiet": all(r["quiet"] for s in sides for r in res[part][s])}
    out = {
        "model_type": args.model_type,
        "model": model_dir,
        "gguf": gguf,
        "pagedserve_model": ps_model,
        "host": host,
        "threads": args.threads,
        "dtype": args.dtype,
        "params": counts,
        "rounds": args.rounds,
        "clients": args.clients,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "batch1_context": args.input_len,
        "summary": summary,
        "runs": res,
        "seconds": time.time() - t_start,
    }
    print_table(out)
    return out


TARGETS = {"batch1": 1.0, "http": 1.5}


def print_table(out: dict) -> None:
    labels = {
        "batch1": f"batch-1 decode, {out['output_len']} tokens after {out['batch1_context']} (llama-bench tg)",
        "http": f"{out['clients']} clients HTTP, {out['prompt_len']} in / {out['output_len']} out (llama-server)",
    }
    print(
        f"\n{out['host']}, {out['threads']} threads; {out['model_type']} {out['params']['total'] / 1e9:.2f} B "
        f"({out['params']['active'] / 1e9:.2f} B active), bf16; medians of {out['rounds']} round(s), output tok/s"
    )
    print(f"{'':58s} {'pagedserve':>11s} {'llama.cpp':>10s} {'ratio':>7s} {'target':>7s}")
    for part, s in out["summary"].items():
        med = s["median_tok_s"]

        def f(x: Optional[float]) -> str:
            return "-" if x is None else f"{x:.2f}"

        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        met = "" if s["ratio"] is None else ("  met" if s["ratio"] >= TARGETS[part] else "  NOT met")
        print(
            f"{labels[part]:58s} {f(med.get('pagedserve')):>11s} {f(med.get('llama.cpp')):>10s} {ratio:>7s} "
            f"{'>= ' + str(TARGETS[part]) + 'x':>7s}{met}{'' if s['quiet'] else '  (busy machine)'}"
        )


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every Server's stop()


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="smoke run: 2 layers, 4 experts (top 2), hidden 128; 4 clients, short sizes, 1 round")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine (default: %(default)s)")
    ap.add_argument("--skip-llamacpp", action="store_true", help="measure pagedserve alone (no GGUF is made)")
    ap.add_argument("--skip-pagedserve", action="store_true", help="measure llama.cpp alone")
    ap.add_argument("--model-type", choices=["qwen3_moe", "qwen3"], default="qwen3_moe", help="qwen3: the dense stand-in (see above)")
    ap.add_argument("--parts", default="batch1,http", help="which measurements (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, alternating which side goes first (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=3, help="batch-1 iterations per run (bench latency --num-iters, llama-bench -r)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients = requests = llama-server slots (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128, help="HTTP prompt tokens (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens each request makes, HTTP and batch 1 (default: %(default)s)")
    ap.add_argument("--input-len", type=int, default=32, help="batch-1 context before the decode (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="pagedserve's --dtype (default: %(default)s)")
    ap.add_argument("--pagedserve-gguf", action="store_true", help="pagedserve serves the GGUF file instead of the safetensors folder")
    ap.add_argument("--pagedserve-args", default="--kv-cache-memory 1000000000", help="extra flags of pagedserve serve (default: %(default)s)")
    ap.add_argument("--llama-server-args", default="", help="extra flags of llama-server (e.g. --no-repack)")
    ap.add_argument("--no-repack", action="store_true", help="llama-bench --repack 0 from the start")
    ap.add_argument("--llama-bin", default=os.path.join(LLAMACPP_CACHE, "bin"), help="folder of llama-server and llama-bench (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.rounds, args.iters, args.clients, args.prompt_len, args.output_len, args.input_len = 1, 1, 4, 32, 8, 16
        args.pagedserve_args = ""  # pagedserve_server gives --tiny runs a 32 MB KV pool
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not set(args.parts) <= {"batch1", "http"} or not args.parts:
        raise SystemExit("--parts: batch1 and/or http")
    args.llama_bin = os.path.expanduser(args.llama_bin)
    check_sides(args)
    # What the shared starters read: one slot per client, each fitting its prompt and output.
    args.concurrency, args.max_input_len, args.stream, args.quantization = args.clients, args.prompt_len, False, None
    out = run(args)
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(out, fh, indent=2)
        print(f"results: {args.output_json}")
    from pagedserve.bench.results import record

    path = record(
        "moe_vs_llamacpp",
        {k: v for k, v in out.items() if k not in ("model", "gguf", "pagedserve_model")},
        tiny=args.tiny,
        extra={"model": out["model"], "gguf": out["gguf"]},
    )
    if path:
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
