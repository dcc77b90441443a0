"""Prefill/decode disaggregation against colocated serving, on one machine (issue 11).

Two set-ups on the same cores, one after the other (never at the same time):
  colocated  one ``pagedserve serve`` (chunked prefill, default flags), ``--num-threads 2``
  1P1D       a prefill instance (``--kv-transfer-config '{"kv_role": "kv_producer", ...}'``,
             ``--num-threads 1``), a decode instance (``kv_consumer``, ``--num-threads 1``) and
             ``pagedserve proxy`` in front of them
Each gets ``pagedserve bench serve`` on the ``long-mix`` workload (a few long prompts among
streaming users) at each rate of ``--rates``, a fresh set of prompts per rate (the same sets for
both set-ups) so that no run hits the prefix cache of an earlier one. Printed: TTFT and ITL
(mean, p99) and output throughput of both, the 1P1D / colocated ratios, and the transfer
figures from the instances' /metrics (deltas over the measured runs):
``pagedserve:kv_transfer_sent_tokens_total`` (producer), ``..._received_tokens_total``
(consumer), the ``pagedserve:kv_transfer_time_seconds`` histogram (sum / count = mean transfer
time per request), KV bytes per token (2 x layers x kv_heads x head_dim x dtype bytes, from the
model's config.json and the instance's start-up line) and the proxy's prefill fallbacks.
What vLLM reports: disaggregation does not raise throughput; it takes prefills off the decode
instance, so decode ITL is flatter (p99 close to the mean) while TTFT pays for the transfer.

    python benchmarks/pd_disagg.py                           # SmolLM2, rates 0.5,1,2, 32 prompts
    python benchmarks/pd_disagg.py --quick                   # 3 short prompts, one rate
    python benchmarks/pd_disagg.py --tiny                    # smoke run: --quick on a tiny random model, float32
    python benchmarks/pd_disagg.py --only pd --serve-args "--dtype float32" --result-json pd.json

Every process it starts runs in its own process group and is stopped (SIGINT, then SIGKILL
after 15 s) on exit, failure, Ctrl-C or SIGTERM. Logs go to ``--log-dir`` (a temp dir). Appends
its figures to benchmarks/results/pd_disagg.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

CLI = [sys.executable, "-m", "pagedserve.entrypoints.cli"]
WARMUP = {"prompt": "Warm-up: say hello.", "max_tokens": 4, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Child processes, each in its own session; stop_all() ends them all in bounded time."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir, self.procs = log_dir, []

    def start(self, name: str, cmd: list[str], threads: int = 1, log: bool = True) -> subprocess.Popen:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        path = os.path.join(self.log_dir, f"{name}.log")
        out = open(path, "wb") if log else None
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log else None, env=env, start_new_session=True)
        if out:
            out.close()
        p.name, p.log = name, path
        self.procs.append(p)
        return p

    def tail(self, p: subprocess.Popen, n: int = 3000) -> str:
        try:
            with open(p.log, "rb") as fh:
                return fh.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop_all(self) -> None:
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}  # finish the clean-up (<= 15 s)
        try:
            self._stop_all()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # the whole group: whatever it started too (the engine core process)
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        self.procs = []


def wait_healthy(procs: Procs, watched: list, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in watched:
            if p.poll() is not None:
                raise SystemExit(f"{p.name} exited with {p.returncode}; its log ({p.log}):\n{procs.tail(p)}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not healthy after {timeout:.0f} s; logs in {procs.log_dir}")
        time.sleep(0.5)


def serve_cmd(args: argparse.Namespace, port: int, threads: int, kv: dict | None = None) -> list[str]:
    cmd = CLI + ["serve"] + ([args.model] if args.model else []) + ["--host", "127.0.0.1", "--port", str(port), "--num-threads", str(threads)]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd + shlex.split(args.serve_args)


def metrics(url: str) -> dict[str, float]:
    """pagedserve:* samples of /metrics, summed over label sets."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^(pagedserve:[A-Za-z0-9_]+)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def bench(procs: Procs, args: argparse.Namespace, url: str, label: str) -> list[dict]:
    """One ``pagedserve bench serve`` per rate (seed = rate index); its result JSONs."""
    runs = []
    for i, rate in enumerate(args.rate_list):
        name = f"{label}-rate{i}.json"
        cmd = CLI + ["bench", "serve", "--base-url", url, "--dataset-name", "long-mix", "--num-prompts", str(args.num_prompts),
                     "--long-input-len", str(args.long_input_len), "--num-long", str(args.num_long),
                     "--min-input-len", str(args.min_input_len), "--max-input-len", str(args.max_input_len),
                     "--output-len", str(args.output_len), "--request-rate", str(rate), "--seed", str(args.seed + i),
                     "--metric-percentiles", "50,99", "--skip-test-request", "--result-dir", procs.log_dir, "--result-filename", name]
        if args.model and os.path.exists(args.model):
            cmd += ["--tokenizer", args.model]
        print(f"\n--- {label}: rate {rate} req/s ---", flush=True)
        p = procs.start(f"bench-{label}-{i}", cmd, log=False)
        if p.wait() != 0:
            raise SystemExit(f"bench serve failed ({p.returncode}) against {label}")
        procs.procs.remove(p)
        with open(os.path.join(procs.log_dir, name)) as fh:
            runs.append(json.load(fh))
    return runs


