"""A random-weight model with Llama-3.2-1B's layer shapes and SmolLM2's tokenizer, for issue 15's
target 5 (pagedserve vs llama.cpp at a size where the matmuls, not the Python step, dominate).

Shapes: hidden 2048, 16 layers, 32 query / 8 KV heads, head_dim 64, intermediate 8192, tied
embeddings, rope_theta 500000, RMSNorm eps 1e-5; SmolLM2's vocabulary (49152) and tokenizer
files (from pagedserve's default model). 1.07 B params (973 M in the decoder layers, 101 M in
the tied embedding), 2.15 GB in bf16. Weights: HF's own init (normal, std 0.02; norms 1) under
a fixed seed, built directly in bf16 (peak RSS ~2.7 GB, ~30 s), saved with ``save_pretrained``
(safetensors) next to the tokenizer. Greedy output of random weights is meaningless text; the
benchmarks ignore EOS, so every request still makes exactly the tokens asked for.

    .venv/bin/python benchmarks/build_1b_model.py [--out DIR] [--seed 0] [--gguf [--quantize Q4_K_M,Q8_0]]

``--gguf`` also writes ``DIR/model-bf16.gguf`` with llama.cpp's converter
(``benchmarks/llamacpp_setup.sh convert``); ``--quantize Q4_K_M,Q8_0`` (with ``--gguf``) then makes
``DIR/model-Q4_K_M.gguf`` etc. from it with ``llama-quantize`` (llama.cpp's default recipe per
type; for issue 48's gguf_quality.py and gguf_vs_llamacpp.py). Default DIR: ~/.cache/pagedserve-bench/llama-1b-shapes.
An existing complete DIR is reused (``--force`` rebuilds it). ``--tiny`` (a smoke run) builds the
same way a 2-layer, hidden-256 model into DIR-tiny (default ~/.cache/pagedserve-bench/llama-1b-shapes-tiny),
and with ``--gguf`` converts it only where llama.cpp's converter is already unpacked.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-bench", "llama-1b-shapes")
GGUF_NAME = "model-bf16.gguf"

SHAPES = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    hidden_act="silu",
    initializer_range=0.02,
)
ROPE_THETA = 500000.0


TINY = dict(SHAPES, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


def build(out: str, seed: int, shapes: dict = SHAPES, arch: str = "LlamaForCausalLM", extra_json: Optional[dict] = None,
          rope_theta: float = ROPE_THETA) -> str:
    """Write the model to ``out`` (atomically: a temp dir renamed at the end); returns ``out``.

    ``arch`` names the transformers class (``Qwen3MoeForCausalLM`` for moe_vs_llamacpp.py; its
    config class is ``<family>Config``), ``shapes`` its config's fields; ``extra_json``: keys
    written into config.json as well (e.g. the hub's spelling of a field transformers renames)."""
    import torch
    import transformers

    sys.path.insert(0, ROOT)
    from pagedserve.model import loader

    src = loader.resolve_model(None)  # SmolLM2's HF dir (converted from the packaged GGUF once)
    tok = loader.load_tokenizer(src)
    src_cfg = loader.load_config(src)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        vocab_size=src_cfg.vocab_size,
        bos_token_id=src_cfg.bos_token_id,
        eos_token_id=src_cfg.eos_token_id,
        pad_token_id=getattr(src_cfg, "pad_token_id", None),
        rope_theta=rope_theta,
        **shapes,
    )
    config.architectures = [arch]
    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # init straight into bf16: no fp32 copy (4.3 GB) in memory
    try:
        model = getattr(transformers, arch)(config)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"params: {n / 1e9:.3f} B ({n * 2 / 1e9:.2f} GB in bf16), seed {seed}")
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    tok.save_pretrained(tmp)
    for name in ("chat_template.jinja",):  # keep SmolLM2's own files where save_pretrained did not
        if os.path.exists(os.path.join(src, name)) and not os.path.exists(os.path.join(tmp, name)):
            shutil.copy(os.path.join(src, name), tmp)
    with open(os.path.join(tmp, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["architectures"] = [arch]
    cfg.update(extra_json or {})
    cfg.setdefault("rope_theta", rope_theta)  # older readers (and converters) look for it here
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    with open(os.path.join(tmp, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    with open(os.path.join(tmp, "build.json"), "w") as fh:
        json.dump({"seed": seed, "params": n, "tokenizer_from": src, "arch": arch, "shapes": shapes, "rope_theta": rope_theta}, fh, indent=2)
    open(os.path.join(tmp, ".complete"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def convert_gguf(model_dir: str) -> str:
    """BF16 GGUF of ``model_dir`` next to it, via llama.cpp's converter (the setup script)."""
    gguf = os.path.join(model_dir, GGUF_NAME)
    subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "llamacpp_setup.sh"), "convert", model_dir, gguf], check=True)
    return gguf


def quantize_gguf(model_dir: str, qtype: str, threads: int = 2) -> str:
    """``DIR/model-QTYPE.gguf`` from ``DIR/model-bf16.gguf`` with llama.cpp's ``llama-quantize``
    (``$LLAMACPP_CACHE/bin``, built by ``llamacpp_setup.sh build``); reused when it exists."""
    out = os.path.join(model_dir, f"model-{qtype}.gguf")
    if os.path.exists(out):
        return out
    cache = os.environ.get("LLAMACPP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve-llamacpp"))
    binary = os.path.join(cache, "bin", "llama-quantize")
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} not found: benchmarks/llamacpp_setup.sh build")
    subprocess.run(["nice", "-n", "10", binary, os.path.join(model_dir, GGUF_NAME), out + ".tmp", qtype, str(threads)], check=True)
    os.replace(out + ".tmp", out)
    return out


def _converter_unpacked() -> bool:
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "llamacpp_setup.sh"), "status"], capture_output=True, text=True)
    return out.returncode == 0 and "converter: present" in out.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="model directory to write (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", action="store_true", help=f"also write DIR/{GGUF_NAME} with llama.cpp's converter")
    ap.add_argument("--quantize", default=None, help="with --gguf: also llama-quantize it to these types (e.g. Q4_K_M,Q8_0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR is complete")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256, into DIR-tiny (smoke tests of the benchmark scripts only)")
    args = ap.parse_args()
    if args.tiny and args.out == DEFAULT_OUT:
        args.out = DEFAULT_OUT + "-tiny"  # never over the real model
    out = os.path.abspath(os.path.expanduser(args.out))
    if args.force or not os.path.exists(os.path.join(out, ".complete")):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        build(out, args.seed, TINY if args.tiny else SHAPES)
        print(f"model: {out}")
    else:
        print(f"model exists: {out}")
    if args.gguf and args.tiny and not _converter_unpacked():
        print("--tiny: llama.cpp's converter is not unpacked (benchmarks/llamacpp_setup.sh build): no GGUF")
    elif args.gguf:
        if args.force and os.path.exists(os.path.join(out, GGUF_NAME)):
            os.remove(os.path.join(out, GGUF_NAME))
        print(f"gguf: {convert_gguf(out)}")
        for qtype in (args.quantize or "").split(","):
            if qtype.strip():
                if args.force and os.path.exists(os.path.join(out, f"model-{qtype.strip()}.gguf")):
                    os.remove(os.path.join(out, f"model-{qtype.strip()}.gguf"))
                print(f"gguf: {quantize_gguf(out, qtype.strip())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
