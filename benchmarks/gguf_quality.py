"""Quality of a quantized GGUF file served as it is (issue 48): perplexity on real English text,
computed exactly as ``llama-perplexity -c 512`` computes it, for pagedserve's quantized path,
pagedserve's dequantized path (``quantization="none"``) and llama.cpp itself; and, on the random
1.1B model of build_1b_model.py, the KL divergence of its Q4_K_M and Q8_0 files from its bf16
weights.

Text: the GNU/OSI licence texts in /usr/share/common-licenses (GPL-3, GPL-2, LGPL-2.1,
Apache-2.0, MPL-2.0, GFDL-1.3, Artistic, in that order, joined by a blank line; ~30k tokens),
written to one temporary file that llama-perplexity reads too.

Perplexity as tools/perplexity/perplexity.cpp computes it (``perplexity()``, no ``--ppl-stride``):
the whole text is tokenized once (a BOS first when the GGUF's ``tokenizer.ggml.add_bos_token``
says so; SmolLM2's says no), cut into ``len // ctx`` chunks of ``ctx`` tokens (the tail is
dropped), each chunk run alone from an empty cache with its first token replaced by BOS (again
only with add_bos), and the positions ``ctx/2 .. ctx-2`` of each chunk scored: the log-softmax
at position p of token p+1 (255 positions a chunk at ctx 512). PPL = exp(mean NLL). pagedserve
runs each chunk as one request (its token ids as the prompt, ``max_tokens=1``,
``prompt_logprobs=1``) and the script captures the full logits rows by wrapping the model's
``compute_logits`` (the rows of the prompt positions, then the sampled last one); the captured
rows are checked against the prompt logprobs the engine returns. pagedserve is fed the tokens
llama-perplexity evaluates (read from the head of its ``--save-all-logits`` file through a FIFO;
the count of positions where the HF tokenizer differs is printed), so both score the same
tokens. Diagnostic (``--no-f32`` skips it): llama-perplexity on the same weights dequantized to
F32 by ``llama-quantize --allow-requantize``, which separates llama.cpp's quantized arithmetic
(its Q8 activations) from the weights' rounding. Teacher-forced top-1
agreement: the argmax of the quantized and the dequantized logits at the same scored positions.

Activations in float32 by default (``--dtype``), so that only the weights differ between the
quantized path (the file's blocks, C kernels) and the dequantized one (the same values as
float32 tensors): the comparison measures the kernels, not bf16 rounding.

KL (the 1.1B model, random weights: only KL means something): the HF dir (bf16 weights, run at
``--dtype``) against ``model-Q4_K_M.gguf`` and ``model-Q8_0.gguf`` (``build_1b_model.py --gguf
--quantize``), the first ``--kl-chunks`` chunks of the same text, the same scored positions;
mean KL(p_bf16 || p_quant) in nats over full-vocabulary distributions; beside it llama.cpp's own
figure on the same positions (``llama-perplexity --kl-divergence``, base ``model-bf16.gguf``).

    .venv/bin/python benchmarks/gguf_quality.py [--model FILE.gguf] [--dtype float32] [--threads 2]
        [--ctx 512] [--chunks N] [--no-llamacpp] [--no-f32] [--no-1b] [--kl-chunks 2] [--output-json F]
    .venv/bin/python benchmarks/gguf_quality.py --tiny     # smoke run: ~400 tokens, SmolLM2 only

``--tiny``: ctx 128, 3 chunks, SmolLM2 only; llama-perplexity only where it is built. Appends its
figures to benchmarks/results/gguf_quality.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
LLAMACPP_CACHE = os.environ.get("LLAMACPP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-llamacpp"))
MODEL_1B = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-bench", "llama-1b-shapes")
LICENSES = ["GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic"]
LICENSE_DIR = "/usr/share/common-licenses"


def write_text(path: str, max_chars: Optional[int] = None) -> str:
    """The licence texts in their fixed order, joined by a blank line, written to ``path``."""
    parts = []
    for name in LICENSES:
        with open(os.path.join(LICENSE_DIR, name), encoding="utf-8") as fh:
            parts.append(fh.read().strip())
    text = "\n\n".join(parts) + "\n"
    if max_chars:
        text = text[:max_chars]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return text


def gguf_add_bos(path: str) -> tuple[bool, Optional[int]]:
    """(tokenizer.ggml.add_bos_token, bos id) of a GGUF file, as llama.cpp reads them."""
    from pagedserve.model.file_headers import read_gguf_header

    meta = read_gguf_header(path).metadata
    return bool(meta.get("tokenizer.ggml.add_bos_token", False)), meta.get("tokenizer.ggml.bos_token_id")


def chunks_of(tokens: list[int], ctx: int, add_bos: bool, bos: Optional[int], limit: Optional[int]) -> list[list[int]]:
    """llama-perplexity's chunks: BOS before the text (add_bos), ``len // ctx`` chunks, the first
    token of each replaced by BOS (add_bos)."""
    toks = ([bos] if add_bos else []) + list(tokens)
    n = len(toks) // ctx
    if limit is not None:
        n = min(n, limit)
    out = []
    for i in range(n):
        c = toks[i * ctx : (i + 1) * ctx]
        if add_bos:
            c[0] = bos
        out.append(c)
    return out


class Engine:
    """One pagedserve LLM whose full logits rows for one chunk are captured."""

    def __init__(self, label: str, model: str, **kw: Any) -> None:
        from pagedserve import LLM

        t0 = time.perf_counter()
        self.label = label
        self.llm = LLM(model, **kw)
        self.load_s = time.perf_counter() - t0
        worker = self.llm.llm_engine.core.worker
        self.kind = getattr(getattr(worker, "weights", None), "kind", "?")
        self.model = worker.model_runner.model
        self.rows: list[torch.Tensor] = []
        orig = type(self.model).compute_logits

        def wrapped(hidden: torch.Tensor) -> torch.Tensor:
            logits = orig(self.model, hidden)
            self.rows.append(logits.detach().float().clone())
            return logits

        self.model.compute_logits = wrapped

    def logprobs(self, chunk: list[int], first: int) -> torch.Tensor:
        """log-softmax rows [first .. len-2] of ``chunk`` (float32), checked against the engine's
        own prompt logprobs of the same positions."""
        from pagedserve import SamplingParams

        self.rows = []
        out = self.llm.generate([{"prompt_token_ids": chunk}], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)[0]
        logits = torch.cat(self.rows)
        self.rows = []
        if logits.shape[0] != len(chunk):
            raise RuntimeError(f"{self.label}: captured {logits.shape[0]} logits rows for a {len(chunk)}-token prompt")
        lp = torch.log_softmax(logits[first : len(chunk) - 1], dim=-1)
        # the engine's prompt_logprobs[p + 1] scores token p + 1 at position p: the same rows?
        for p in (first, len(chunk) - 2):
            want = out.prompt_logprobs[p + 1][chunk[p + 1]].logprob
            got = lp[p - first, chunk[p + 1]].item()
            if abs(want - got) > 1e-3 * max(1.0, abs(want)):
                raise RuntimeError(f"{self.label}: captured row {p} gives {got:.5f}, the engine's prompt logprob {want:.5f}")
        return lp


def nll_and_top1(lp: torch.Tensor, chunk: list[int], first: int) -> tuple[torch.Tensor, torch.Tensor]:
    targets = torch.tensor(chunk[first + 1 :], dtype=torch.long)
    return -lp.gather(1, targets[:, None])[:, 0].double(), lp.argmax(dim=-1)


def ppl_pair(model: str, chunks: list[list[int]], first: int, args: argparse.Namespace) -> dict[str, Any]:
    """Quantized (default) and dequantized (``quantization="none"``) on the same chunks,
    alternating per chunk: PPL of each, top-1 agreement, mean KL(dequantized || quantized)."""
    common = dict(dtype=args.dtype, num_threads=args.threads, max_model_len=args.ctx + 16, num_kv_blocks=(args.ctx + 16) // 16 + 4,
                  enable_prefix_caching=False)
    q = Engine("quantized", model, **common)
    d = Engine("dequantized", model, quantization="none", **common)
    print(f"pagedserve on {model}: quantized weights {q.kind} (loaded in {q.load_s:.1f} s), dequantized {d.kind} ({d.load_s:.1f} s); "
          f"activations {args.dtype}, {args.threads} threads")
    nll = {"quantized": [], "dequantized": []}
    agree = kl = 0.0
    n = 0
    t0 = time.perf_counter()
    for i, c in enumerate(chunks):
        lq, ld = q.logprobs(c, first), d.logprobs(c, first)
        (nq, aq), (nd, ad) = nll_and_top1(lq, c, first), nll_and_top1(ld, c, first)
        nll["quantized"].append(nq)
        nll["dequantized"].append(nd)
        agree += (aq == ad).sum().item()
        kl += (ld.exp() * (ld - lq)).sum(dim=-1).double().sum().item()
        n += len(nq)
        if (i + 1) % 10 == 0 or i + 1 == len(chunks):
            print(f"  [{i + 1}/{len(chunks)}] PPL quantized {math.exp(torch.cat(nll['quantized']).mean()):.4f}, "
                  f"dequantized {math.exp(torch.cat(nll['dequantized']).mean()):.4f} ({time.perf_counter() - t0:.0f} s)")
    res: dict[str, Any] = {"kinds": {"quantized": q.kind, "dequantized": d.kind}, "positions": n}
    for k, v in nll.items():
        allv = torch.cat(v)
        mean = allv.mean().item()
        sd = math.sqrt(max(allv.var(unbiased=False).item(), 0.0) / max(1, len(allv) - 1))
        res[f"ppl_{k}"] = math.exp(mean)
        res[f"ppl_{k}_pm"] = math.exp(mean) * sd  # llama-perplexity's +/-
    res["top1_agreement"] = agree / n
    res["mean_kl_dequantized_quantized"] = kl / n
    del q, d
    return res


def _llama_cmd(binary: str, model: str, text_file: str, ctx: int, threads: int, chunks: Optional[int], repack: bool) -> list[str]:
    return [binary, "-m", model, "-f", text_file, "-c", str(ctx), "-t", str(threads)] + (["--chunks", str(chunks)] if chunks else []) + (
        [] if repack else ["--no-repack"])


def llama_tokens(binary: str, model: str, text_file: str, ctx: int, threads: int, repack: bool) -> Optional[list[int]]:
    """The tokens llama-perplexity evaluates (its whole text as ``common_tokenize`` makes it, cut
    to ``len // ctx`` chunks), read from the head of its ``--save-all-logits`` file through a
    FIFO; the process is stopped before it computes anything much. None where that fails."""
    import struct

    tmp = tempfile.mkdtemp(prefix="llama_tokens-")
    fifo = os.path.join(tmp, "logits")
    os.mkfifo(fifo)
    cmd = _llama_cmd(binary, model, text_file, ctx, threads, None, repack) + ["--save-all-logits", fifo]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # never blocks: a crash before it writes must not hang us
    buf, need, deadline = b"", 20, time.monotonic() + 600
    try:
        while len(buf) < need and time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                chunk = b""
            buf += chunk
            if len(buf) >= 20 and need == 20:
                if buf[:8] != b"_logits_":
                    return None
                need = 20 + 4 * struct.unpack("<i", buf[16:20])[0] * ctx
            if not chunk:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        if len(buf) < need or need == 20:
            return None
        n = (need - 20) // 4
        return list(struct.unpack(f"<{n}i", buf[20:need]))
    finally:
        proc.kill()
        proc.wait()
        os.close(fd)
        os.remove(fifo)
        os.rmdir(tmp)


def llama_perplexity(binary: str, model: str, text_file: str, ctx: int, threads: int, chunks: Optional[int]) -> dict[str, Any]:
    """``llama-perplexity -c CTX``'s final estimate; llama.cpp's default weight repacking, or
    ``--no-repack`` where that crashes (recorded)."""
    crashed = None
    for repack in (True, False):
        cmd = _llama_cmd(binary, model, text_file, ctx, threads, chunks, repack)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        log = p.stdout + p.stderr
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
        if p.returncode == 0 and m:
            break
        if repack and (p.returncode < 0 or p.returncode in (132, 134, 139)):
            crashed = p.returncode
            print(f"llama-perplexity crashed ({p.returncode}) with its default weight repacking: again with --no-repack")
            continue
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{log[-3000:]}")
    n = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"ppl": float(m.group(1)), "ppl_pm": float(m.group(2)), "chunks": int(n.group(1)) if n else None, "seconds": time.perf_counter() - t0,
            "command": " ".join(cmd), "repack": repack, "crashed_with_repack": crashed}


def f32_copy(llama_bin: str, model: str) -> str:
    """The same weights dequantized to F32 by llama.cpp (``llama-quantize --allow-requantize FILE
    OUT F32``), under the llama.cpp cache dir; reused when it exists."""
    out = os.path.join(LLAMACPP_CACHE, os.path.basename(model)[: -len(".gguf")] + ".dequantized-F32.gguf")
    if not os.path.exists(out):
        subprocess.run([os.path.join(llama_bin, "llama-quantize"), "--allow-requantize", model, out + ".tmp", "F32"], check=True, capture_output=True)
        os.replace(out + ".tmp", out)
    return out


def llama_kl(binary: str, base_gguf: str, files: dict[str, str], text_file: str, ctx: int, threads: int, chunks: int) -> dict[str, Any]:
    """llama.cpp's own mean KL(base || quantized) over the same chunks and scored positions
    (``llama-perplexity --kl-divergence-base`` on ``base_gguf``, then ``--kl-divergence`` per file),
    ``--no-repack`` where the default crashes."""
    base = os.path.join(tempfile.mkdtemp(prefix="llama_kl-"), "base.kld")
    out: dict[str, Any] = {"base": base_gguf}

    def run(model: str, extra: list[str]) -> str:
        for repack in (True, False):
            cmd = _llama_cmd(binary, model, text_file, ctx, threads, chunks, repack) + extra
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode == 0:
                return p.stdout + p.stderr
            if not (repack and (p.returncode < 0 or p.returncode in (132, 134, 139))):
                raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
        raise AssertionError("unreachable")

    try:
        run(base_gguf, ["--kl-divergence-base", base])
        for q, path in files.items():
            m = re.search(r"Mean\s+KLD:\s+([0-9.]+)", run(path, ["--kl-divergence-base", base, "--kl-divergence"]))
            out[q] = float(m.group(1)) if m else None
    finally:
        if os.path.exists(base):
            os.remove(base)
    return out


def kl_1b(args: argparse.Namespace, tok_ids: list[int], first: int, text_file: str) -> dict[str, Any]:
    """Mean KL(bf16 HF dir || quantized GGUF) per quantized file of the 1.1B model."""
    files = {q: os.path.join(args.model_1b, f"model-{q}.gguf") for q in ("Q4_K_M", "Q8_0")}
    missing = [f for f in files.values() if not os.path.exists(f)] + ([] if os.path.exists(os.path.join(args.model_1b, ".complete")) else [args.model_1b])
    if missing:
        print(f"1.1B KL skipped: {', '.join(missing)} missing (benchmarks/build_1b_model.py --gguf --quantize)")
        return {"skipped": f"missing {missing}"}
    common = dict(dtype=args.dtype, num_threads=args.threads, max_model_len=args.ctx + 16, num_kv_blocks=(args.ctx + 16) // 16 + 4,
                  enable_prefix_caching=False)
    add_bos, bos = gguf_add_bos(files["Q4_K_M"])
    chunks = chunks_of(tok_ids, args.ctx, add_bos, bos, args.kl_chunks)
    ref = Engine("bf16", args.model_1b, **common)
    print(f"1.1B: reference {args.model_1b} ({ref.kind} at {args.dtype}, loaded in {ref.load_s:.1f} s); {len(chunks)} chunks x {args.ctx - 1 - first} positions")
    ref_lp = [ref.logprobs(c, first) for c in chunks]
    del ref
    out: dict[str, Any] = {"reference": args.model_1b, "positions": sum(len(x) for x in ref_lp)}
    for q, path in files.items():
        e = Engine(q, path, **common)
        kl, agree, n = 0.0, 0, 0
        for c, lr in zip(chunks, ref_lp):
            lq = e.logprobs(c, first)
            kl += (lr.exp() * (lr - lq)).sum(dim=-1).double().sum().item()
            agree += (lr.argmax(-1) == lq.argmax(-1)).sum().item()
            n += len(lq)
        out[q] = {"file": path, "kind": e.kind, "file_bytes": os.path.getsize(path), "mean_kl": kl / n, "top1_agreement": agree / n}
        print(f"  {q} ({e.kind}, {os.path.getsize(path) / 1e6:.0f} MB): mean KL(bf16 || {q}) = {kl / n:.5f} nats over {n} positions; "
              f"top-1 agreement {100 * agree / n:.1f} % (random weights: only the KL means something)")
        del e
    binary = os.path.join(os.path.expanduser(args.llama_bin), "llama-perplexity")
    bf16 = os.path.join(args.model_1b, "model-bf16.gguf")
    if not args.no_llamacpp and os.path.exists(binary) and os.path.exists(bf16):
        ll = llama_kl(binary, bf16, files, text_file, args.ctx, args.threads, args.kl_chunks)
        out["llama_perplexity_kl"] = ll
        print("  llama.cpp's own KL on the same chunks (llama-perplexity --kl-divergence, base model-bf16.gguf): "
              + ", ".join(f"{q} {ll[q]:.5f}" for q in files if ll.get(q) is not None) + " nats (its activations are quantized too)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="quantized GGUF file (default: pagedserve's default model, SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="pagedserve's activations (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512, help="chunk length, llama-perplexity's -c (default: %(default)s)")
    ap.add_argument("--chunks", type=int, default=None, help="at most this many chunks (llama-perplexity's --chunks; default: all)")
    ap.add_argument("--llama-bin", default=os.path.join(LLAMACPP_CACHE, "bin"))
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama-perplexity")
    ap.add_argument("--no-f32", action="store_true", help="skip llama-perplexity on the weights dequantized to F32 (a diagnostic)")
    ap.add_argument("--no-1b", action="store_true", help="skip the 1.1B model's KL")
    ap.add_argument("--model-1b", default=MODEL_1B)
    ap.add_argument("--kl-chunks", type=int, default=2, help="1.1B: chunks of the text for the KL (default: %(default)s)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: ctx 128, 3 chunks, SmolLM2 only")
    args = ap.parse_args()
    if args.tiny:
        args.ctx, args.chunks, args.no_1b, args.no_f32 = 128, 3, True, True
    from pagedserve import platform
    from pagedserve.bench.results import record
    from pagedserve.model import loader
    from pagedserve.model.files import default_model_path

    torch.set_num_threads(args.threads)
    model = os.path.abspath(args.model or default_model_path())
    tmp = tempfile.mkdtemp(prefix="gguf_quality-")
    text_file = os.path.join(tmp, "licenses.txt")
    text = write_text(text_file, 3000 if args.tiny else None)
    tok = loader.load_tokenizer(loader.resolve_model(model))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    add_bos, bos = gguf_add_bos(model)
    first = args.ctx // 2
    host = f"{platform.cpu_model_name()} (class {platform.cpu_class()}, {len(os.sched_getaffinity(0))} cores)"
    print(f"host: {host}; load {os.getloadavg()[0]:.2f}")
    figures: dict[str, Any] = {"model": model, "file_bytes": os.path.getsize(model), "dtype": args.dtype, "threads": args.threads, "ctx": args.ctx,
                               "text": LICENSES, "text_chars": len(text), "text_tokens": len(ids), "add_bos": add_bos}
    binary = os.path.join(os.path.expanduser(args.llama_bin), "llama-perplexity")
    lp = None
    if args.no_llamacpp or not os.path.exists(binary):
        if not args.no_llamacpp and not args.tiny:
            raise SystemExit(f"{binary} not found: benchmarks/llamacpp_setup.sh build (or --no-llamacpp)")
        print(f"llama-perplexity: skipped ({'--no-llamacpp' if args.no_llamacpp else binary + ' not built'})")
    else:
        lp = llama_perplexity(binary, model, text_file, args.ctx, args.threads, args.chunks)
        figures["llama_perplexity"] = lp
        print(f"llama-perplexity ({lp['seconds']:.0f} s, {'default repacking' if lp['repack'] else '--no-repack'}): PPL {lp['ppl']:.4f} +/- {lp['ppl_pm']:.4f} "
              f"over {lp['chunks']} chunks")
        ltoks = llama_tokens(binary, model, text_file, args.ctx, args.threads, lp["repack"])
        if ltoks is None:
            print("  (could not read llama-perplexity's tokens: pagedserve uses the HF tokenizer's)")
        else:
            import difflib

            hf = (([bos] if add_bos else []) + ids)[: len(ltoks) + 64]
            ops = [o for o in difflib.SequenceMatcher(None, hf, ltoks, autojunk=False).get_opcodes() if o[0] != "equal"]
            figures["tokenization_differences_hf_vs_llamacpp"] = len(ops)
            print(f"  its tokens: {len(ltoks)} in {len(ltoks) // args.ctx} chunks; the HF tokenizer's differ from them in {len(ops)} places "
                  f"(llama.cpp's pre-tokenizer splits some whitespace runs otherwise); pagedserve is fed llama.cpp's")
            ids, add_bos = ltoks[1:] if add_bos else ltoks, add_bos
    chunks = chunks_of(ids, args.ctx, add_bos, bos, args.chunks)
    figures.update(chunks=len(chunks), scored_positions=len(chunks) * (args.ctx - 1 - first))
    print(f"text: {text_file}: {', '.join(LICENSES)} from {LICENSE_DIR}, {len(text)} chars, {figures['text_tokens']} tokens (SmolLM2 tokenizer); "
          f"add_bos {add_bos}; {len(chunks)} chunks of {args.ctx}, positions {first}..{args.ctx - 2} scored ({figures['scored_positions']} in all)")
    t0 = time.perf_counter()
    figures.update(ppl_pair(model, chunks, first, args))
    print(f"pagedserve ({time.perf_counter() - t0:.0f} s): PPL quantized {figures['ppl_quantized']:.4f} +/- {figures['ppl_quantized_pm']:.4f}, "
          f"dequantized {figures['ppl_dequantized']:.4f} +/- {figures['ppl_dequantized_pm']:.4f} (activations {args.dtype})")
    ratio = figures["ppl_quantized"] / figures["ppl_dequantized"]
    figures["ratio_quantized_over_dequantized"] = ratio
    print(f"  quantized / dequantized: {ratio:.4f} (target within 1 %: {'met' if abs(ratio - 1) <= 0.01 else 'NOT met'}); "
          f"teacher-forced top-1 agreement {100 * figures['top1_agreement']:.2f} % (target >= 97 %: "
          f"{'met' if figures['top1_agreement'] >= 0.97 else 'NOT met'}); mean KL(dequantized || quantized) {figures['mean_kl_dequantized_quantized']:.2e} nats")
    if lp is not None:
        r = figures["ppl_quantized"] / lp["ppl"]
        figures["ratio_quantized_over_llamacpp"] = r
        print(f"  pagedserve quantized / llama-perplexity: {r:.4f} (target within 1 %: {'met' if abs(r - 1) <= 0.01 else 'NOT met'})")
        if not args.no_f32 and os.path.exists(os.path.join(os.path.expanduser(args.llama_bin), "llama-quantize")):
            # where the two differ: llama.cpp on the same weights dequantized to F32 (its float path)
            f32 = f32_copy(os.path.expanduser(args.llama_bin), model)
            lf = llama_perplexity(binary, f32, text_file, args.ctx, args.threads, args.chunks)
            figures["llama_perplexity_f32"] = lf
            print(f"llama-perplexity on the weights dequantized to F32 ({f32}): PPL {lf['ppl']:.4f}; llama.cpp {os.path.basename(model)} / F32 "
                  f"{lp['ppl'] / lf['ppl']:.4f}; pagedserve dequantized (float32) / llama.cpp F32 {figures['ppl_dequantized'] / lf['ppl']:.4f}")
    if not args.no_1b:
        figures["kl_1b"] = kl_1b(args, ids, first, text_file)
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(figures, fh, indent=2)
    record("gguf_quality", figures, tiny=args.tiny)
    print(f"text file kept at {text_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
