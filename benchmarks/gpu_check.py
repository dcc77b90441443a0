"""The prepared GPU check of issue 52 (item 5): one run on one H100 / H200, under 5 minutes,
correctness first, every section's results written to ``$OUT`` as soon as they exist.

    PYTHONPATH=. python benchmarks/gpu_check.py                  # on the device machine ($OUT set)
    PYTHONPATH=. python benchmarks/gpu_check.py --only a,b       # some sections
    .venv/bin/python benchmarks/gpu_check.py --cpu-smoke         # here: tiny sizes on the CPU (--tiny: the same)

The device machine has Python 3.12, torch + CUDA, Triton and transformers, and nothing else we
use but xxhash's wheel, which ``benchmarks/gpu_check_assets/wheels/`` carries (unpacked into a
temporary folder and put on ``sys.path`` when ``import xxhash`` fails). Nothing is downloaded:
the models are random-weight transformers models built on the GPU from configs, saved with
SmolLM2's tokenizer files from ``benchmarks/gpu_check_assets/``. The smoke run hides pydantic,
fastapi, zmq, msgpack, gguf and llguidance (``sys.modules[name] = None``) to show the offline
path does without them.

Sections (each in its own process, so a CUDA fault or a hang costs that section only, with its
own time budget under an overall deadline; a section process running 30 s past its budget is
killed; what does not fit is marked skipped):

a. kernel: the Triton paged-attention kernel compiled, bf16 and fp16 (and the int8 cache),
   against a float64 reference gathered from the same paged cache (mixed decode + fresh prompt +
   chunk-after-context batches, GQA 1/3/4, head dims 64/128, split-KV decodes, a Qwen3-0.6B-shaped
   batch of 64 decodes). Smoke: fp32 / fp16 under Triton's interpreter.
b. correctness on small random Llama and Qwen3 models: greedy equal to HF transformers in float32
   with TF32 off on 8 prompts of 5-600 tokens (else the first divergence, the top-2 logit gap
   there and whether each side's token is in the other's top 5); bf16 ``prompt_logprobs`` against
   HF's ``log_softmax`` (max abs diff); chunked prefill, a prefix-cache hit, preemption and the
   int8 KV cache against the plain run's greedy tokens; CUDA graph replay against eager
   (``enforce_eager``; "not available" where EngineConfig lacks it).
c. throughput on a random Qwen3-0.6B-shaped model (bf16): 256 requests, input and output lengths
   uniform in 100-1,024 (``bench throughput --dataset-name random``), pagedserve against HF
   ``generate`` in static batches of 64: output / total tok/s, MFU against the measured bf16
   matmul rate (a large square matmul, and the model-shaped one ``bench throughput`` uses),
   ``torch.cuda.max_memory_allocated``, KV blocks. HF runs as many whole batches as its budget
   allows (its tok/s is over those).
d. decode-step wall time against GPU time at batch 1, 64 and 256 on the same model (eager, and
   with CUDA graphs where ``enforce_eager`` exists): the wall time of ``engine.step()``, the CUDA
   events' span of the step and the GPU-busy time (the union of the step's kernel intervals from
   ``torch.profiler``, CUDA activity only), and busy / wall.

Output: ``$OUT/gpu_check.log`` (the running log), ``$OUT/<section>.json`` (rewritten after
every check), ``$OUT/summary.json`` and the summary table printed last; a result line in
``$OUT/gpu_check.jsonl`` (benchmarks/results' format). Exit status 1 when a check failed or a
section raised.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "benchmarks", "gpu_check_assets")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ABSENT_ON_DEVICE = ("pydantic", "fastapi", "zmq", "msgpack", "gguf", "llguidance")
SECTIONS = ("a", "b", "c", "d")
SECTION_NAMES = {"a": "a_kernel", "b": "b_correctness", "c": "c_throughput", "d": "d_step_time"}
# seconds per section on the GPU; the overall deadline (default 285 s from start) cuts them short
BUDGET_S = {"a": 45.0, "b": 80.0, "c": 110.0, "d": 40.0}

T0 = time.time()  # the run's start (a section process gets the parent's, --t0)
LOG_PATH: str | None = None


def log(msg: str = "") -> None:
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    print(line, flush=True)
    if LOG_PATH:
        with open(LOG_PATH, "a") as fh:
            fh.write(line + "\n")


def write_json(path: str, payload) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, default=str)
    os.replace(tmp, path)


# -- the environment --------------------------------------------------------------------------
def ensure_xxhash() -> str:
    """Import xxhash, from the carried wheel (unpacked to a temp folder) where it is missing."""
    try:
        import xxhash  # noqa: F401

        return "installed"
    except ImportError:
        pass
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = platform.machine()
    wheels = [
        f
        for f in sorted(os.listdir(os.path.join(ASSETS, "wheels")))
        if f.startswith("xxhash-") and f"-{tag}-" in f and machine in f
    ]
    if not wheels:
        raise RuntimeError(f"xxhash is not installed and no carried wheel fits {tag} {machine}")
    dest = tempfile.mkdtemp(prefix="gpu_check_wheels.")
    with zipfile.ZipFile(os.path.join(ASSETS, "wheels", wheels[0])) as z:
        z.extractall(dest)
    sys.path.insert(0, dest)
    import xxhash  # noqa: F401,F811

    return f"carried wheel {wheels[0]}"


def hide_absent_modules() -> None:
    """Make the packages the device machine lacks unimportable (``import`` raises ImportError,
    ``importlib.util.find_spec`` answers None), as they are there."""
    for name in ABSENT_ON_DEVICE:
        if name in sys.modules and sys.modules[name] is not None:
            raise RuntimeError(f"{name} was imported before the check started")
        sys.modules[name] = None  # type: ignore[assignment]


def patch_triton_interpreter_for_numpy() -> None:
    """Triton 3.6's interpreter with NumPy >= 2.4 (which refuses ``int()`` of 1-element arrays):
    the upstream fix (triton-lang/triton#9171), as tests/model/test_triton_attention.py applies it."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_gpu_check_patched", False):
        return

    def patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._gpu_check_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


# -- the record of a section --------------------------------------------------------------------
class Section:
    def __init__(self, key: str, out_dir: str, deadline: float, smoke: bool, device) -> None:
        self.key, self.name = key, SECTION_NAMES[key]
        self.path = os.path.join(out_dir, self.name + ".json")
        self.deadline, self.smoke, self.device = deadline, smoke, device
        self.started = time.time()
        self.checks: list[dict] = []
        self.data: dict = {}
        self.status = "running"
        self.save()

    def left(self) -> float:
        return self.deadline - time.time()

    def check(self, name: str, status: str, detail: str = "", **figures) -> None:
        """status: pass / fail / skip / info / partial / error."""
        self.checks.append({"check": name, "status": status, "detail": detail, **figures})
        log(f"  [{self.key}] {name}: {status.upper()} {detail}")
        self.save()

    def save(self) -> None:
        write_json(
            self.path,
            {
                "section": self.name,
                "status": self.status,
                "elapsed_s": round(time.time() - self.started, 2),
                "smoke": self.smoke,
                "checks": self.checks,
                "data": self.data,
            },
        )

    def finish(self, status: str | None = None) -> None:
        if status is None:
            states = {c["status"] for c in self.checks}
            status = "error" if "error" in states else "fail" if "fail" in states else "pass" if states & {"pass", "info", "partial"} else "skip"
        self.status = status
        self.save()


# -- random-weight models -----------------------------------------------------------------------
def model_config(kind: str, size: str):
    import transformers

    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-6)
    if kind == "qwen3-0.6b":  # Qwen/Qwen3-0.6B's shape
        return transformers.Qwen3Config(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            **common,
        )
    if kind == "qwen3-0.6b-smoke":  # its vocabulary (larger than the tokenizer's), tiny otherwise
        return transformers.Qwen3Config(
            vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True, **common,
        )
    small = size == "gpu"
    hidden, inter, layers = (512, 1024, 4) if small else (128, 256, 2)
    if kind == "llama":  # GQA 4, head_dim 64
        return transformers.LlamaConfig(
            vocab_size=49152, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False, **common,
        )
    if kind == "qwen3":  # GQA 3, head_dim 128, q/k norms, tied embeddings
        return transformers.Qwen3Config(
            vocab_size=49152, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=6,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True, **common,
        )
    raise ValueError(kind)


