"""``pagedserve bench serve``: online benchmark against any OpenAI-compatible server.

Follows ``vllm bench serve``:
- Requests leave at a Poisson rate (``--request-rate``; ``inf`` sends all at once). With
  ``--burstiness`` the gaps are gamma distributed with shape = burstiness and mean 1/rate
  (1 = Poisson, < 1 burstier, > 1 more even). ``--max-concurrency`` caps requests in flight.
- Every request streams (``stream: true``, ``stream_options.include_usage``), with
  ``ignore_eos: true`` and ``max_tokens`` = the dataset's output length.
- TTFT: time to the first streamed chunk that carries text (a chat stream's opening role-only
  chunk is not a token). ITL: gaps between later text chunks. E2EL: time to the last chunk. TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one
  output token. Output tokens come from the final ``usage`` chunk (else the tokenized text).
- Goodput (``--goodput ttft:500 tpot:50``, milliseconds): completed requests per second that
  met every given SLO.

``--request-rates 1,2,4,inf`` sweeps rates one after another; ``--plot PNG`` draws latency
percentiles against the request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import time
from datetime import datetime
from typing import Any, Sequence

import numpy as np

from pagedserve.bench.datasets import SampleRequest, add_dataset_args, build_requests, describe
from pagedserve.bench.serve_client import (
    METRICS,
    RequestResult,
    _payload,
    _pct_name,
    arrivals,
    compute_metrics,
    parse_goodput,
    print_metrics,
    send_request,
)

try:  # httpx, or its successor httpx2 (what openai installs here); same API
    import httpx
except ImportError:  # pragma: no cover - depends on the environment
    import httpx2 as httpx  # type: ignore[no-redef]


async def run_one_rate(
    args: argparse.Namespace, requests: Sequence[SampleRequest], model: str, url: str, headers: dict, rate: float, tokenizer, seed: int
) -> tuple[dict[str, Any], list[RequestResult]]:
    limits = httpx.Limits(max_connections=args.max_concurrency or max(100, len(requests)), max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    extra = json.loads(args.extra_body) if args.extra_body else {}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def limited(req: SampleRequest) -> RequestResult:
            body = _payload(req, model, args.endpoint, args.send_token_ids, extra)
            if sem is None:
                return await send_request(client, url, headers, body, req)
            async with sem:
                return await send_request(client, url, headers, body, req)

        t0 = time.perf_counter()
        tasks = []
        async for req in arrivals(requests, rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    m = compute_metrics(requests, results, duration, tokenizer, args.percentiles, args.slos)
    return m, list(results)


async def _check_server(args, requests, model, url, headers) -> None:
    """One short request first, as vLLM does: fail fast with the server's own error."""
    req = requests[0]
    test = SampleRequest(req.prompt_token_ids, req.prompt, min(4, req.expected_output_len))
    extra = json.loads(args.extra_body) if args.extra_body else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30.0)) as client:
        deadline = time.monotonic() + args.ready_timeout
        while True:
            r = await send_request(client, url, headers, _payload(test, model, args.endpoint, args.send_token_ids, extra), test)
            if r.success:
                return
            if time.monotonic() >= deadline:
                raise SystemExit(f"test request to {url} failed: {r.error}")
            await asyncio.sleep(1.0)


