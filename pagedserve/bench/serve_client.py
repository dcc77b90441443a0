"""The client side of ``pagedserve bench serve``: one streamed request and its timings, Poisson
(or gamma) arrivals, and the metrics over a run (TTFT, TPOT, ITL, E2EL, goodput), named and
defined as ``vllm bench serve`` defines them (see :mod:`pagedserve.bench.serve`)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

import numpy as np

from pagedserve.bench.datasets import SampleRequest

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: Optional[int] = None
    generated_text: str = ""
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # e2el, seconds
    start_time: float = 0.0
    error: str = ""


# -- one request ---------------------------------------------------------------------------
def _payload(req: SampleRequest, model: str, endpoint: str, use_token_ids: bool, extra: dict) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.expected_output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt_token_ids if use_token_ids else req.prompt
    body.update(extra)
    return body


async def _sse_data(resp) -> AsyncIterator[str]:
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line or line.startswith(":"):
            continue
        if line.startswith("data:"):
            yield line[5:].strip()


async def send_request(client, url: str, headers: dict, body: dict, req: SampleRequest) -> RequestResult:
    out = RequestResult(prompt_len=req.prompt_len)
    chat = "messages" in body
    st = time.perf_counter()
    out.start_time = st
    recent = st  # last chunk that carried text
    first = False
    first_any: Optional[float] = None  # first / last chunk with choices, text or not
    last_any = st
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:500]}"
                return out
            async for chunk in _sse_data(resp):
                if chunk == "[DONE]":
                    break
                data = json.loads(chunk)
                if data.get("error"):
                    out.error = str(data["error"])[:500]
                    break
                choices = data.get("choices")
                if choices:
                    c0 = choices[0]
                    piece = (c0.get("delta") or {}).get("content") if chat else c0.get("text")
                    now = time.perf_counter()
                    last_any = now
                    if first_any is None:
                        first_any = now
                    # A chunk without text (a chat stream's opening role chunk, a final chunk
                    # holding only finish_reason) is not a token: TTFT and ITL skip it.
                    if piece:
                        if not first:
                            first = True
                            out.ttft = now - st
                        else:
                            out.itl.append(now - recent)
                        recent = now
                        text.append(piece)
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = int(usage["completion_tokens"])
        if not first and first_any is not None and not out.error:  # tokens that decode to no text
            first = True
            out.ttft = first_any - st
        out.generated_text = "".join(text)
        out.latency = last_any - st
        out.success = first and not out.error
        if not first and not out.error:
            out.error = "no tokens in the stream"
    except Exception as e:  # network errors count as failed requests, as in vLLM
        out.error = f"{type(e).__name__}: {e}"
    return out


# -- arrivals ------------------------------------------------------------------------------
async def arrivals(requests: Sequence[SampleRequest], rate: float, burstiness: float, rng: np.random.Generator) -> AsyncIterator[SampleRequest]:
    """Yield requests with gamma-distributed gaps (shape ``burstiness``, mean ``1/rate``)."""
    theta = 1.0 / (rate * burstiness) if math.isfinite(rate) else 0.0
    for req in requests:
        yield req
        if not math.isfinite(rate):
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


# -- metrics -------------------------------------------------------------------------------
def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.split():
            name, _, val = part.partition(":")
            if name not in ("ttft", "tpot", "e2el") or not val:
                raise ValueError(f"--goodput takes KEY:MS pairs with KEY in ttft, tpot, e2el; got {part!r}")
            ms = float(val)
            if ms < 0:
                raise ValueError(f"--goodput {name} must be >= 0 ms")
            slos[name] = ms
    return slos


def compute_metrics(
    requests: Sequence[SampleRequest],
    results: Sequence[RequestResult],
    duration: float,
    tokenizer,
    percentiles: Sequence[float],
    slos: dict[str, float],
) -> dict[str, Any]:
    out_lens, ttfts, tpots, e2els, itls = [], [], [], [], []
    all_tpots = []
    completed = good = 0
    total_in = 0
    for req, r in zip(requests, results):
        if not r.success:
            out_lens.append(0)
            continue
        n = r.output_tokens
        if n is None:
            n = len(tokenizer(r.generated_text, add_special_tokens=False)["input_ids"]) if tokenizer is not None else len(r.itl) + 1
        out_lens.append(n)
        total_in += req.prompt_len
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        completed += 1
        ok = (
            ("ttft" not in slos or r.ttft * 1000 <= slos["ttft"])
            and ("tpot" not in slos or tpot * 1000 <= slos["tpot"])
            and ("e2el" not in slos or r.latency * 1000 <= slos["e2el"])
        )
        good += int(ok)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_in,
        "total_output_tokens": sum(out_lens),
        "request_throughput": completed / duration,
        "request_goodput": (good / duration) if slos else None,
        "output_throughput": sum(out_lens) / duration,
        "total_token_throughput": (total_in + sum(out_lens)) / duration,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(vals or [0.0]) * 1000
        m[f"mean_{name}_ms"] = float(arr.mean())
        m[f"median_{name}_ms"] = float(np.median(arr))
        m[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            m[f"p{_pct_name(p)}_{name}_ms"] = float(np.percentile(arr, p))
    m["output_lens"] = out_lens
    m["input_lens"] = [r.prompt_len for r in requests]
    return m


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def print_metrics(m: dict[str, Any], rate: float, percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [
        ("Request rate (req/s):", "inf" if not math.isfinite(rate) else f"{rate:g}"),
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Benchmark duration (s):", f"{m['duration']:.2f}"),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
    ]
    if m["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{m['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<40}{v:>10}")
    for name in percentile_metrics:
        print("{s:{c}^{n}}".format(s=f" {METRIC_NAMES[name]} ", n=w, c="-"))
        print(f"{'Mean ' + name.upper() + ' (ms):':<40}{m[f'mean_{name}_ms']:>10.2f}")
        print(f"{'Median ' + name.upper() + ' (ms):':<40}{m[f'median_{name}_ms']:>10.2f}")
        for p in percentiles:
            print(f"{'P' + _pct_name(p) + ' ' + name.upper() + ' (ms):':<40}{m[f'p{_pct_name(p)}_{name}_ms']:>10.2f}")
    print("=" * w)


# -- a run at one rate ---------------------------------------------------------------------
