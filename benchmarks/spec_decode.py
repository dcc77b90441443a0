"""What n-gram speculative decoding (``--speculative-config``) gains and costs: the same requests
through an engine without drafts and one with them, in the same process, alternating, greedy,
and the outputs compared token for token.

Workloads:
* ``edit``: code editing, where the answer copies its input (chat prompts asking SmolLM2 to
  show a function from Python's standard library again with a comment added);
* ``w1``: W1's shape (text windows of 64-512 tokens, 128 output tokens), where it mostly does not;
* ``json``: extraction under a JSON schema (structured output): a contact card given as
  ``key: value`` lines, returned as a JSON object (``--workloads json``).

Each at batch 1 (one request at a time) and at ``--batch`` requests at once. Prints output
tokens per second, the ratio, the share of drafts kept and the tokens per verified decode.

    .venv/bin/python benchmarks/spec_decode.py [--k 4] [--rounds 2] [--requests 8] [--batch 8] [--threads 2]
        [--workloads edit,w1] [--disable-by-batch-size N] [--logprobs K] [--repetition-penalty R] [--frequency-penalty F]
    .venv/bin/python benchmarks/spec_decode.py --tiny     # smoke run: a tiny random model, every workload, seconds

Appends its figures to benchmarks/results/spec_decode.jsonl.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import time

from pagedserve import LLM, SamplingParams
from pagedserve.bench.results import record

EDIT_FUNCTIONS = ["textwrap.dedent", "shlex.quote", "shlex.join", "colorsys.hls_to_rgb", "textwrap.indent",
                  "heapq.nsmallest", "string.capwords", "json.dumps", "colorsys.rgb_to_hls", "base64.b64encode",
                  "html.escape", "glob.has_magic", "calendar.monthrange", "ipaddress.ip_address", "random.Random.choices",
                  "statistics.median"]


def edit_requests(n: int) -> list[list[dict]]:
    import importlib

    out = []
    for name in EDIT_FUNCTIONS[:n]:
        parts = name.split(".")
        obj = importlib.import_module(parts[0])
        for p in parts[1:]:
            obj = getattr(obj, p)
        src = inspect.getsource(obj)
        out.append([{"role": "user", "content": f"Show this function again, unchanged except for one comment line above it:\n\n```python\n{src}```"}])
    return out


JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "email": {"type": "string"},
                                               "phone": {"type": "string"}, "company": {"type": "string"}, "notes": {"type": "string"}},
               "required": ["name", "city", "email", "phone", "company", "notes"]}


def json_requests(n: int) -> list[list[dict]]:
    """Extraction: a contact card in prose and key: value lines, to be returned as JSON (the
    values are copied from the prompt)."""
    import random

    rng = random.Random(0)
    first = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "John", "Margaret", "Niklaus"]
    last = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Backus", "Hamilton", "Wirth"]
    cities = ["Lisbon", "Montreal", "Osaka", "Nairobi", "Valparaiso", "Tallinn", "Hobart", "Reykjavik"]
    out = []
    for i in range(n):
        name = f"{first[i % 10]} {last[(i * 3) % 10]}"
        card = {"name": name, "city": rng.choice(cities), "email": f"{name.split()[0].lower()}.{name.split()[1].lower()}@example.org",
                "phone": f"+1 555 {rng.randint(100, 999)} {rng.randint(1000, 9999)}", "company": f"{rng.choice(last)} Systems Ltd",
                "notes": "prefers email; available Tuesday and Thursday mornings; met at the spring conference"}
        lines = "\n".join(f"{k}: {v}" for k, v in card.items())
        out.append([{"role": "user", "content": f"Return this contact as a JSON object with the same keys and values:\n\n{lines}"}])
    return out


def run(llm: LLM, workload: str, requests, params, batch: int) -> tuple[float, list[list[int]]]:
    """(output tokens per second, the outputs) over ``requests``, ``batch`` at a time."""
    outs: list[list[int]] = []
    t = time.perf_counter()
    for i in range(0, len(requests), batch):
        part = requests[i: i + batch]
        ps = params[i: i + batch]
        res = llm.chat(part, ps, use_tqdm=False) if workload in ("edit", "json") else llm.generate(part, ps, use_tqdm=False)
        outs += [list(r.outputs[0].token_ids) for r in res]
    return sum(map(len, outs)) / (time.perf_counter() - t), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="edit,w1")
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--logprobs", type=int, default=None, help="logprobs of every request (top-k per token)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--tiny", action="store_true", help="smoke run: a tiny random model, 2 requests of 12 tokens per workload")
    args = ap.parse_args()
    out_len = {"edit": 384, "json": 256, "w1": 128}
    engine_kw: dict = {}
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.rounds, args.requests, args.batch = 1, 2, 2
        out_len = {k: 12 for k in out_len}
        engine_kw = {"kv_cache_memory_bytes": 32 << 20}
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min,
            "disable_by_batch_size": args.disable_by_batch_size}
    engines = {"no drafts": LLM(args.model, num_threads=args.threads, **engine_kw),
               "ngram": LLM(args.model, num_threads=args.threads, speculative_config=spec, **engine_kw)}
    figures = []
    extra = {"logprobs": args.logprobs, "repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty}
    print(f"speculative_config {spec}, {args.threads} threads, {args.rounds} rounds alternating, greedy with {extra}")
    for workload in args.workloads.split(","):
        if workload == "edit":
            requests = edit_requests(args.requests)
            params = [SamplingParams(temperature=0, max_tokens=out_len["edit"], **extra)] * len(requests)
        elif workload == "json":
            from pagedserve.sampling_params import StructuredOutputsParams

            requests = json_requests(args.requests)
            params = [SamplingParams(temperature=0, max_tokens=out_len["json"], structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA),
                                     **extra)] * len(requests)
        else:
            from pagedserve.bench.datasets import sample_random

            tok = engines["no drafts"].get_tokenizer()
            reqs = sample_random(tok, args.requests, (64, 512), (out_len["w1"], out_len["w1"]), seed=0)
            requests = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
            params = [SamplingParams(temperature=0, max_tokens=out_len["w1"], ignore_eos=True, **extra)] * len(requests)
        run(engines["ngram"], workload, requests[:1], params[:1], 1)  # warm-up
        run(engines["no drafts"], workload, requests[:1], params[:1], 1)
        for batch in (1, args.batch):
            rates: dict[str, list[float]] = {k: [] for k in engines}
            outputs = {}
            stats0 = engines["ngram"].llm_engine.get_stats()
            for rnd in range(args.rounds):
                order = list(engines) if rnd % 2 == 0 else list(reversed(engines))
                for name in order:
                    rate, outputs[name] = run(engines[name], workload, requests, params, batch)
                    rates[name].append(rate)
            st = engines["ngram"].llm_engine.get_stats()
            drafts = st.spec_decode_num_draft_tokens - stats0.spec_decode_num_draft_tokens
            kept = st.spec_decode_num_accepted_tokens - stats0.spec_decode_num_accepted_tokens
            steps = st.spec_decode_num_drafts - stats0.spec_decode_num_drafts
            base, ngram = (statistics.median(rates[k]) for k in engines)
            ratios = ", ".join(f"{b / a:.2f}x" for a, b in zip(rates["no drafts"], rates["ngram"]))
            print(f"{workload:5s} batch {batch:2d}: no drafts {base:6.1f} tok/s, ngram {ngram:6.1f} tok/s (per round: {ratios}); "
                  f"drafts kept {kept}/{drafts} ({kept / max(drafts, 1):.0%}), {(kept + steps) / max(steps, 1):.2f} tokens per "
                  f"verified decode; outputs identical: {outputs['no drafts'] == outputs['ngram']}")
            figures.append({"workload": workload, "batch": batch, "no_drafts_tok_s": base, "ngram_tok_s": ngram,
                            "ratios": [b / a for a, b in zip(rates["no drafts"], rates["ngram"])], "drafts": drafts, "kept": kept,
                            "verified_decodes": steps, "identical": outputs["no drafts"] == outputs["ngram"]})
    record("spec_decode", {"speculative_config": spec, "threads": args.threads, "rounds": args.rounds, "requests": args.requests,
                           "sampling": extra, "runs": figures}, tiny=args.tiny, extra={"model": args.model or "SmolLM2-135M-Instruct"})


if __name__ == "__main__":
    main()