def server_root(base_url: str) -> str:
    """The server's root from a base URL given with or without ``/v1`` (both are common)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def _discover_model(base_url: str, headers: dict) -> str:
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            r = await client.get(base_url + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            raise SystemExit(f"no server answers at {base_url} ({type(e).__name__}: {e}); start one with `pagedserve serve`") from None
        if r.status_code != 200:
            raise SystemExit(f"{base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
        data = r.json().get("data") or []
        if not data:
            raise SystemExit(f"{base_url}/v1/models lists no model; pass --model")
        return data[0]["id"]


def _serve_tokenizer(args: argparse.Namespace, model: str):
    from pagedserve.model import loader

    path = args.tokenizer
    if path is None and model and os.path.exists(os.path.expanduser(model)):
        path = model
    model_dir = loader.resolve_model(path)  # None: the default model's tokenizer
    return loader.load_tokenizer(model_dir)


def parse_rates(args: argparse.Namespace) -> list[float]:
    rates = [float(x) for x in args.request_rates.split(",") if x.strip()] if args.request_rates else [float(args.request_rate)]
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit(f"request rates must be > 0 (or inf), got {rates}")
    return rates


async def _serve_main(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    model = args.model or await _discover_model(args.base_url, headers)
    tok = _serve_tokenizer(args, model)
    requests = build_requests(args, tok, args.seed)
    url = args.base_url.rstrip("/") + "/" + args.endpoint.lstrip("/")
    print(f"Target: {url} (model {model!r}); workload {args.dataset_name}: {describe(requests)}")
    print(f"Burstiness {args.burstiness:g}{' (Poisson)' if args.burstiness == 1 else ''}, max concurrency {args.max_concurrency or 'unlimited'}")
    if not args.skip_test_request:
        await _check_server(args, requests, model, url, headers)
    runs = []
    for i, rate in enumerate(args.rates):
        m, results = await run_one_rate(args, requests, model, url, headers, rate, tok, args.seed + i)
        print_metrics(m, rate, args.percentile_metrics, args.percentiles)
        errors = [r.error for r in results if r.error]
        if errors:
            print(f"{len(errors)} failed requests; first error: {errors[0]}")
        run = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if args.endpoint.rstrip("/").endswith("chat/completions") else "openai",
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model_id": model,
            "dataset_name": args.dataset_name,
            "num_prompts": len(requests),
            "request_rate": rate if math.isfinite(rate) else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "goodput_slos_ms": args.slos or None,
            **m,
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "e2els": [r.latency for r in results],
            "errors": [r.error for r in results],
        }
        if args.save_detailed:
            run["generated_texts"] = [r.generated_text for r in results]
        runs.append(run)
    return {"runs": runs}


def plot_sweep(runs: Sequence[dict[str, Any]], path: str, percentiles: Sequence[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["request_rate"]) for r in runs]
    xs = list(range(len(runs)))
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.2))
    for ax, name in zip(axes, METRICS):
        ax.plot(xs, [r[f"median_{name}_ms"] for r in runs], "o-", label="median")
        ax.plot(xs, [r[f"mean_{name}_ms"] for r in runs], "s--", label="mean", alpha=0.7)
        for p in percentiles:
            key = f"p{_pct_name(p)}_{name}_ms"
            if key in runs[0] and _pct_name(p) != "50":
                ax.plot(xs, [r[key] for r in runs], "^-", label=f"p{_pct_name(p)}")
        ax.set_title(f"{name.upper()} (ms)")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    ax.plot(xs, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax.set_title("Output throughput (tok/s)")
    ax.set_xticks(xs, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)
    first = runs[0]
    fig.suptitle(
        f"{first['model_id']} - {first['dataset_name']}, {first['num_prompts']} prompts, burstiness {first['burstiness']}, max concurrency {first['max_concurrency'] or 'inf'}"
    )
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"Plot written to {path}")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for the dataset (default: --model if it is a path, else the default model's)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second, inf = all at once (default inf)")
    p.add_argument("--request-rates", default=None, help="comma-separated rates to sweep, e.g. 1,2,4,inf")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--send-token-ids", action="store_true", help="/v1/completions: send prompts as token ids, not text")
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics to report percentiles for")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--goodput", nargs="+", default=None, help="SLOs as KEY:MS pairs, KEY in ttft, tpot, e2el")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--ready-timeout", type=float, default=0.0, help="keep retrying the test request for this many seconds")
    p.add_argument("--skip-test-request", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true", help="write the results JSON")
    p.add_argument("--save-detailed", action="store_true", help="include generated texts in the JSON")
    p.add_argument("--result-dir", default=".", help="folder of the results JSON")
    p.add_argument("--result-filename", default=None, help="results JSON name (implies --save-result)")
    p.add_argument("--plot", default=None, help="PNG of latency percentiles vs request rate")
    add_dataset_args(p)


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import write_json

    for name in ("httpx", "httpx2", "httpcore"):  # one INFO line per request would bury the results
        logging.getLogger(name).setLevel(logging.WARNING)

    args.percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in args.percentile_metrics if m not in METRICS]
    if bad:
        raise SystemExit(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
    args.percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    try:
        args.slos = parse_goodput(args.goodput)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.burstiness <= 0:
        raise SystemExit("--burstiness must be > 0")
    args.rates = parse_rates(args)
    args.base_url = server_root(args.base_url)
    out = asyncio.run(_serve_main(args))
    runs = out["runs"]
    if args.save_result or args.result_filename:
        name = args.result_filename or f"pagedserve-bench-serve-{runs[0]['date']}.json"
        write_json(os.path.join(args.result_dir, name), runs[0] if len(runs) == 1 else out)
    if args.plot:
        plot_sweep(runs, args.plot, args.percentiles)
    return 0
