"""Speed and memory of a quantized GGUF file served as it is (issue 48): pagedserve and llama.cpp
on the same file, in interleaved rounds, one process at a time.

Parts (``--parts``, in this order; each prints the host's CPU and whether it was quiet):

    host    the CPU class (``pagedserve.platform.cpu_class``) and lscpu's model name; the memory
            read bandwidth (``pagedserve.ops.cpu.memory_read_bandwidth``, the probe behind
            ``bench latency``'s decode ceiling) and ``compute_ceiling.py``'s FMA peak.
    decode  batch-1 decode after a 512-token prompt on ``--model`` (SmolLM2 Q4_1): ``pagedserve
            bench latency --model FILE --input-len 512 --output-len 128`` against ``llama-bench
            -m FILE -p 0 -n 128 -d 512 -t 2`` (llama.cpp's default weight repacking; where that
            crashes, again with ``--repack 0``, recorded), alternating which goes first; the
            decode ceiling = bandwidth / the weight bytes a token reads (the file's tensor data;
            an untied model's token embedding table excluded) and each engine's share of it.
    rss     peak RSS (VmHWM), loading included: pagedserve's engine (``LLM(FILE, num_kv_blocks=64,
            block_size=16)``, a 1,024-token KV pool, offline: the engine core and its front in one
            process, one short request run) in a fresh process, the same with ``quantization="none"``,
            ``python -c "import torch"``, and llama-server (``-c 1024 -np 1``, after one request).
            Target: bare torch + 1.2 x the file's size + 150 MB.
    http    W1 over HTTP: ``vs_llama_server.py --scenario w1-http --model FILE --gguf FILE``, 32
            clients (both servers on the same quantized file; ``--no-offline``).
    1b      the random 1.1B model (``build_1b_model.py --gguf --quantize Q4_K_M,Q8_0``): batch-1
            decode of its Q4_K_M and Q8_0 files and of its HF dir in bfloat16 through pagedserve,
            and llama-bench on Q4_K_M, alternating; target Q4_K_M >= 2x bf16 decode. Then
            ``vs_llama_server.py --scenario 1b`` on the Q4_K_M file at 16 clients (``--no-batch1``).

Quiet check before each timed run: no cmake / cc1 / pytest process, and either the 1-minute load
below 0.5 or (since the load average lags for minutes after this script's own runs) the CPU time
other processes used over the last 3 s below 0.3 cores. Waits up to ``--quiet-wait-s`` in all,
then measures anyway and flags the figures busy.

    .venv/bin/python benchmarks/gguf_vs_llamacpp.py [--parts host,decode,rss,http,1b] [--rounds 2]
        [--model FILE.gguf] [--dtype auto] [--threads 2] [--http-rounds 2] [--output-json F]
    .venv/bin/python benchmarks/gguf_vs_llamacpp.py --tiny   # smoke run: short sizes, SmolLM2, no HTTP

Appends its figures to benchmarks/results/gguf_vs_llamacpp.jsonl (the HTTP parts also append
vs_llama_server.py's own lines).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_procs import Server, free_port, run_load  # noqa: E402

CLI = [sys.executable, "-m", "pagedserve.entrypoints.cli"]
LLAMACPP_CACHE = os.environ.get("LLAMACPP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-llamacpp"))
MODEL_1B = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-bench", "llama-1b-shapes")
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
HOST: dict[str, Any] = {}
_quiet_budget = [900.0]


def host_tag(quiet: Optional[bool] = None) -> str:
    q = "" if quiet is None else ("; quiet" if quiet else "; BUSY machine")
    return f"[{HOST.get('lscpu_model', '?')}, class {HOST.get('cpu_class', '?')}{q}]"


# -- the quiet check -------------------------------------------------------------------------
def _busy_procs() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    names = ("cmake", "cc1", "pytest")
    return [line.strip()[:100] for line in out if any(n in line for n in names) and "ps -eo" not in line]


def _cpu_busy_cores(seconds: float = 3.0) -> float:
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    t0, i0 = snap()
    time.sleep(seconds)
    t1, i1 = snap()
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


class OthersCpu:
    """CPU time others used while a timed run ran: the host's busy time (/proc/stat) less this
    process's and its waited-for children's, in cores over the wall time; a run measured next
    to another engineer's job says so even where the machine was quiet when it started."""

    @staticmethod
    def _busy_s() -> float:
        import resource

        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        mine = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
        return (sum(v) - v[3] - v[4]) / hz - mine

    def __enter__(self) -> "OthersCpu":
        self.t0, self.b0 = time.time(), self._busy_s()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cores = max(0.0, (self._busy_s() - self.b0) / max(1e-3, time.time() - self.t0))