def build_model(kind: str, size: str, path: str, device, dtype, widen: float = 1.0, seed: int = 0):
    """A random-weight model made on ``device`` in ``dtype``, saved to ``path`` (safetensors +
    the carried tokenizer files); returns the model (eval mode)."""
    import torch
    import transformers

    config = model_config(kind, size)
    cls = transformers.Qwen3ForCausalLM if config.model_type == "qwen3" else transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = cls(config)
    except Exception:  # a transformers that does not build under a device context
        model = cls(config).to(device)
    model = model.to(dtype).eval()
    if widen != 1.0:  # random init gives near-uniform logits; widened, greedy choices are separated
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(widen)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(ASSETS, f), os.path.join(path, f))
    return model


def free(*objs) -> None:
    import torch

    for o in objs:
        engine = getattr(o, "llm_engine", None)
        core = getattr(engine, "core", None)
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                pass
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- a. the kernel -----------------------------------------------------------------------------
def make_case(query_lens, ctx_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, int8=False, seed=0, device="cpu"):
    """A flat batch and its paged cache, as tests/model/test_triton_attention.py's ``make_case``
    (built on the CPU, moved to ``device``): block tables drawn from a shuffled pool, unowned
    slots NaN (NaN scales in the int8 cache)."""
    import torch

    from pagedserve.ops import kv_int8

    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    nblk = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seq_lens), max(nblk) + 1, dtype=torch.int32)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, (n, L) in enumerate(zip(nblk, seq_lens)):
        ids, perm = perm[:n], perm[n:]
        table[i, :n] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(L)
        owned[torch.tensor(ids)[pos // block_size], pos % block_size] = True
    kv = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=g)
    if int8:
        cache = torch.zeros(kv_int8.cache_shape(num_blocks, num_kv_heads, block_size, head_dim), dtype=torch.int8)
        for i in range(2):
            values, scales = kv_int8.split(cache[i], block_size, head_dim)
            qv, sc = kv_int8.quantize(kv[i])
            values.copy_(qv)
            scales.copy_(torch.where(owned[:, None, :], sc, torch.nan))
    else:
        cache = torch.where(owned[None, :, None, :, None], kv, torch.nan).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    return (query.to(device), cache.to(device), table.to(device), starts.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device))


