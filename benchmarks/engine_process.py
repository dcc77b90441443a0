"""HTTP throughput and latency of `pagedserve serve` from two source trees, interleaved.

Issue 10 moved the engine core into its own process (ZeroMQ + msgpack between the HTTP front
and the core). This script measures a server built from each source tree in alternation, in
the same minutes, on two workloads through `pagedserve bench serve`:

  W1 over HTTP   32 requests, prompts uniform in 64-512 tokens, 128 output tokens, all at once
  high rate      256 requests, prompts 32-96 tokens, 32 output tokens, Poisson at 64 req/s

    .venv/bin/python benchmarks/engine_process.py --tree new=. --tree base=/tmp/base [--rounds 3]
        [--server-args "--num-threads 1"]

Each tree is put first on PYTHONPATH (a `git worktree add /tmp/base <commit>` works as the old
tree). Extra flags for one tree: --tree 'new1t=.:--num-threads 1'. Prints output tok/s, mean and
p99 TTFT and ITL per run, and the median of each tree.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

WORKLOADS = {
    "w1-http": ["--num-prompts", "32", "--min-input-len", "64", "--max-input-len", "512", "--output-len", "128", "--request-rate", "inf"],
    "high-rate": ["--num-prompts", "256", "--min-input-len", "32", "--max-input-len", "96", "--output-len", "32", "--request-rate", "64"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tree: str, extra: list[str], port: int, log) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port), "--num-kv-blocks", "2048", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server from {tree} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server from {tree} did not start")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_workload(port: int, name: str, out_path: str) -> dict:
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           *WORKLOADS[name], "--seed", "0", "--result-filename", out_path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=os.path.abspath(".")))
    with open(out_path) as fh:
        r = json.load(fh)
    return {k: r[k] for k in ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "completed")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH[:server flags]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-args", default="", help="flags for every server")
    args = ap.parse_args()
    trees = []
    for spec in args.tree:
        name, rest = spec.split("=", 1)
        path, _, flags = rest.partition(":")
        trees.append((name, path, args.server_args.split() + flags.split()))
    results: dict = {(t[0], w): [] for t in trees for w in WORKLOADS}
    tmp = tempfile.mkdtemp(prefix="pagedserve-bench-")
    for rnd in range(args.rounds):
        for name, path, flags in trees:
            port = free_port()
            with open(os.path.join(tmp, f"{name}-{rnd}.log"), "wb") as log:
                proc = start_server(path, flags, port, log)
                try:
                    for w in WORKLOADS:
                        r = run_workload(port, w, os.path.join(tmp, f"{name}-{w}-{rnd}.json"))
                        results[(name, w)].append(r)
                        print(f"round {rnd} {name:8s} {w:9s} {r['output_throughput']:7.1f} tok/s  TTFT mean {r['mean_ttft_ms']:7.1f} "
                              f"p99 {r['p99_ttft_ms']:7.1f} ms  ITL mean {r['mean_itl_ms']:6.1f} p99 {r['p99_itl_ms']:6.1f} ms", flush=True)
                finally:
                    stop_server(proc)
    print("\nmedians")
    for w in WORKLOADS:
        for name, _, _ in trees:
            rs = results[(name, w)]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"{w:9s} {name:8s} {med['output_throughput']:7.1f} tok/s  TTFT mean {med['mean_ttft_ms']:7.1f} p99 {med['p99_ttft_ms']:7.1f} ms"
                  f"  ITL mean {med['mean_itl_ms']:6.1f} p99 {med['p99_itl_ms']:6.1f} ms")


if __name__ == "__main__":
    main()