def wait_quiet(what: str) -> dict[str, Any]:
    """Wait (60 s steps, from the shared budget) until the machine is quiet; the check's record."""
    t0 = time.time()
    while True:
        procs, load, busy = _busy_procs(), os.getloadavg()[0], _cpu_busy_cores()
        quiet = not procs and (load < 0.5 or busy < 0.3)
        if quiet or _quiet_budget[0] <= 0:
            break
        print(f"  waiting for a quiet machine before {what}: load {load:.2f}, other CPU use {busy:.2f} cores, {len(procs)} build/test processes")
        time.sleep(60)
        _quiet_budget[0] -= 60
    rec = {"quiet": quiet, "loadavg_1min": load, "other_cpu_cores": busy, "busy_procs": procs[:3], "waited_s": time.time() - t0}
    if not quiet:
        print(f"  measuring {what} on a BUSY machine (load {load:.2f}, {busy:.2f} cores in use, {procs[:2]})")
    return rec


# -- probes ----------------------------------------------------------------------------------
def host_info(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve import platform

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((x.split(":", 1)[1].strip() for x in lscpu.splitlines() if x.startswith("Model name")), platform.cpu_model_name())
    HOST.update(lscpu_model=name, cpu_class=platform.cpu_class(), cores=len(os.sched_getaffinity(0)))
    return dict(HOST)


def bandwidth_gb_s() -> Optional[float]:
    code = "from pagedserve.ops import cpu; bw = cpu.memory_read_bandwidth(); print(bw or 0)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=ENV)
    try:
        return float(p.stdout.split()[-1]) / 1e9 or None
    except (ValueError, IndexError):
        return None


def compute_ceiling(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "compute_ceiling.py"), "--threads", str(args.threads), "--rows", "1,32"]
    p = subprocess.run(cmd + (["--tiny"] if args.tiny else []), capture_output=True, text=True, cwd=ROOT, env=ENV)
    lines = [x for x in p.stdout.splitlines() if x.strip()]
    return {"command": " ".join(cmd[1:]), "returncode": p.returncode, "output": lines[:12]}


def weight_bytes(path: str) -> int:
    """Bytes of weights a decode token reads: a GGUF's tensor data (less the token embedding
    table where the LM head is its own tensor); a model dir: its safetensors' data likewise."""
    from pagedserve.model.file_headers import read_gguf_header, read_safetensors_header

    if path.endswith(".gguf"):
        t = read_gguf_header(path).tensors
        total = sum(s.end - s.start for s in t.values())
        return total - (t["token_embd.weight"].end - t["token_embd.weight"].start if "output.weight" in t else 0)
    t = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            t.update(read_safetensors_header(os.path.join(path, f)))
    total = sum(s.end - s.start for s in t.values())
    emb = t.get("model.embed_tokens.weight")
    return total - (emb.end - emb.start if emb is not None and "lm_head.weight" in t else 0)