def warm_up(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json=WARMUP, timeout=300)
    if r.status_code != 200:
        raise SystemExit(f"warm-up request to {url} failed: HTTP {r.status_code} {r.text[:300]}")


def run_colocated(args: argparse.Namespace, procs: Procs) -> dict:
    port = free_port()
    p = procs.start("colocated", serve_cmd(args, port, 2), threads=2)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(procs, [p], url, args.start_timeout)
        warm_up(url)
        return {"runs": bench(procs, args, url, "colocated"), "bytes_per_token_logged": logged_bytes_per_token(procs, p)}
    finally:
        procs.stop_all()


def run_pd(args: argparse.Namespace, procs: Procs) -> dict:
    pp, dp, xp = free_port(), free_port(), free_port()
    k1, k2 = args.kv_ports or (free_port(), free_port())
    pre = procs.start("prefill", serve_cmd(args, pp, 1, {"kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": k1}))
    dec = procs.start("decode", serve_cmd(args, dp, 1, {"kv_role": "kv_consumer", "kv_ip": "127.0.0.1", "kv_port": k2}))
    purl, durl, xurl = (f"http://127.0.0.1:{x}" for x in (pp, dp, xp))
    try:
        wait_healthy(procs, [pre], purl, args.start_timeout)
        wait_healthy(procs, [dec], durl, args.start_timeout)
        prox = procs.start("proxy", CLI + ["proxy", "--prefill", purl, "--decode", durl, "--port", str(xp)])
        wait_healthy(procs, [prox], xurl, 60)
        warm_up(xurl)
        before = {"prefill": metrics(purl), "decode": metrics(durl)}
        runs = bench(procs, args, xurl, "1P1D")
        after = {"prefill": metrics(purl), "decode": metrics(durl)}
        delta = {side: {k: v - before[side].get(k, 0.0) for k, v in after[side].items() if k.startswith("pagedserve:kv_transfer")} for side in after}
        proxy_state = httpx.get(xurl + "/health", timeout=10).json()
        return {"runs": runs, "transfer": delta, "proxy": {k: v for k, v in proxy_state.items() if isinstance(v, int)},
                "bytes_per_token_logged": logged_bytes_per_token(procs, dec)}
    finally:
        procs.stop_all()


def logged_bytes_per_token(procs: Procs, p: subprocess.Popen) -> int | None:
    m = re.search(r"\((\d+) bytes/token\)", procs.tail(p, 1 << 20))
    return int(m.group(1)) if m else None


def kv_layout(model: str | None) -> dict:
    """2 x layers x kv_heads x head_dim from the model's config.json (values per token)."""
    from pagedserve.model.loader import resolve_model

    with open(os.path.join(resolve_model(model), "config.json")) as fh:
        c = json.load(fh)
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return {"layers": c["num_hidden_layers"], "kv_heads": kv_heads, "head_dim": head_dim,
            "values_per_token": 2 * c["num_hidden_layers"] * kv_heads * head_dim}


def fmt_ratio(a: float, b: float) -> str:
    return f"x{a / b:.2f}" if b else "n/a"