def reference(query, kv_cache, block_tables, query_lens, ctx_lens, block_size, scale):
    """float64 causal attention of each sequence's new tokens to its gathered K/V (on the CPU)."""
    import torch

    from pagedserve.ops import kv_int8

    head_dim, num_heads = query.shape[2], query.shape[1]
    if kv_cache.dtype == torch.int8:
        parts = [kv_int8.split(kv_cache[i].cpu(), block_size, head_dim) for i in range(2)]
        kv = torch.stack([v.double() * s.double()[..., None] for v, s in parts])
    else:
        kv = kv_cache.cpu().double()
    q_all, tables = query.cpu().double(), block_tables.cpu().long()
    out = torch.empty(query.shape, dtype=torch.float64)
    t = 0
    for i, (ql, cl) in enumerate(zip(query_lens, ctx_lens)):
        L = ql + cl
        ids = tables[i, : -(-L // block_size)]
        k, v = (kv[j][ids].permute(0, 2, 1, 3).reshape(-1, kv.shape[2], head_dim)[:L] for j in range(2))
        rep = num_heads // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        q = q_all[t : t + ql]
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        allowed = torch.arange(L)[None, :] <= (cl + torch.arange(ql))[:, None]
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        out[t : t + ql] = torch.einsum("hqk,khd->qhd", p, v)
        t += ql
    return out


def section_kernel(sec: Section) -> None:
    import torch

    cuda = sec.device.type == "cuda"
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (set at start in smoke runs)
    try:
        import triton
    except ImportError:
        sec.check("triton", "skip", "triton is not installed")
        return
    if not cuda:
        patch_triton_interpreter_for_numpy()
    from pagedserve.model.backends import triton_attention as ta

    sec.data["triton"] = triton.__version__
    sec.data["mode"] = "compiled" if cuda else "interpreter"
    mixed = ([1, 1, 1, 21, 9], [5, 17, 40, 0, 23])  # decodes after 5/17/40; a fresh 21-token prompt; 9 after 23
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
    cases = []
    if cuda:  # bf16 (what the engine runs) in full first, then fp16's main cases
        long_dec = ([1, 1, 1], [1500, 2600, 70])
        rng = random.Random(1)
        dec64 = ([1] * 64, [rng.randint(100, 1000) for _ in range(64)])
        for dt in (torch.bfloat16, torch.float16):
            bf16 = dt == torch.bfloat16
            for qpk, hd in ((1, 64), (3, 64), (4, 64), (1, 128), (3, 128), (4, 128)):
                if bf16 or (qpk, hd) in ((1, 64), (4, 128)):
                    cases.append((f"mixed gqa{qpk} d{hd}", mixed, 2 * qpk, 2, hd, dt, False, 16, None))
            cases.append(("mixed int8 cache d128", mixed, 16, 8, 128, dt, True, 16, None))
            cases.append(("split-KV decode (auto)", long_dec, 8, 2, 128, dt, False, 16, None))
            cases.append(("qwen3-0.6b 64 decodes", dec64, 16, 8, 128, dt, False, 16, None))
            if bf16:
                cases.append(("mixed int8 cache d64", mixed, 6, 2, 64, dt, True, 16, None))
                cases.append(("split-KV decode x1", long_dec, 8, 2, 128, dt, False, 16, 1))
                cases.append(("split-KV int8", long_dec, 8, 2, 128, dt, True, 16, None))
                cases.append(("prefill 600 + chunk 200@400", ([600, 200, 1], [0, 400, 900]), 16, 8, 128, dt, False, 16, None))
                cases.append(("block 32 d80", ([1, 6], [30, 11]), 4, 1, 80, dt, False, 32, None))
    else:
        for dt in (torch.float32, torch.float16):
            cases.append(("mixed gqa3 d64", mixed, 6, 2, 64, dt, False, 16, None))
        cases.append(("mixed int8 cache", mixed, 6, 2, 64, torch.float32, True, 16, None))
        sec.check("bf16 cases", "skip", "bf16 is checked compiled on a GPU only (the interpreter computes it on raw bits)")
    for name, (qlens, clens), H, KVH, D, dt, int8, bs, splits in cases:
        label = f"{name} {str(dt).replace('torch.', '')}"
        if sec.left() < 2:
            sec.check(label, "skip", "section budget spent")
            continue
        try:
            case = make_case(qlens, clens, H, KVH, D, dt, bs, int8, device=sec.device)
            query, cache, table, starts, seq_lens = case
            out = torch.full_like(query, float("nan"))
            t = time.perf_counter()
            ta.triton_paged_attention(query, cache, table, starts, seq_lens, D**-0.5, out, bs, max(qlens), int(max(q + c for q, c in zip(qlens, clens))), num_splits=splits)
            sync(sec.device)
            ms = 1e3 * (time.perf_counter() - t)
            unwritten = int(out.isnan().any(-1).any(-1).sum())
            ref = reference(query, cache, table, qlens, clens, bs, D**-0.5)
            err = float((out.double().cpu() - ref).abs().nan_to_num(float("inf")).max())
            ok = unwritten == 0 and err <= tol[dt] * (1 + float(ref.abs().max()))
            sec.check(label, "pass" if ok else "fail", f"max abs err {err:.2e} (tol {tol[dt]:.0e}), {unwritten} rows NaN, first call {ms:.0f} ms", max_abs_err=err)
        except Exception as e:
            sec.check(label, "error", f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


# -- b. correctness ----------------------------------------------------------------------------
def prompt_set(n_tokens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in n_tokens]


def hf_greedy(model, prompt: list[int], n: int, device) -> tuple[list[int], list]:
    """HF's greedy tokens by hand (a forward with the cache per token, argmax, EOS not special)
    and the float32 logits of every step."""
    import torch

    toks, logits = [], []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(n):
            row = out.logits[0, -1].float()
            tok = int(row.argmax())
            toks.append(tok)
            logits.append(row.cpu())
            out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return toks, logits


def run_llm(llm, prompts, max_tokens, logprobs: int = 5, prompt_logprobs=None):
    from pagedserve import SamplingParams

    mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=logprobs, prompt_logprobs=prompt_logprobs) for m in mts]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _top(entry_or_logits, k=5):
    """[(token, value)] best first, from a pagedserve logprobs entry or a logits row."""
    if isinstance(entry_or_logits, dict):
        return sorted(((t, lp.logprob) for t, lp in entry_or_logits.items()), key=lambda x: -x[1])[:k]
    v, i = entry_or_logits.topk(k)
    return list(zip(i.tolist(), v.tolist()))


def compare_tokens(ref_toks, ref_tops, got_toks, got_tops) -> dict:
    """Where two greedy runs part: the index, both tokens, the reference's top-2 gap there and
    whether each side's token is in the other's top 5 (a near-tie)."""
    n = min(len(ref_toks), len(got_toks))
    for i in range(n):
        if ref_toks[i] != got_toks[i]:
            rt, gt = _top(ref_tops[i]), _top(got_tops[i]) if got_tops is not None else []
            gap = rt[0][1] - rt[1][1] if len(rt) > 1 else None
            cross = got_toks[i] in [t for t, _ in rt] and (not gt or ref_toks[i] in [t for t, _ in gt])
            return {"equal": False, "at": i, "ref_token": ref_toks[i], "got_token": got_toks[i], "ref_top2_gap": gap, "near_tie": bool(cross)}
    if len(ref_toks) != len(got_toks):
        return {"equal": False, "at": n, "lengths": [len(ref_toks), len(got_toks)], "near_tie": False}
    return {"equal": True}


def judge_runs(sec: Section, name: str, ref, got, extra: str = "", **figures) -> None:
    """ref / got: lists of (tokens, tops) per prompt. pass: all equal; partial: every parting
    at a near-tie; fail otherwise."""
    res = [compare_tokens(r[0], r[1], g[0], g[1]) for r, g in zip(ref, got)]
    equal = sum(r["equal"] for r in res)
    parted = [dict(prompt=i, **r) for i, r in enumerate(res) if not r["equal"]]
    if not parted:
        status, detail = "pass", f"{equal}/{len(res)} prompts equal"
    else:
        status = "partial" if all(p["near_tie"] for p in parted) else "fail"
        p = parted[0]
        gap = f"{p['ref_top2_gap']:.4f}" if p.get("ref_top2_gap") is not None else "?"
        detail = (
            f"{equal}/{len(res)} equal; first parting: prompt {p['prompt']} token {p['at']} "
            f"({p.get('ref_token')} vs {p.get('got_token')}, ref top-2 gap {gap}, near-tie {p['near_tie']})"
        )
    sec.check(name, status, (detail + (" " + extra if extra else "")).strip(), partings=parted, **figures)


def ps_runs(outs):
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def section_correctness(sec: Section, tmp: str) -> None:
    import torch

    from pagedserve.config import EngineConfig

    dev, smoke = sec.device, sec.smoke
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    lens = [5, 17, 64, 128, 200, 333, 480, 600]
    prompts = prompt_set(lens, seed=1)
    pre_prompts = prompt_set([40] * 8, seed=2)
    n_out = 8 if smoke else 32
    max_len = 640 if smoke else 1024
    kv_bytes = (64 << 20) if smoke else (512 << 20)
    sec.data.update(prompt_lens=lens, output_tokens=n_out)
    has_eager_flag = "enforce_eager" in getattr(EngineConfig, "__dataclass_fields__", {})
    from pagedserve import LLM

    for kind in ("llama", "qwen3"):
        if sec.left() < 5:
            sec.check(f"{kind}: remaining checks", "skip", "section budget spent")
            continue
        path = os.path.join(tmp, f"b-{kind}")
        model = build_model(kind, "smoke" if smoke else "gpu", path, dev, torch.float32, widen=4.0, seed=11)
        # 1. greedy against HF, float32
        hf = [hf_greedy(model, p, n_out, dev) for p in prompts]
        llm = LLM(path, dtype="float32", max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, max_num_seqs=8)
        base_outs = run_llm(llm, prompts, n_out)
        base = ps_runs(base_outs)
        if kind == "llama":  # the plain run of the preemption workload
            pre_base = ps_runs(run_llm(llm, pre_prompts, 64))
        judge_runs(sec, f"{kind}: greedy = HF float32 (TF32 off)", hf, base)
        # 2. a prefix hit: the same prompts again on the warm engine
        again = run_llm(llm, prompts, n_out)
        cached = sum(o.num_cached_tokens for o in again)
        judge_runs(sec, f"{kind}: prefix-cache hit", base, ps_runs(again), f"({cached} prompt tokens from the cache)", cached_tokens=cached)
        if cached == 0:
            sec.check(f"{kind}: prefix-cache hit happened", "fail", "no prompt token came from the cache")
        free(llm)
        llm = None
        free()
        if kind == "llama" and sec.left() > 5:  # chunked prefill and preemption on one architecture
            llm = LLM(path, dtype="float32", max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False)
            judge_runs(sec, f"{kind}: chunked prefill (64-token steps)", base, ps_runs(run_llm(llm, prompts, n_out)))
            free(llm)
            llm = None
            free()
            # 8 prompts of 40 tokens are admitted into 40 blocks (3 each); growing to 104 tokens
            # (7 blocks each) they no longer fit, and some are preempted and recomputed
            llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=40, max_num_seqs=8, enable_prefix_caching=False)
            outs = run_llm(llm, pre_prompts, 64)
            pre = llm.llm_engine.get_stats().num_preemptions
            judge_runs(sec, f"{kind}: preemption (40 KV blocks, 8 x 104 tokens)", pre_base, ps_runs(outs), f"({pre} preemptions)", preemptions=pre)
            if pre == 0:
                sec.check(f"{kind}: preemption happened", "fail", "no preemption: the pool was large enough")
            free(llm)
            llm = None
            free()
        if kind == "qwen3" and sec.left() > 5:
            llm = LLM(path, dtype="float32", max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, max_num_seqs=8, kv_cache_dtype="int8")
            judge_runs(sec, f"{kind}: int8 KV cache", base, ps_runs(run_llm(llm, prompts, n_out)))
            free(llm)
            llm = None
            free()
        if kind == "qwen3" and sec.left() > 5:  # bf16 prompt logprobs against HF's log_softmax
            llm = LLM(path, dtype="bfloat16", max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, max_num_seqs=8)
            outs = run_llm(llm, prompts, 1, logprobs=None, prompt_logprobs=0)
            free(llm)
            llm = None
            free()
            model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
            d_bf16, d_fp32, hf_own = 0.0, 0.0, 0.0
            with torch.inference_mode():
                for p, o in zip(prompts, outs):
                    if len(p) < 2:
                        continue
                    ids = torch.tensor([p], device=dev)
                    tgt = torch.tensor(p[1:])
                    ref32 = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).cpu().gather(1, tgt[:, None])[:, 0]
                    ref16 = torch.log_softmax(model_bf16(input_ids=ids).logits[0, :-1].float(), -1).cpu().gather(1, tgt[:, None])[:, 0]
                    got = torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))], dtype=torch.float32)
                    d_bf16 = max(d_bf16, float((got - ref16).abs().max()))
                    d_fp32 = max(d_fp32, float((got - ref32).abs().max()))
                    hf_own = max(hf_own, float((ref16 - ref32).abs().max()))
            ok = d_fp32 <= 2 * hf_own + 0.05
            sec.check(
                f"{kind}: bf16 prompt_logprobs vs HF log_softmax",
                "pass" if ok else "fail",
                f"max abs diff {d_bf16:.4f} vs HF bf16, {d_fp32:.4f} vs HF fp32 (HF bf16 itself: {hf_own:.4f} vs fp32; pass: <= 2x that + 0.05)",
                max_abs_diff_vs_hf_bf16=d_bf16, max_abs_diff_vs_hf_fp32=d_fp32, hf_bf16_vs_fp32=hf_own,
            )
            del model_bf16
        # CUDA graphs against eager, decode batches shrinking 8 -> 1 (padded graph sizes): float32
        # first (equal means equal), then bf16 (the dtype graphs run in) where time is left
        for gdtype in ("float32", "bfloat16"):
            name = f"{kind}: CUDA graph replay = eager ({gdtype})"
            if kind != "qwen3" or sec.left() < 8:
                if kind == "qwen3":
                    sec.check(name, "skip", "section budget spent")
                continue
            if not has_eager_flag:
                sec.check(name, "skip", "not available (EngineConfig has no enforce_eager)")
                break
            if dev.type != "cuda":
                sec.check(name, "skip", "needs CUDA")
                break
            mts = [8 + 4 * i for i in range(len(prompts))]
            runs, graph_attrs = {}, {}
            for eager in (True, False):
                llm = LLM(path, dtype=gdtype, max_model_len=max_len, kv_cache_memory_bytes=kv_bytes, max_num_seqs=8, enforce_eager=eager)
                runs[eager] = ps_runs(run_llm(llm, prompts, mts))
                if not eager:
                    runner = llm.llm_engine.core.worker.model_runner
                    graph_attrs = {a: _describe(getattr(runner, a)) for a in dir(runner) if "graph" in a.lower() and not a.startswith("__")}
                free(llm)
                llm = None
                free()
            judge_runs(sec, name, runs[True], runs[False], graph_runner_attrs=graph_attrs)
        del model
        free()