# -- batch 1 ---------------------------------------------------------------------------------
def bench_latency(model: str, args: argparse.Namespace, dtype: str, iters: int) -> dict[str, Any]:
    out = tempfile.mktemp(suffix=".json", prefix="latency-")
    cmd = CLI + ["bench", "latency", "--model", model, "--dtype", dtype, "--num-threads", str(args.threads), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--num-iters", str(iters), "--output-json", out]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    with open(out) as fh:
        r = json.load(fh)["results"][0]
    os.remove(out)
    return {"decode_tok_s": r["decode_tokens_per_s"]["median"], "prefill_tok_s": r["prefill_tokens_per_s"]["median"], "dtype": r.get("dtype", dtype),
            "command": "pagedserve " + " ".join(cmd[len(CLI):-2])}


_BENCH_CRASHED: dict[str, bool] = {}  # file -> llama-bench crashed with its default repacking


def llama_bench(model: str, args: argparse.Namespace, iters: int) -> dict[str, Any]:
    """``llama-bench -p 0 -n N -d 512``: tg tok/s after a 512-token context; default repacking,
    or ``--repack 0`` where that crashes on this file (remembered per file) or with ``--no-repack``."""
    exe = os.path.join(args.llama_bin, "llama-bench")
    for repack in ([] if args.no_repack or _BENCH_CRASHED.get(model) else [None]) + ["0"]:
        cmd = [exe, "-m", model, "-p", "0", "-n", str(args.output_len), "-d", str(args.input_len), "-t", str(args.threads), "-r", str(iters), "-o", "json"]
        cmd += ["--repack", repack] if repack else []
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if p.returncode == 0:
            row = json.loads(p.stdout)[0]
            return {"decode_tok_s": float(row["avg_ts"]), "repack": repack is None, "command": " ".join(cmd[:-2]),
                    "crashed_with_repack": _BENCH_CRASHED.get(model, False)}
        crashed = p.returncode < 0 or p.returncode in (132, 134, 139)
        print(f"  llama-bench exited {p.returncode}{' (crash)' if crashed else ''} with {'default repacking' if repack is None else '--repack 0'}")
        if not crashed or repack:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        _BENCH_CRASHED[model] = True
    raise AssertionError("unreachable")


def _med(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def rounds_batch1(sides: dict[str, Any], args: argparse.Namespace, rounds: int, label: str) -> dict[str, Any]:
    """Each side (name -> zero-argument runner) once per round, the order reversed every other round."""
    res: dict[str, Any] = {k: [] for k in sides}
    checks = []
    order = list(sides)
    for i in range(rounds):
        for k in order if i % 2 == 0 else order[::-1]:
            q = wait_quiet(f"{label} {k}")
            with OthersCpu() as oc:
                r = sides[k]()
            q["others_cores_during"] = oc.cores
            q["quiet"] = q["quiet"] and oc.cores < 0.3
            checks.append(q)
            r.update(quiet=q["quiet"], loadavg_1min=q["loadavg_1min"], others_cores_during=oc.cores)
            res[k].append(r)
            print(f"  round {i + 1} {k}: decode {r['decode_tok_s']:.2f} tok/s (others used {oc.cores:.2f} cores meanwhile) {host_tag(q['quiet'])}")
    res["median_decode_tok_s"] = {k: _med([r["decode_tok_s"] for r in res[k]]) for k in sides}
    res["quiet"] = all(c["quiet"] for c in checks)
    return res


def report_batch1(res: dict[str, Any], ceilings: dict[str, float], pairs: list[tuple[str, str, str]]) -> None:
    med = res["median_decode_tok_s"]
    tag = host_tag(res["quiet"])
    for k, v in med.items():
        c = ceilings.get(k)
        share = f", {100 * v / c:.0f} % of its bandwidth ceiling {c:.1f} tok/s" if c else ""
        print(f"  {k}: median decode {v:.2f} tok/s{share} {tag}")
    res["ratios"] = {}
    for a, b, target in pairs:
        if med.get(a) and med.get(b):
            r = med[a] / med[b]
            res["ratios"][f"{a}/{b}"] = r
            print(f"  {a} / {b}: {r:.2f}x{target} {tag}")
    res["ceiling_tok_s"] = ceilings
    res["share_of_ceiling"] = {k: med[k] / ceilings[k] for k in med if ceilings.get(k) and med[k]}


# -- memory ----------------------------------------------------------------------------------
RSS_CODE = """
import sys
from pagedserve import LLM, SamplingParams
kw = dict(num_kv_blocks=64, block_size=16, max_model_len=1024, num_threads=int(sys.argv[2]), dtype=sys.argv[3])
if sys.argv[4] != "default":
    kw["quantization"] = sys.argv[4]
llm = LLM(sys.argv[1], **kw)
llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
kind = llm.llm_engine.core.worker.weights.kind
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print("RESULT", kind, int(hwm) * 1024)
"""


_SERVER_FLAGS: dict[str, list[str]] = {}


def llama_server_flags(model: str, args: argparse.Namespace) -> list[str]:
    """[] where llama-server starts on ``model`` with its default weight repacking, else
    ["--no-repack"] (where the repacked start crashes, as llama-bench's does on some CPUs)."""
    if model not in _SERVER_FLAGS:
        port = free_port()
        cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads), "-c", "512"]
        with Server("llama-server-probe", cmd, port, tempfile.mkdtemp(prefix="gguf_probe-"), cwd=ROOT) as srv:
            try:
                srv.wait_ready(300)
                _SERVER_FLAGS[model] = []
            except RuntimeError as e:
                if "exited with" not in str(e):
                    raise
                print(f"  llama-server crashed with its default weight repacking ({str(e).splitlines()[0]}): --no-repack from here on")
                _SERVER_FLAGS[model] = ["--no-repack"]
    return _SERVER_FLAGS[model]


