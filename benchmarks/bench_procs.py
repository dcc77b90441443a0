"""Helpers of benchmarks/vs_llama_server.py: a server child process started and stopped in
bounded time, one closed-loop HTTP load client shared by every OpenAI-compatible server, the
llama.cpp commands, and a probe of the host's speed.

The client sends every request of a run to ``/v1/completions`` (non-streaming by default: the
servers' per-token streaming cost stays out of a throughput figure), at most ``concurrency`` in
flight, and times the run from the first send to the last response. Each response's
``usage.completion_tokens`` must equal the tokens asked for (EOS is ignored), else the run
fails: a short answer would inflate nothing but would make the two servers' work differ.
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import httpx

Prompt = Union[str, list[int]]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process in its own session (so its children, e.g. pagedserve's engine core,
    are stopped with it); use as a context manager: it is stopped on exit whatever happened."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: str, env: Optional[dict] = None, cwd: Optional[str] = None) -> None:
        self.name, self.cmd, self.port, self.env, self.cwd = name, cmd, port, env, cwd
        self.url = f"http://127.0.0.1:{port}"
        self.log = os.path.join(log_dir, f"{name}-{port}.log")
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Server":
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.log, "rb") as fh:
                return fh.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        """Until ``/health`` answers 200 (llama-server answers 503 while it loads).

        Raises:
            RuntimeError: the process exited, or ``timeout`` seconds passed.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"{self.name} exited with {code}; its log ({self.log}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; its log ({self.log}):\n{self.tail()}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM, up to ``grace_s`` to exit, then SIGKILL to the process group it leads.

        Raises:
            KeyboardInterrupt: SIGINT or SIGTERM arrived meanwhile (after the clean-up).
        """
        p = self.proc
        if p is None:
            return
        interrupted: list[int] = []  # an interrupt during the clean-up is raised after it

        def defer(signum: int, _frame: Any) -> None:
            interrupted.append(signum)

        old = {s: signal.signal(s, defer) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                    p.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
            try:  # the group it leads: whatever it started too
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.proc = None
        if interrupted:
            raise KeyboardInterrupt(f"signal {interrupted[0]} while stopping {self.name}")


def model_name(url: str) -> str:
    """The first id of ``/v1/models`` (pagedserve checks the request's model; llama-server does not)."""
    data = httpx.get(url + "/v1/models", timeout=30).json()
    return data["data"][0]["id"]


@dataclass
class LoadResult:
    """One closed-loop run: wall time from the first send to the last response, and usage."""

    elapsed_s: float
    prompt_tokens: list[int] = field(default_factory=list)  # per request, as the server counted them
    completion_tokens: list[int] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return sum(self.completion_tokens) / self.elapsed_s

    def as_dict(self) -> dict:
        return {
            "elapsed_s": self.elapsed_s,
            "num_requests": len(self.completion_tokens),
            "total_prompt_tokens": sum(self.prompt_tokens),
            "total_completion_tokens": sum(self.completion_tokens),
            "output_tokens_per_s": self.output_tokens_per_s,
            "prompt_tokens": self.prompt_tokens,
            "latencies_s": self.latencies_s,
        }


def completion_body(model: str, prompt: Prompt, max_tokens: int, stream: bool = False) -> dict:
    """Greedy, EOS ignored, exactly ``max_tokens`` tokens: the keys both servers read
    (llama-server maps ``max_tokens`` to ``n_predict`` and reads ``ignore_eos`` too)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _streamed(client: httpx.AsyncClient, url: str, body: dict, i: int) -> dict:
    """A streamed completion folded into the non-streamed shape: the last ``usage`` and
    ``finish_reason`` the stream carried."""
    usage, finish = None, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            line = line.strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            data = json.loads(line[5:])
            usage = data.get("usage") or usage
            for c in data.get("choices") or []:
                finish = c.get("finish_reason") or finish
    return {"usage": usage, "choices": [{"finish_reason": finish}]}


async def _run(url: str, model: str, prompts: Sequence[Prompt], max_tokens: int, concurrency: int, timeout_s: float, stream: bool) -> LoadResult:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:

        async def one(i: int, prompt: Prompt) -> tuple[float, float, dict]:
            body = completion_body(model, prompt, max_tokens, stream)
            async with sem:
                t0 = time.perf_counter()
                if stream:
                    data = await _streamed(client, url + "/v1/completions", body, i)
                else:
                    r = await client.post(url + "/v1/completions", json=body)
                    if r.status_code != 200:
                        raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.text[:500]}")
                    data = r.json()
                t1 = time.perf_counter()
            return t0, t1, data

        done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    res = LoadResult(elapsed_s=max(t1 for _, t1, _ in done) - min(t0 for t0, _, _ in done))
    for i, (t0, t1, data) in enumerate(done):
        usage = data.get("usage") or {}
        n = usage.get("completion_tokens")
        if n != max_tokens:
            raise RuntimeError(f"request {i}: {n} completion tokens, asked for {max_tokens} (usage {usage}, finish_reason {data['choices'][0].get('finish_reason')!r})")
        res.prompt_tokens.append(int(usage.get("prompt_tokens", 0)))
        res.completion_tokens.append(n)
        res.latencies_s.append(t1 - t0)
    return res


def run_load(url: str, model: str, prompts: Sequence[Prompt], max_tokens: int, concurrency: int, timeout_s: float = 3600.0,
             stream: bool = False) -> LoadResult:
    """Send ``prompts`` to ``url``'s ``/v1/completions``, ``concurrency`` at a time (streamed
    with ``stream_options.include_usage`` if ``stream``).

    Raises:
        RuntimeError: a request failed or did not return exactly ``max_tokens`` tokens.
    """
    if concurrency < 1 or not prompts:
        raise ValueError("need at least one prompt and a concurrency of at least 1")
    return asyncio.run(_run(url, model, prompts, max_tokens, concurrency, timeout_s, stream))


# -- llama.cpp's side ----------------------------------------------------------------------
def llama_server(args: Any, gguf: str, log_dir: str) -> Server:
    """llama-server on ``gguf`` with ``args``' threads and one slot per client (not started)."""
    port = free_port()
    # Every slot fits the longest request; llama.cpp pads a slot's context to a multiple of 256.
    per_slot = -(-(args.max_input_len + args.output_len + 64) // 256) * 256
    ctx = args.concurrency * per_slot
    cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.concurrency), "-c", str(ctx),
           "--cont-batching", "--no-webui"] + shlex.split(args.llama_server_args)
    return Server("llama-server", cmd, port, log_dir, cwd=ROOT)


def llama_bench(args: Any, gguf: str) -> dict:
    """llama-bench pp / tg tok/s of ``gguf`` at ``args``' batch-1 sizes."""
    cmd = [os.path.join(args.llama_bin, "llama-bench"), "-m", gguf, "-p", str(args.batch1_input_len), "-n", str(args.output_len),
           "-t", str(args.threads), "-r", str(args.iters), "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rows = json.loads(p.stdout)
    by = {("pp" if int(r["n_prompt"]) else "tg"): float(r["avg_ts"]) for r in rows}
    return {"pp_tok_s": by["pp"], "tg_tok_s": by["tg"], "rows": rows}


def cpu_probe_gflops(seconds: float = 1.0, size: int = 256) -> float:
    """The host's speed now: the median GFLOP/s of repeated ``size`` x ``size`` float32 matmuls
    on torch's threads over about ``seconds``. A median, not a best, so that a slow spell shows:
    figures measured next to each other are comparable only when their probes agree."""
    import statistics

    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    flop = 2.0 * size ** 3
    rates = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 5:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        rates.append(4 * flop / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)