def report(args: argparse.Namespace, res: dict) -> None:
    cols = [("TTFT mean", "mean_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("ITL mean", "mean_itl_ms"), ("ITL p99", "p99_itl_ms"),
            ("out tok/s", "output_throughput"), ("req/s", "request_throughput")]
    print("\n" + "=" * 100)
    print(f"{'rate':>6}  {'setup':<18}" + "".join(f"{c:>12}" for c, _ in cols) + f"{'failed':>8}")
    for i, rate in enumerate(args.rate_list):
        rows = {k: res[k]["runs"][i] for k in ("colocated", "pd") if k in res}
        for k, r in rows.items():
            print(f"{rate:>6g}  {('colocated' if k == 'colocated' else '1P1D + proxy'):<18}" + "".join(f"{r[key]:>12.1f}" for _, key in cols)
                  + f"{r['failed']:>8d}")
        if len(rows) == 2:
            print(f"{'':>6}  {'1P1D / colocated':<18}" + "".join(f"{fmt_ratio(rows['pd'][key], rows['colocated'][key]):>12}" for _, key in cols))
    print("(ms for TTFT and ITL)")
    if "pd" not in res:
        return
    pd, lay = res["pd"], res["layout"]
    t = pd["transfer"]
    sent = t["prefill"].get("pagedserve:kv_transfer_sent_tokens_total")
    recv = t["decode"].get("pagedserve:kv_transfer_received_tokens_total")
    logged = pd.get("bytes_per_token_logged")
    dtype_b = logged / lay["values_per_token"] if logged else None
    print(f"\nKV per token: 2 x {lay['layers']} layers x {lay['kv_heads']} kv heads x {lay['head_dim']} head_dim = {lay['values_per_token']} values"
          + (f" x {dtype_b:g} B = {logged} B (the decode instance's start-up line)" if logged else " (dtype bytes: not found in the log)"))
    def count(v: float | None) -> str:
        return f"{v:.0f}" if v is not None else "n/a (metric missing)"

    print(f"tokens sent (producer): {count(sent)};  received (consumer): {count(recv)}")
    for side in ("prefill", "decode"):
        s, n = t[side].get("pagedserve:kv_transfer_time_seconds_sum"), t[side].get("pagedserve:kv_transfer_time_seconds_count")
        if n:
            mb = (recv or 0) * (logged or 0) / 1e6
            print(f"transfer time ({side}): {n:.0f} transfers, mean {1e3 * s / n:.1f} ms" + (f", {mb:.1f} MB moved, {mb / s:.1f} MB/s" if mb and s else ""))
        elif s is None:
            print(f"transfer time ({side}): n/a (no pagedserve:kv_transfer_time_seconds)")
    x = pd["proxy"]
    print(f"proxy: {x.get('requests')} requests, {x.get('prefill_fallbacks')} prefill fallbacks (the decode instance computed the prompt), "
          f"{x.get('prefill_without_kv_params')} prefill answers without kv_transfer_params")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rates", default="0.5,1,2", help="comma-separated request rates (req/s; inf = all at once)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--num-long", type=int, default=None, help="long prompts per run (default num_prompts // 8, at least 1)")
    ap.add_argument("--long-input-len", type=int, default=2048)
    ap.add_argument("--min-input-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke size: 3 prompts (one long of 256 tokens), 8 output tokens, one rate")
    ap.add_argument("--only", choices=("colocated", "pd"), default=None, help="run one set-up")
    ap.add_argument("--serve-args", default="", help="extra flags for every pagedserve serve, e.g. \"--dtype float32\"")
    ap.add_argument("--kv-ports", default=None, help="producer,consumer KV ports (default: two free ports)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds an instance may take to answer /health")
    ap.add_argument("--log-dir", default=None, help="instance logs and bench JSONs (default: a temp dir)")
    ap.add_argument("--result-json", default=None, help="write everything measured here")
    ap.add_argument("--tiny", action="store_true", help="smoke run: --quick on a tiny random model in float32")
    args = ap.parse_args()
    if args.tiny:
        from pagedserve.bench.tiny import tiny_model_dir

        args.model = args.model or tiny_model_dir()
        args.quick = True
        args.serve_args = args.serve_args or "--dtype float32 --kv-cache-memory 32000000"
    if args.quick:
        args.num_prompts, args.long_input_len, args.min_input_len, args.max_input_len, args.output_len = 3, 256, 16, 32, 8
        args.rates = args.rates if args.rates != ap.get_default("rates") else "4"
    args.rate_list = [float(x) for x in args.rates.split(",") if x.strip()]
    args.num_long = args.num_long if args.num_long is not None else max(1, args.num_prompts // 8)
    args.kv_ports = tuple(int(x) for x in args.kv_ports.split(",")) if args.kv_ports else None
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="pd_disagg-")
    os.makedirs(args.log_dir, exist_ok=True)
    print(f"logs and bench JSONs in {args.log_dir}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally blocks
    procs = Procs(args.log_dir)
    res: dict = {"args": {k: v for k, v in vars(args).items()}, "layout": kv_layout(args.model)}
    try:
        if args.only in (None, "colocated"):
            res["colocated"] = run_colocated(args, procs)
        if args.only in (None, "pd"):
            res["pd"] = run_pd(args, procs)
    finally:
        procs.stop_all()
    report(args, res)
    if args.result_json:
        with open(args.result_json, "w") as fh:
            json.dump(res, fh, indent=2)
        print(f"results written to {args.result_json}")
    from pagedserve.bench.results import record

    record("pd_disagg", {k: v for k, v in res.items() if k != "args"}, tiny=args.tiny,
           extra={"model": args.model or "SmolLM2-135M-Instruct", "rates": args.rate_list, "num_prompts": args.num_prompts,
                  "serve_args": args.serve_args})
    return 0


if __name__ == "__main__":
    sys.exit(main())