def _vmhwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(x.split()[1]) * 1024 for x in fh if x.startswith("VmHWM"))


def rss(model: str, args: argparse.Namespace) -> dict[str, Any]:
    q = wait_quiet("the RSS runs")
    out: dict[str, Any] = {"file_bytes": os.path.getsize(model), "check": q}
    p = subprocess.run([sys.executable, "-c", "import torch; print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"],
                       capture_output=True, text=True)
    out["bare_torch_bytes"] = int(p.stdout.split()[-1]) * 1024
    for label, quant in (("pagedserve_quantized", "default"), ("pagedserve_dequantized", "none")):
        p = subprocess.run([sys.executable, "-c", RSS_CODE, model, str(args.threads), args.dtype, quant], capture_output=True, text=True, cwd=ROOT, env=ENV)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
        if p.returncode or not line:
            raise RuntimeError(f"the RSS run ({label}) failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
        _, kind, hwm = line[0].split()
        out[label] = {"kind": kind, "peak_rss_bytes": int(hwm)}
    if os.path.exists(os.path.join(args.llama_bin, "llama-server")):
        flags = llama_server_flags(model, args)
        port = free_port()
        cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
               "-c", "1024", "-np", "1", "--no-webui"] + flags
        with Server("llama-server", cmd, port, tempfile.mkdtemp(prefix="gguf_rss-"), cwd=ROOT) as srv:
            srv.wait_ready(300)
            run_load(srv.url, "m", ["The capital of France is"], 8, 1)
            assert srv.proc is not None
            out["llama_server"] = {"peak_rss_bytes": _vmhwm(srv.proc.pid), "command": " ".join(cmd)}
    budget = out["bare_torch_bytes"] + 1.2 * out["file_bytes"] + 150e6
    out["target_bytes"] = budget
    got = out["pagedserve_quantized"]["peak_rss_bytes"]
    out["target_met"] = got <= budget
    mb = 1e6
    print(f"  file {out['file_bytes'] / mb:.0f} MB; bare torch {out['bare_torch_bytes'] / mb:.0f} MB; target {budget / mb:.0f} MB {host_tag()}")
    print(f"  pagedserve quantized ({out['pagedserve_quantized']['kind']}): peak RSS {got / mb:.0f} MB, "
          f"{(got - out['bare_torch_bytes']) / mb:.0f} MB above bare torch = {(got - out['bare_torch_bytes']) / out['file_bytes']:.2f} x the file; "
          f"target {'met' if out['target_met'] else 'NOT met'}")
    d = out["pagedserve_dequantized"]
    print(f"  pagedserve dequantized ({d['kind']}): peak RSS {d['peak_rss_bytes'] / mb:.0f} MB")
    if "llama_server" in out:
        ll = out["llama_server"]["peak_rss_bytes"]
        print(f"  llama-server (-c 1024): peak RSS {ll / mb:.0f} MB; pagedserve / llama-server {got / ll:.2f}x")
    return out