def _describe(v) -> str:
    if callable(v):
        return "method"
    try:
        return f"{type(v).__name__} len {len(v)}"
    except TypeError:
        return f"{type(v).__name__} {str(v)[:60]}"


# -- c. throughput -----------------------------------------------------------------------------
def qwen_dir(sec: Section, tmp: str) -> str:
    """The random Qwen3-0.6B-shaped model (bf16), built once for sections c and d."""
    import torch

    kind = "qwen3-0.6b-smoke" if sec.smoke else "qwen3-0.6b"
    path = os.path.join(tmp, kind)
    if not os.path.exists(path):  # made by an earlier section's process, else here
        t = time.perf_counter()
        model = build_model(kind, "", path + ".part", sec.device, torch.bfloat16, seed=3)
        n = sum(p.numel() for p in model.parameters())
        del model
        free()
        os.rename(path + ".part", path)
        log(f"  built {kind} ({n / 1e6:.0f} M parameters) in {time.perf_counter() - t:.1f} s")
    return path


def matmul_peak(device, dtype, seconds: float, n: int) -> float:
    """Best FLOP/s of an [n x n] @ [n x n] matmul in ``dtype``."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, end = 0.0, time.perf_counter() + seconds
    with torch.inference_mode():
        for _ in range(2):
            a @ b
        sync(device)
        while time.perf_counter() < end:
            t = time.perf_counter()
            for _ in range(5):
                a @ b
            sync(device)
            best = max(best, 5 * 2.0 * n**3 / (time.perf_counter() - t))
    return best


def run_pagedserve_workload(engine, requests, deadline: float) -> dict:
    """Every request submitted at once, steps until done or ``deadline``; counts output tokens
    (finished requests' and, at the deadline, the running ones')."""
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams

    ids, done = [], {}
    t0 = time.perf_counter()
    for r in requests:
        sp = SamplingParams(max_tokens=r.expected_output_len, temperature=0.0, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        ids.append(engine.add_request(None, {"prompt_token_ids": r.prompt_token_ids}, sp))
    steps, cut = 0, False
    while engine.has_unfinished_requests():
        if time.time() > deadline:
            cut = True
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
    cached = sum(o.num_cached_tokens for o in done.values())
    if cut:
        out_tokens += sum(r.num_output_tokens for r in engine.core.scheduler.requests.values())
        engine.abort_request(ids)
    return {"elapsed_s": elapsed, "output_tokens": out_tokens, "finished": len(done), "steps": steps, "cut_at_deadline": cut, "cached_tokens": cached}


def hf_generate_batch(model, pad_id: int, batch, device, deadline: float) -> int:
    """One static batch, left padded, EOS suppressed (``min_new_tokens``), stopped at ``deadline``;
    returns the tokens made per row (pagedserve.bench.hf_backend's, with a deadline)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Deadline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            stop = time.time() > deadline
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    max_len = max(r.prompt_len for r in batch)
    max_new = max(r.expected_output_len for r in batch)
    input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for i, r in enumerate(batch):
        input_ids[i, max_len - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
        mask[i, max_len - r.prompt_len :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, pad_token_id=pad_id, use_cache=True, stopping_criteria=StoppingCriteriaList([Deadline()]),
        )
    sync(device)
    return int(out.shape[1] - max_len)


def load_hf_model(path: str, dtype, device):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except TypeError:  # a transformers before the dtype argument
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def section_throughput(sec: Section, tmp: str) -> None:
    import torch

    from pagedserve import LLM
    from pagedserve.bench.datasets import SampleRequest, describe, sample_random
    from pagedserve.bench.flops import measure_matmul_flops, model_flops
    from pagedserve.model import loader

    dev, smoke, cuda = sec.device, sec.smoke, sec.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n_req, lo, hi, hf_bs = (8, 8, 24, 4) if smoke else (256, 100, 1024, 64)
    path = qwen_dir(sec, tmp)
    hf_config = loader.load_config(path)
    tok = loader.load_tokenizer(path)
    try:
        requests = sample_random(tok, n_req, (lo, hi), (lo, hi), seed=0)
        source = "text windows (bench datasets random)"
    except Exception as e:  # no text corpus on this Python: random ids, same lengths
        rng = random.Random(0)
        requests = [SampleRequest([rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))], "", rng.randint(lo, hi)) for _ in range(n_req)]
        source = f"random ids ({type(e).__name__})"
    flops = model_flops(hf_config)
    in_tok, out_tok = sum(r.prompt_len for r in requests), sum(r.expected_output_len for r in requests)
    sec.data.update(workload=describe(requests), prompt_source=source, prompt_tokens=in_tok, output_tokens_requested=out_tok,
                    model_flops_params=flops.as_dict(), dtype=str(dtype).replace("torch.", ""))
    peak_big = matmul_peak(dev, dtype, 0.5 if smoke else 2.0, 512 if smoke else 8192)
    peak_model = measure_matmul_flops(hf_config.hidden_size, hf_config.intermediate_size, dtype, dev, seconds=0.3 if smoke else 1.0)
    sec.data.update(peak_matmul_flops=peak_big, peak_model_shaped_flops=peak_model)
    sec.check("matmul rate", "info", f"{peak_big / 1e12:.1f} TFLOP/s ({'512' if smoke else '8192'}^3), model-shaped {peak_model / 1e12:.1f} TFLOP/s")

    def figures(elapsed, out_tokens, prompt_tokens, forward_tokens):
        mf = flops.flops(forward_tokens, out_tokens)
        return {
            "elapsed_s": elapsed, "output_tok_s": out_tokens / elapsed, "total_tok_s": (prompt_tokens + out_tokens) / elapsed,
            "achieved_flops_per_s": mf / elapsed, "mfu": mf / elapsed / peak_big, "mfu_vs_model_shaped": mf / elapsed / peak_model,
        }

    # pagedserve
    ps_budget = 0.55 * sec.left()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    llm = LLM(path, dtype=str(dtype).replace("torch.", ""), max_model_len=2048 if not smoke else 256, max_num_seqs=None if not smoke else 8,
              **({} if cuda else {"kv_cache_memory_bytes": 64 << 20}))
    engine = llm.llm_engine
    start_s = time.perf_counter() - t
    warm = SampleRequest(list(reversed(requests[0].prompt_token_ids[-16:])), "", 4)
    run_pagedserve_workload(engine, [warm], time.time() + 60)
    engine.reset_prefix_cache()
    before = engine.get_stats().num_preemptions
    res = run_pagedserve_workload(engine, requests, time.time() + ps_budget)
    res["num_preemptions"] = engine.get_stats().num_preemptions - before
    res["num_kv_blocks"] = engine.core.info.num_blocks
    res["kv_block_bytes"] = engine.core.info.block_bytes
    res["max_num_seqs"] = engine.config.max_num_seqs
    res["max_num_batched_tokens"] = engine.config.max_num_batched_tokens
    res["engine_start_s"] = start_s
    res["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    fwd = in_tok - res["cached_tokens"] + res["output_tokens"] - res["finished"]
    res.update(figures(res["elapsed_s"], res["output_tokens"], in_tok if not res["cut_at_deadline"] else 0, fwd))
    sec.data["pagedserve"] = res
    free(llm)
    llm = engine = None
    free()  # the engine's KV cache (most of the GPU) goes before HF loads
    mem = f", max allocated {res['max_memory_allocated_gib']:.1f} GiB" if cuda else ""
    sec.check(
        "pagedserve", "partial" if res["cut_at_deadline"] else "info",
        f"{res['output_tok_s']:.0f} out tok/s, {res['total_tok_s']:.0f} total tok/s, MFU {100 * res['mfu']:.1f}% "
        f"({res['elapsed_s']:.1f} s, {res['steps']} steps, {res['num_kv_blocks']} KV blocks, {res['num_preemptions']} preemptions{mem})"
        + (" CUT AT THE BUDGET" if res["cut_at_deadline"] else ""),
    )
    # HF generate, static batches, as many whole batches as the budget allows
    if sec.left() < 10:
        sec.check("hf", "skip", "section budget spent")
        return
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = load_hf_model(path, dtype, dev)
    pad = 2
    hf_generate_batch(model, pad, [SampleRequest(requests[0].prompt_token_ids[:16], "", 2)], dev, time.time() + 60)
    hf_deadline = sec.deadline - 3
    batches, made, useful, prompt_t, fwd, elapsed, last = 0, 0, 0, 0, 0, 0.0, 0.0
    for i in range(0, len(requests), hf_bs):
        batch = requests[i : i + hf_bs]
        if batches and time.time() + 1.1 * last > hf_deadline:
            break
        t = time.perf_counter()
        rows = hf_generate_batch(model, pad, batch, dev, hf_deadline)
        last = time.perf_counter() - t
        elapsed += last
        full = rows >= max(r.expected_output_len for r in batch)
        batches += 1
        made += rows * len(batch)
        useful += sum(min(rows, r.expected_output_len) for r in batch)
        prompt_t += sum(r.prompt_len for r in batch)
        fwd += sum(r.prompt_len + min(rows, r.expected_output_len) - 1 for r in batch)
        if not full:
            break
    hf = {"batches": batches, "of_batches": -(-len(requests) // hf_bs), "hf_batch_size": hf_bs, "useful_output_tokens": useful,
          "generated_incl_padding_rows": made, "last_batch_cut": not full,
          "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    hf.update(figures(elapsed, useful, prompt_t, fwd))
    sec.data["hf"] = hf
    del model
    free()
    ratio = res["output_tok_s"] / hf["output_tok_s"]
    sec.data["ratio_output_tok_s"] = ratio
    mem = f", max allocated {hf['max_memory_allocated_gib']:.1f} GiB" if cuda else ""
    sec.check("hf generate (static 64)" if not smoke else "hf generate", "partial" if hf["last_batch_cut"] else "info",
              f"{hf['output_tok_s']:.0f} out tok/s, MFU {100 * hf['mfu']:.1f}% over {batches}/{hf['of_batches']} batches ({elapsed:.1f} s{mem})")
    sec.check("pagedserve / hf output tok/s", "info" if smoke else "pass" if ratio >= 4 else "fail",
              f"{ratio:.2f}x (target >= 4x)", ratio=ratio)


# -- d. decode step time -----------------------------------------------------------------------
def gpu_busy_ms(prof, steps: int) -> float:
    """Per step: the union of the GPU activity intervals (kernels, copies, memsets) a profile holds."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / 1e3 / steps


def measure_decode(engine, batch: int, prompt_len: int, steps: int, prof_steps: int, device) -> dict:
    import torch

    from pagedserve.sampling_params import SamplingParams

    rng = random.Random(batch)
    ids = []
    for _ in range(batch):
        p = [rng.randrange(100, 49000) for _ in range(prompt_len)]
        ids.append(engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True, detokenize=False)))
    sched = engine.core.scheduler
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    cuda = device.type == "cuda"
    walls, spans = [], []
    for _ in range(steps):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t = time.perf_counter()
        engine.step()
        if cuda:
            e1.record()
            e1.synchronize()
            spans.append(e0.elapsed_time(e1))
        walls.append(1e3 * (time.perf_counter() - t))
    res = {"batch": batch, "prompt_len": prompt_len, "steps": steps, "wall_ms": statistics.median(walls), "wall_ms_min": min(walls)}
    res["tok_s"] = batch / (res["wall_ms"] / 1e3)
    if cuda:
        res["event_span_ms"] = statistics.median(spans)
        try:
            from torch.profiler import ProfilerActivity, profile

            # CUDA activity alone (least overhead); with CPU activity too where that recorded nothing
            for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                with profile(activities=activities) as prof:
                    t = time.perf_counter()
                    for _ in range(prof_steps):
                        engine.step()
                    sync(device)
                    prof_wall = 1e3 * (time.perf_counter() - t) / prof_steps
                res["gpu_busy_ms"] = gpu_busy_ms(prof, prof_steps)
                res["profiled_activities"] = [str(a).split(".")[-1] for a in activities]
                if res["gpu_busy_ms"] > 0:
                    break
            if res["gpu_busy_ms"] <= 0:
                raise RuntimeError("the profiler recorded no GPU activity")
            res["wall_ms_while_profiled"] = prof_wall
            res["busy_share"] = res["gpu_busy_ms"] / res["wall_ms"]
        except Exception as e:
            res["gpu_busy_error"] = f"{type(e).__name__}: {e}"
    engine.abort_request(ids)
    engine.step()
    return res


def section_step_time(sec: Section, tmp: str) -> None:
    from pagedserve import LLM
    from pagedserve.config import EngineConfig

    dev, smoke, cuda = sec.device, sec.smoke, sec.device.type == "cuda"
    path = qwen_dir(sec, tmp)
    batches = [1, 4] if smoke else [1, 64, 256]
    steps, prof_steps, prompt_len = (3, 2, 16) if smoke else (20, 10, 128)
    modes = [("eager", True)]
    if "enforce_eager" in getattr(EngineConfig, "__dataclass_fields__", {}):
        if cuda:
            modes.append(("graphs", False))
        else:
            sec.check("graphs", "skip", "CUDA graphs need CUDA")
    else:
        sec.check("graphs", "skip", "not available (EngineConfig has no enforce_eager)")
    if not cuda:
        sec.check("GPU busy share", "skip", "needs CUDA (the CPU run times the loop only)")
    rows = []
    for mode, eager in modes:
        if sec.left() < 8:
            sec.check(mode, "skip", "section budget spent")
            continue
        kw = {"kv_cache_memory_bytes": (8 << 30) if cuda else (32 << 20), "max_num_seqs": max(batches), "max_model_len": 1024 if cuda else 128,
              "enable_prefix_caching": False, "dtype": "bfloat16" if cuda else "float32"}
        if len(modes) > 1 or not eager:
            kw["enforce_eager"] = eager
        llm = LLM(path, **kw)
        for b in batches:
            if sec.left() < 4:
                sec.check(f"{mode} batch {b}", "skip", "section budget spent")
                continue
            r = measure_decode(llm.llm_engine, b, prompt_len, steps, prof_steps, dev)
            r["mode"] = mode
            rows.append(r)
            sec.data["rows"] = rows
            if "busy_share" in r:
                detail = f"wall {r['wall_ms']:.2f} ms, event span {r['event_span_ms']:.2f} ms, GPU busy {r['gpu_busy_ms']:.2f} ms = {100 * r['busy_share']:.0f}% of the step, {r['tok_s']:.0f} tok/s"
            elif cuda:
                detail = f"wall {r['wall_ms']:.2f} ms, event span {r.get('event_span_ms', float('nan')):.2f} ms ({r.get('gpu_busy_error')})"
            else:
                detail = f"wall {r['wall_ms']:.2f} ms (CPU)"
            status = "info"
            if cuda and mode == "graphs" and b == 64 and "busy_share" in r:
                status = "pass" if r["busy_share"] >= 0.9 else "fail"
                detail += " (target >= 90%)"
            sec.check(f"{mode} batch {b}", status, detail, **{k: v for k, v in r.items() if isinstance(v, (int, float))})
        free(llm)
        llm = None
        free()


# -- the run -----------------------------------------------------------------------------------
def run_section(args) -> int:
    """One section in this process (the parent runs each in its own, so a CUDA fault or a hang
    costs that section only)."""
    global LOG_PATH, T0
    T0 = args.t0
    LOG_PATH = os.path.join(args.out, "gpu_check.log")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # the kernel module must see it at import
        hide_absent_modules()
    wheel = ensure_xxhash()
    import torch

    device = torch.device("cuda" if not args.smoke else "cpu")
    sec = Section(args.section, args.out, args.deadline_at, args.smoke, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sec.check("section", "error", "no CUDA device (run with --cpu-smoke on a CPU)")
        sec.finish("error")
        return 2
    env = {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda, "xxhash": wheel,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "pid": os.getpid(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError as e:
        env["transformers"] = f"missing ({e})"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    sec.data["env"] = env
    if not os.path.exists(os.path.join(args.out, "environment.json")):
        write_json(os.path.join(args.out, "environment.json"), env)
        log(f"environment: {json.dumps(env)}")
    funcs = {"a": section_kernel, "b": section_correctness, "c": section_throughput, "d": section_step_time}
    try:
        if args.section == "a":
            section_kernel(sec)
        else:
            funcs[args.section](sec, args.tmp)
        sec.finish()
    except Exception as e:
        sec.data["error"] = f"{type(e).__name__}: {e}"
        sec.data["traceback"] = traceback.format_exc()
        log(sec.data["traceback"])
        sec.check("section", "error", f"{type(e).__name__}: {e}")
        sec.finish("error")
    return 0


def load_section(out: str, key: str) -> dict:
    try:
        with open(os.path.join(out, SECTION_NAMES[key] + ".json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {"section": SECTION_NAMES[key], "status": "running", "checks": [], "data": {}}


def summary_rows(results: list[dict]) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in results:
        if not r["checks"]:
            rows.append((r["section"], "-", r["status"], r["data"].get("reason", "")))
        for c in r["checks"]:
            rows.append((r["section"], c["check"], c["status"], c["detail"]))
    return rows


def format_table(rows) -> str:
    rows = [("section", "check", "status", "detail")] + rows
    w0, w1, w2 = (max(len(r[i]) for r in rows) for i in range(3))
    lines = [f"{a.ljust(w0)} | {b.ljust(w1)} | {c.ljust(w2)} | {d}" for a, b, c, d in rows]
    lines.insert(1, "-" * min(200, w0 + w1 + w2 + 40))
    return "\n".join(lines)


def main() -> int:
    global LOG_PATH
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", "--tiny", dest="smoke", action="store_true", help="tiny sizes on the CPU; sections that need CUDA are skipped")
    ap.add_argument("--only", default="a,b,c,d", help="sections to run, e.g. a,b")
    ap.add_argument("--deadline-s", type=float, default=None, help="overall deadline from start (seconds; default 285, none in a smoke run)")
    ap.add_argument("--out", default=None, help="results folder (default: $OUT, else a new temporary folder)")
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # a section process (the parent starts them)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.section:
        return run_section(args)
    out = args.out or os.environ.get("OUT")
    scratch_out = out is None and args.smoke  # a smoke run's own folder goes when it ends
    out = os.path.abspath(out or tempfile.mkdtemp(prefix="gpu_check."))
    os.makedirs(out, exist_ok=True)
    LOG_PATH = os.path.join(out, "gpu_check.log")
    if args.deadline_s is None:
        args.deadline_s = 1e9 if args.smoke else 285.0
    overall = T0 + args.deadline_s
    log(f"gpu_check: out {out}, deadline {args.deadline_s:.0f} s, smoke {args.smoke}")
    tmp = tempfile.mkdtemp(prefix="gpu_check_models.")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    wanted = [k for k in SECTIONS if k in args.only.split(",")]
    results = []
    try:
        for key in wanted:
            now = time.time()
            name = SECTION_NAMES[key]
            if overall - now < 10:
                res = {"section": name, "status": "skip", "checks": [], "data": {"reason": "overall deadline reached before it started"}}
                write_json(os.path.join(out, name + ".json"), res)
                results.append(res)
                log(f"== {name}: skipped (overall deadline)")
                continue
            budget = BUDGET_S[key] if not args.smoke else 600.0
            deadline = min(now + budget, overall)
            log(f"== {name} (budget {deadline - now:.0f} s)")
            cmd = [sys.executable, os.path.abspath(__file__), "--section", key, "--out", out, "--tmp", tmp, "--deadline-at", repr(deadline), "--t0", repr(T0)]
            if args.smoke:
                cmd.append("--cpu-smoke")
            how = None
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(10.0, deadline - now) + 30)
                if proc.returncode != 0:
                    how = f"the section process exited {proc.returncode}"
            except subprocess.TimeoutExpired:
                how = "the section process ran 30 s past its budget and was killed"
            res = load_section(out, key)
            if how is not None or res["status"] == "running":
                res["checks"].append({"check": "section process", "status": "error", "detail": how or "ended without finishing"})
                res["status"] = "error"
                write_json(os.path.join(out, name + ".json"), res)
                log(f"  [{key}] section process: ERROR {how}")
            results.append(res)
            log(f"== {name}: {res['status']} in {time.time() - now:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = summary_rows(results)
    states = [r[2] for r in rows] + [r["status"] for r in results]
    ok = not any(x in ("fail", "error") for x in states)
    summary = {"ok": ok, "elapsed_s": time.time() - T0, "sections": {r["section"]: r["status"] for r in results},
               "checks": {f"{r[0]}: {r[1]}": r[2] for r in rows}}
    write_json(os.path.join(out, "summary.json"), summary)
    log("summary (results in " + out + "):\n" + format_table(rows))
    try:
        from pagedserve.bench import results as bench_results

        if not args.smoke and not os.environ.get(bench_results.ENV):
            os.environ[bench_results.ENV] = out  # the result line comes back with $OUT
        figures = {"sections": summary["sections"], "checks": summary["checks"]}
        by = {r["section"]: r for r in results}
        if "c_throughput" in by:
            figures["throughput"] = {k: by["c_throughput"]["data"].get(k) for k in ("pagedserve", "hf", "ratio_output_tok_s", "peak_matmul_flops")}
        if "d_step_time" in by:
            figures["step_time"] = by["d_step_time"]["data"].get("rows")
        device = next((r["data"]["env"]["device"] for r in results if "env" in r.get("data", {})), None)
        bench_results.record("gpu_check", figures, tiny=args.smoke, extra={"device": device})
    except Exception as e:
        log(f"result line not written: {type(e).__name__}: {e}")
    n_skip = sum(r[2] == "skip" for r in rows)
    log(f"done in {time.time() - T0:.1f} s: " + ("no check failed" if ok else "SOME CHECKS FAILED OR RAISED") + f" ({n_skip} skipped)")
    if scratch_out:
        LOG_PATH = None
        shutil.rmtree(out, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