# -- HTTP (vs_llama_server.py) ---------------------------------------------------------------
def http(scenario: str, model: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    flags = llama_server_flags(model, args)
    extra = extra + ([f"--llama-server-args={' '.join(flags)}"] if flags else [])
    q = wait_quiet(f"vs_llama_server {scenario}")
    js = tempfile.mktemp(suffix=".json", prefix=f"vs_{scenario}-")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vs_llama_server.py"), "--scenario", scenario, "--model", model, "--gguf", model,
           "--rounds", str(args.http_rounds), "--threads", str(args.threads), "--dtype", args.dtype, "--output-json", js] + extra
    print("  " + " ".join(cmd[1:]))
    with OthersCpu() as oc:
        p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    q["others_cores_during"] = oc.cores
    q["quiet"] = q["quiet"] and oc.cores < 0.3
    print(f"    others used {oc.cores:.2f} cores meanwhile")
    print("\n".join("    " + x for x in p.stdout.splitlines() if x.startswith(("round", "    ", "median"))))
    if p.returncode:
        raise RuntimeError(f"vs_llama_server.py failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    with open(js) as fh:
        summary = json.load(fh)["summary"]
    med = summary["median"]
    print(f"  {scenario} on {os.path.basename(model)}: pagedserve {med.get('pagedserve_http_tok_s', 0):.1f} tok/s, llama-server "
          f"{med.get('llama_server_http_tok_s', 0):.1f}: {med.get('ratio_http', 0):.2f}x {host_tag(q['quiet'])}")
    return {"command": " ".join(cmd[1:]), "check": q, "summary": summary, "llama_server_flags": flags}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="host,decode,rss,http,1b")
    ap.add_argument("--model", default=None, help="the quantized GGUF (default: pagedserve's default model, SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--model-1b", default=MODEL_1B, help="build_1b_model.py's dir, with model-Q4_K_M.gguf and model-Q8_0.gguf")
    ap.add_argument("--dtype", default="auto", help="pagedserve's activations (default: %(default)s: bf16 where the CPU computes in it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="batch-1 rounds (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=3, help="batch-1 iterations per run (bench latency --num-iters, llama-bench -r)")
    ap.add_argument("--http-rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--llama-bin", default=os.path.join(LLAMACPP_CACHE, "bin"))
    ap.add_argument("--no-repack", action="store_true", help="llama-bench --repack 0 from the start")
    ap.add_argument("--quiet-wait-s", type=float, default=900.0, help="most seconds to wait for a quiet machine, in all")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: SmolLM2, 32-token prompt, 8 tokens, 1 round; host,decode,rss; no waiting")
    args = ap.parse_args()
    if args.tiny:
        args.parts = "host,decode,rss"
        args.rounds, args.iters, args.input_len, args.output_len, args.quiet_wait_s = 1, 1, 32, 8, 0
    _quiet_budget[0] = args.quiet_wait_s
    args.llama_bin = os.path.expanduser(args.llama_bin)
    from pagedserve.bench.results import record
    from pagedserve.model.files import default_model_path

    model = os.path.abspath(args.model or default_model_path())
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    have_bench = os.path.exists(os.path.join(args.llama_bin, "llama-bench"))
    if not have_bench and not args.tiny and {"decode", "1b", "http"} & set(parts):
        raise SystemExit(f"{args.llama_bin}/llama-bench not found: benchmarks/llamacpp_setup.sh build")
    fig: dict[str, Any] = {"model": model, "dtype": args.dtype, "threads": args.threads, "host": host_info(args)}
    print(f"host: {HOST['lscpu_model']} (lscpu), class {HOST['cpu_class']}, {HOST['cores']} cores; pagedserve --dtype {args.dtype}, {args.threads} threads each")
    t_start = time.time()

    def save() -> None:
        if args.output_json:
            with open(args.output_json, "w") as fh:
                json.dump(fig, fh, indent=2)

    if "host" in parts:
        q = wait_quiet("the host probes")
        bw = bandwidth_gb_s()
        fig["bandwidth_gb_s"], fig["host_check"] = bw, q
        print(f"memory read bandwidth {bw or 0:.1f} GB/s {host_tag(q['quiet'])}")
        fig["compute_ceiling"] = compute_ceiling(args)
        print("\n".join("  compute_ceiling: " + x for x in fig["compute_ceiling"]["output"]))
    bw = fig.get("bandwidth_gb_s") or bandwidth_gb_s()
    fig["bandwidth_gb_s"] = bw

    def ceiling(path: str) -> Optional[float]:
        return bw * 1e9 / weight_bytes(path) if bw else None

    if "decode" in parts:
        print(f"batch-1 decode after a {args.input_len}-token prompt, {os.path.basename(model)}:")
        sides = {"pagedserve": lambda: bench_latency(model, args, args.dtype, args.iters)}
        if have_bench:
            sides["llama_bench"] = lambda: llama_bench(model, args, args.iters)
        res = rounds_batch1(sides, args, args.rounds, "decode")
        c = ceiling(model)
        report_batch1(res, {k: c for k in sides} if c else {}, [("pagedserve", "llama_bench", "")])
        fig["decode"] = res
        save()
    if "rss" in parts:
        print(f"peak RSS, loading included, a 1,024-token KV pool, {os.path.basename(model)}:")
        fig["rss"] = rss(model, args)
        save()
    if "http" in parts:
        fig["http_smollm2"] = http("w1-http", model, args, ["--no-offline"])
        save()
    if "1b" in parts:
        files = {q: os.path.join(args.model_1b, f"model-{q}.gguf") for q in ("Q4_K_M", "Q8_0")}
        if not all(os.path.exists(f) for f in files.values()):
            print(f"1b skipped: {list(files.values())} missing (benchmarks/build_1b_model.py --gguf --quantize Q4_K_M,Q8_0)")
        else:
            print(f"the 1.1B model, batch-1 decode after a {args.input_len}-token prompt:")
            sides = {"pagedserve_Q4_K_M": lambda: bench_latency(files["Q4_K_M"], args, args.dtype, args.iters),
                     "pagedserve_Q8_0": lambda: bench_latency(files["Q8_0"], args, args.dtype, args.iters),
                     "pagedserve_bf16": lambda: bench_latency(args.model_1b, args, "bfloat16", args.iters),
                     "llama_bench_Q4_K_M": lambda: llama_bench(files["Q4_K_M"], args, args.iters)}
            res = rounds_batch1(sides, args, args.rounds, "1b decode")
            ceil = {k: ceiling(files["Q4_K_M"] if k.endswith("Q4_K_M") else files["Q8_0"] if k.endswith("Q8_0") else args.model_1b) for k in sides}
            report_batch1(res, {k: v for k, v in ceil.items() if v}, [("pagedserve_Q4_K_M", "pagedserve_bf16", " (target >= 2x)"),
                                                                      ("pagedserve_Q8_0", "pagedserve_bf16", ""),
                                                                      ("pagedserve_Q4_K_M", "llama_bench_Q4_K_M", "")])
            fig["decode_1b"] = res
            save()
            fig["http_1b"] = http("1b", files["Q4_K_M"], args, ["--no-batch1"])
            save()
    fig["elapsed_s"] = time.time() - t_start
    save()
    record("gguf_vs_llamacpp", fig, tiny=args.tiny)
    print(f"done in {fig['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
