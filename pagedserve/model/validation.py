"""Checks on model files before anything is allocated from them.

Every reader here reads only headers, never tensor data, and sizes nothing from a header field
before that field was checked against the file: a dimension is bounded, a tensor's byte size
must lie inside the file, a count can only be walked as far as the file has bytes for it. What
fails is a :class:`ModelFileError`, a ``ValueError`` whose text is one line, ``<file>: <what is
wrong>``, which the CLI prints as is (no traceback) and ``LLM(...)`` raises.

The pieces, for any loader (HF folders, GGUF conversion; LoRA adapters and quantized
tensors later):

- :func:`read_safetensors_header`: a ``*.safetensors`` file's tensor table, checked as the
  safetensors library would (known dtype, byte size = shape x dtype, contiguous offsets that
  cover the data exactly) and bounded (header at most 100 MB, dims at most ``MAX_DIM``).
- :func:`read_gguf_header`: a GGUF file's metadata and tensor table (known ggml type, at most 4
  dims, data aligned and inside the file, no two tensors overlapping).
- :func:`check_config`: config.json fields with the right types and sane ranges
  (:func:`check_gguf_metadata`: the same for the GGUF metadata transformers makes a config of).
- :func:`check_weights`: each checkpoint tensor has a float dtype, and its name and shape are
  exactly what the config describes (the model's own ``load_weights`` runs on meta tensors, so
  the rule is the one the real load applies, with nothing allocated).
- :func:`validate_model_dir`: all of the above for an HF folder (remembered per file state).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

# -- limits: far above any real checkpoint, far below what would exhaust memory -----------------
MAX_JSON_BYTES = 64 << 20  # config.json, generation_config.json
SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors library's own limit
MAX_DIM = 1 << 40  # one tensor dimension
MAX_NDIM = 8  # safetensors; GGUF allows 4 (GGML_MAX_DIMS)
MAX_NAME_BYTES = 1 << 12  # a tensor or metadata key name
MAX_LAYERS = 1 << 12
MAX_HIDDEN = 1 << 18
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_POSITIONS = 1 << 24
MAX_ROPE_TABLE = 1 << 30  # max_position_embeddings x head_dim (the RoPE table is 8 bytes each)
# GGUF entries walked one by one in Python: real files have ~1000 tensors, ~50 metadata keys and
# string arrays of at most a few 100k items (vocabulary, merges).
MAX_GGUF_TENSORS = 1 << 20
MAX_GGUF_KV = 1 << 16
MAX_GGUF_STRINGS = 1 << 24

# Weights pagedserve loads (copied into float parameters); other dtypes are not a weight.
FLOAT_WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")

# safetensors dtype -> bits per element (every dtype the format defines).
SAFETENSORS_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


# The model types pagedserve's model implementation runs (pagedserve.model.llama).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ModelFileError(ValueError):
    """A model file that is unreadable, malformed, or does not match its config.

    ``str(e)`` is one line: ``<path>: <what is wrong>``; ``e.path`` and ``e.what`` hold the parts.
    """

    def __init__(self, path: str, what: Optional[str] = None) -> None:
        if what is None:  # rebuilt from its message alone (e.g. unpickled)
            path, _, what = str(path).partition(": ")
        what = " ".join(str(what).split())  # one line, whatever the cause's text held
        if len(what) > 500:
            what = what[:497] + "..."
        self.path, self.what = str(path), what
        super().__init__(f"{path}: {what}")

    def __reduce__(self):
        return (type(self), (self.path, self.what))


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: names and values from a file may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(e: BaseException) -> str:
    """An exception from a library as one short clause (its type and first line)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_shape(path: str, name: str, shape: Any, max_ndim: int = MAX_NDIM) -> tuple[int, ...]:
    """A tensor shape from a header: a list of at most ``max_ndim`` ints in [0, MAX_DIM]."""
    if not isinstance(shape, (list, tuple)) or len(shape) > max_ndim:
        raise ModelFileError(path, f"tensor {short(name)}: shape {short(shape)} is not a list of at most {max_ndim} dimensions")
    for d in shape:
        if not _is_int(d) or not 0 <= d <= MAX_DIM:
            raise ModelFileError(path, f"tensor {short(name)}: dimension {short(d)} of shape {short(shape)} is not an integer in [0, 2**40]")
    return tuple(shape)


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise ModelFileError(path, f"cannot read: {e.strerror or e}") from None


# -- safetensors ----------------------------------------------------------------------------------
class TensorSpec(NamedTuple):
    """One checkpoint tensor as a header describes it (``start``/``end``: byte offsets in
    ``path``; a GGUF tensor's ``dtype`` is its ggml type name)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    start: int = 0
    end: int = 0


def read_safetensors_header(path: str) -> dict[str, TensorSpec]:
    """The tensors of a ``.safetensors`` file, checked; no tensor data is read.

    Raises:
        ModelFileError: truncated file, header length past the end, a header that is not a JSON
            object, unknown dtype, bad shape, byte size not matching shape x dtype, offsets
            outside the file, overlapping or not covering the data exactly.
    """
    size = _file_size(path)
    if size < 8:
        raise ModelFileError(path, f"file is {size} bytes, too short for a safetensors header (truncated?)")
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            raise ModelFileError(
                path, f"safetensors header length {n} runs past the end of the file ({size} bytes): truncated or not a safetensors file"
            )
        if n > SAFETENSORS_MAX_HEADER:
            raise ModelFileError(path, f"safetensors header length {n} is over the {SAFETENSORS_MAX_HEADER} byte limit")
        raw = fh.read(n)
    if len(raw) != n:
        raise ModelFileError(path, "file shrank while being read")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFileError(path, f"safetensors header is not valid JSON ({describe(e)}): corrupt or not a safetensors file") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, f"safetensors header is a JSON {type(header).__name__}, not an object")
    data_start, data_len = 8 + n, size - 8 - n
    specs: dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ModelFileError(path, "safetensors __metadata__ is not a map of strings")
            continue
        if len(name.encode("utf-8", "replace")) > MAX_NAME_BYTES:
            raise ModelFileError(path, f"tensor name {short(name)} is over {MAX_NAME_BYTES} bytes")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ModelFileError(path, f"tensor {short(name)}: entry {short(entry)} needs exactly dtype, shape and data_offsets")
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
            raise ModelFileError(path, f"tensor {short(name)}: unknown dtype {short(dtype)}")
        shape = check_shape(path, name, entry["shape"])
        offsets = entry["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ModelFileError(path, f"tensor {short(name)}: data_offsets {short(offsets)} is not a pair of integers")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise ModelFileError(path, f"tensor {short(name)}: data_offsets {short(offsets)} are not an increasing pair")
        if end > data_len:
            raise ModelFileError(
                path, f"tensor {short(name)}: data [{begin}, {end}) runs past the end of the file ({data_len} data bytes): truncated?"
            )
        bits = math.prod(shape) * SAFETENSORS_BITS[dtype]
        if bits % 8 or bits // 8 != end - begin:
            raise ModelFileError(
                path, f"tensor {short(name)}: shape {list(shape)} of {dtype} needs {bits / 8:g} bytes, its data_offsets hold {end - begin}"
            )
        specs[name] = TensorSpec(name, dtype, shape, path, data_start + begin, data_start + end)
    pos = data_start
    for spec in sorted(specs.values(), key=lambda s: (s.start, s.end)):
        if spec.start != pos:
            what = "overlaps the tensor before it" if spec.start < pos else f"leaves a gap of {spec.start - pos} bytes before it"
            raise ModelFileError(path, f"tensor {short(spec.name)}: data {what} (corrupt offsets)")
        pos = spec.end
    if pos != size:
        raise ModelFileError(path, f"the tensors' data ends at byte {pos} but the file has {size} bytes (trailing bytes or a bad header)")
    return specs


# -- GGUF -------------------------------------------------------------------------------------------
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # v1 counted in 32 bits; nothing in use still writes it
GGUF_MAX_DIMS = 4
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class GGUFArray(NamedTuple):
    """A metadata array, summarized (its items are not kept)."""

    item_type: int
    count: int


class GGUFHeader(NamedTuple):
    path: str
    version: int
    metadata: dict[str, Any]  # scalars and strings as values, arrays as GGUFArray
    tensors: dict[str, TensorSpec]  # dtype: the ggml type's name; shape in GGUF order (ne[0] first)
    alignment: int
    data_start: int


class _Cursor:
    """Bounds-checked little-endian reads over a read-only buffer."""

    def __init__(self, path: str, buf, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ModelFileError(
                self.path, f"GGUF header truncated: {what} at byte {self.pos} needs {n} bytes, the file has {self.size - self.pos} left"
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, keep: bool = True, limit: Optional[int] = None) -> Optional[str]:
        n = self.unpack("<Q", f"{what} length")
        if limit is not None and n > limit:
            raise ModelFileError(self.path, f"GGUF {what} at byte {self.pos - 8} is {n} bytes long (limit {limit})")
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        if not keep:
            return None
        try:
            return bytes(self.buf[start : self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, f"GGUF {what} at byte {start} is not UTF-8") from None


def _gguf_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _GGUF_SCALARS:
        return cur.unpack(_GGUF_SCALARS[vtype], f"value of {short(key)}")
    if vtype == _GGUF_STRING:
        return cur.string(f"value of {short(key)}")
    if vtype != _GGUF_ARRAY:
        raise ModelFileError(cur.path, f"GGUF metadata {short(key)} has unknown value type {vtype}")
    itype = cur.unpack("<I", f"array type of {short(key)}")
    count = cur.unpack("<Q", f"array length of {short(key)}")
    if itype in _GGUF_SCALARS:
        cur.need(count * struct.calcsize(_GGUF_SCALARS[itype]), f"{count} array items of {short(key)}")
        cur.pos += count * struct.calcsize(_GGUF_SCALARS[itype])
    elif itype == _GGUF_STRING:
        if count > MAX_GGUF_STRINGS:
            raise ModelFileError(cur.path, f"GGUF metadata {short(key)} claims {count} strings (limit {MAX_GGUF_STRINGS})")
        cur.need(count * 8, f"{count} array strings of {short(key)}")  # each is at least its length
        for _ in range(count):
            cur.string(f"array item of {short(key)}", keep=False)
    else:
        raise ModelFileError(cur.path, f"GGUF metadata {short(key)} is an array of unsupported type {itype}")
    return GGUFArray(itype, count)


def read_gguf_header(path: str) -> GGUFHeader:
    """A GGUF file's metadata and tensor table, checked; no tensor data is read. Work and memory
    are bounded by the file's size, whatever its counts say.

    Raises:
        ModelFileError: not GGUF, unsupported version or byte order, truncated header, bad
            metadata type, a tensor with a bad type or dims, misaligned or running past the end of
            the file, or overlapping another.
    """
    import gguf

    size = _file_size(path)
    if size < 24:
        raise ModelFileError(path, f"file is {size} bytes, too short for a GGUF header (truncated?)")
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(path, buf, size)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ModelFileError(path, f"not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.unpack("<I", "version")
        if version & 0xFFFF == 0 and version:
            raise ModelFileError(path, "big-endian GGUF files are not supported")
        if version not in GGUF_VERSIONS:
            raise ModelFileError(path, f"GGUF version {version} is not supported (supported: {GGUF_VERSIONS})")
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "metadata count")
        # Each entry takes at least 13 (metadata) / 24 (tensor) bytes: a count past that is a lie.
        if n_kv * 13 > size - cur.pos or n_tensors * 24 > size - cur.pos or n_kv > MAX_GGUF_KV or n_tensors > MAX_GGUF_TENSORS:
            raise ModelFileError(
                path,
                f"GGUF header counts ({n_kv} metadata entries, {n_tensors} tensors) do not fit in a {size} byte file "
                f"(or are over the limits of {MAX_GGUF_KV} and {MAX_GGUF_TENSORS})",
            )
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key", limit=MAX_NAME_BYTES)
            vtype = cur.unpack("<I", f"type of {short(key)}")
            if key in metadata:
                raise ModelFileError(path, f"GGUF metadata key {short(key)} appears twice")
            metadata[key] = _gguf_value(cur, vtype, key)
        infos = []
        for _ in range(n_tensors):
            name = cur.string("tensor name", limit=MAX_NAME_BYTES)
            n_dims = cur.unpack("<I", f"dims of tensor {short(name)}")
            if not 1 <= n_dims <= GGUF_MAX_DIMS:
                raise ModelFileError(path, f"tensor {short(name)} has {n_dims} dimensions (1 to {GGUF_MAX_DIMS} allowed)")
            dims = [cur.unpack("<Q", f"dims of tensor {short(name)}") for _ in range(n_dims)]
            ggml_type = cur.unpack("<I", f"type of tensor {short(name)}")
            offset = cur.unpack("<Q", f"offset of tensor {short(name)}")
            infos.append((name, dims, ggml_type, offset))
        header_end = cur.pos
    alignment = metadata.get("general.alignment", 32)
    if "general.alignment" in metadata and not (_is_int(alignment) and 0 < alignment <= 1 << 20 and alignment & (alignment - 1) == 0):
        raise ModelFileError(path, f"GGUF general.alignment {short(alignment)} is not a power of two")
    data_start = -(-header_end // alignment) * alignment
    tensors: dict[str, TensorSpec] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise ModelFileError(path, f"tensor {short(name)} appears twice")
        check_shape(path, name, dims, GGUF_MAX_DIMS)
        try:
            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(path, f"tensor {short(name)} has unknown ggml type {ggml_type}") from None
        if dims[0] % block:
            raise ModelFileError(path, f"tensor {short(name)}: first dimension {dims[0]} is not a multiple of {qtype.name}'s block of {block}")
        nbytes = math.prod(dims) // block * type_size
        if offset % alignment:
            raise ModelFileError(path, f"tensor {short(name)}: data offset {offset} is not aligned to {alignment} bytes")
        start = data_start + offset
        if start + nbytes > size:
            raise ModelFileError(
                path, f"tensor {short(name)}: data ({nbytes} bytes at byte {start}) runs past the end of the file ({size} bytes): truncated?"
            )
        tensors[name] = TensorSpec(name, qtype.name, tuple(dims), path, start, start + nbytes)
    prev: Optional[TensorSpec] = None
    for spec in sorted(tensors.values(), key=lambda s: (s.start, s.end)):
        if prev is not None and spec.start < prev.end and spec.end > spec.start:
            raise ModelFileError(path, f"tensors {short(prev.name)} and {short(spec.name)} overlap in the file (corrupt offsets)")
        if spec.end > spec.start:
            prev = spec
    return GGUFHeader(path, version, metadata, tensors, alignment, data_start)


# -- config ---------------------------------------------------------------------------------------
# name: (lowest, highest); None means "not given" wherever transformers has a default.
_CONFIG_INTS = {
    "vocab_size": (1, MAX_VOCAB),
    "hidden_size": (1, MAX_HIDDEN),
    "intermediate_size": (1, MAX_INTERMEDIATE),
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_HEADS),
    "num_key_value_heads": (1, MAX_HEADS),
    "head_dim": (2, MAX_HEAD_DIM),
    "max_position_embeddings": (1, MAX_POSITIONS),
    "sliding_window": (1, MAX_POSITIONS),
    "max_window_layers": (0, MAX_LAYERS),
}
_CONFIG_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_CONFIG_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SUPPORTED_ACTIVATIONS = ("silu", "swish")


def read_json(path: str, what: str = "JSON file") -> Any:
    """A small JSON file (at most ``MAX_JSON_BYTES``), parsed."""
    size = _file_size(path)
    if size > MAX_JSON_BYTES:
        raise ModelFileError(path, f"{what} is {size} bytes, over the {MAX_JSON_BYTES} byte limit")
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read(MAX_JSON_BYTES + 1).decode("utf-8"))
    except OSError as e:
        raise ModelFileError(path, f"cannot read: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFileError(path, f"{what} is not valid JSON ({describe(e)})") from None


def check_config(path: str, cfg: Mapping[str, Any]) -> None:
    """Types and ranges of the config fields pagedserve's model reads (``cfg``: config.json
    parsed, or a transformers config's ``to_dict()``); ``path`` names the file in errors.

    Raises:
        ModelFileError: a field of the wrong type or out of range, an unsupported model_type or
            activation, heads that do not divide, a quantized checkpoint.
    """
    if not isinstance(cfg, Mapping):
        raise ModelFileError(path, f"config is a JSON {type(cfg).__name__}, not an object")

    def bad(field: str, value: Any, want: str) -> ModelFileError:
        return ModelFileError(path, f"config field {field}={short(value)} {want}")

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise bad("model_type", model_type, "is not a string (supported: " + ", ".join(SUPPORTED_MODEL_TYPES) + ")")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise bad("model_type", model_type, "is not supported (supported: " + ", ".join(SUPPORTED_MODEL_TYPES) + ")")
    if cfg.get("quantization_config") is not None:
        q = cfg["quantization_config"]
        method = q.get("quant_method") if isinstance(q, Mapping) else q
        raise bad("quantization_config", method, "is set: quantized checkpoints are not supported")
    for field, (lo, hi) in _CONFIG_INTS.items():
        v = cfg.get(field)
        if v is not None and (not _is_int(v) or not lo <= v <= hi):
            raise bad(field, v, f"is not an integer in [{lo}, {hi}]")
    for field in _CONFIG_BOOLS:
        v = cfg.get(field)
        if v is not None and not isinstance(v, bool):
            raise bad(field, v, "is not true or false")
    for field in _CONFIG_TOKEN_IDS:
        v = cfg.get(field)
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(_is_int(i) and -1 <= i < (1 << 31) for i in ids):  # -1: "none" in old configs
            raise bad(field, v, "is not a token id (or a list of them)")
    eps = cfg.get("rms_norm_eps")
    if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1):
        raise bad("rms_norm_eps", eps, "is not a number in (0, 1)")
    act = cfg.get("hidden_act")
    if act is not None and act not in SUPPORTED_ACTIVATIONS:
        raise bad("hidden_act", act, "is not supported (supported: " + ", ".join(SUPPORTED_ACTIVATIONS) + ")")
    rope = [cfg]
    for field in ("rope_parameters", "rope_scaling"):
        v = cfg.get(field)
        if v is not None and not isinstance(v, Mapping):
            raise bad(field, v, "is not an object")
        if v is not None:
            rope.append(v)
    for where in rope:
        theta = where.get("rope_theta")
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < 1e15):
            raise bad("rope_theta", theta, "is not a positive number")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise bad("layer_types", layer_types, "is not a list of strings")
    # Cross-field rules (the defaults transformers fills in for absent fields are consistent).
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelFileError(path, f"config num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    hidden, head_dim = cfg.get("hidden_size"), cfg.get("head_dim")
    if head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            raise ModelFileError(path, f"config hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and head_dim is not given)")
        head_dim = hidden // heads
    if head_dim is not None and head_dim % 2:
        raise bad("head_dim", head_dim, "is odd (RoPE needs an even head_dim)")
    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None and head_dim is not None and max_pos * head_dim > MAX_ROPE_TABLE:
        raise ModelFileError(
            path, f"config max_position_embeddings={max_pos} x head_dim={head_dim} is over {MAX_ROPE_TABLE} (the RoPE table would not fit in memory)"
        )


# GGUF metadata (after "<architecture>.") -> the config field transformers makes of it.
GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}


def check_gguf_metadata(header: GGUFHeader) -> None:
    """The model metadata of a GGUF file, checked as :func:`check_config` checks config.json,
    before transformers builds a config from it.

    Raises:
        ModelFileError: an unsupported architecture, or a field of the wrong type or range.
    """
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(header.path, f"GGUF general.architecture {short(arch)} is missing or not a string")
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(header.path, f"GGUF architecture {short(arch)} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    fields: dict[str, Any] = {"model_type": arch}
    for suffix, field in GGUF_CONFIG_KEYS.items():
        key = f"{arch}.{suffix}"
        if key in header.metadata:
            fields[field] = header.metadata[key]
            try:
                check_config(header.path, {"model_type": arch, field: fields[field]})
            except ModelFileError as e:
                raise ModelFileError(header.path, f"GGUF metadata {key}: {e.what}") from None
    try:
        check_config(header.path, fields)
    except ModelFileError as e:
        raise ModelFileError(header.path, f"GGUF metadata: {e.what}") from None


# -- checkpoint vs config ---------------------------------------------------------------------------
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
# (config_path, hf_config, tensors) -> None, raising ModelFileError: the model's own name and shape check.
ShapeCheck = Callable[[str, Any, Mapping[str, "TensorSpec"]], None]


def check_weights(config_path: str, hf_config, tensors: Mapping[str, TensorSpec], shape_check: Optional[ShapeCheck] = None) -> None:
    """Every tensor is a float weight and there are weights for exactly the config's layers;
    then ``shape_check`` (``pagedserve.model.llama.check_checkpoint``: the model built on torch's
    meta device, its own ``load_weights`` over meta tensors of these shapes) checks every name
    and shape against the config, where given. ``config_path`` names the config in errors.

    Raises:
        ModelFileError: naming the weight file (a wrong dtype, an unexpected name, a shape that
            differs from the config's) or the config (layer count, missing weights).
    """
    for spec in tensors.values():
        if spec.dtype not in FLOAT_WEIGHT_DTYPES:
            raise ModelFileError(
                spec.path, f"tensor {short(spec.name)} has dtype {spec.dtype}; weights must be one of " + ", ".join(FLOAT_WEIGHT_DTYPES)
            )
    layers = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    n_layers = len(layers) and max(layers) + 1
    if hf_config.num_hidden_layers != n_layers:
        raise ModelFileError(
            config_path, f"config num_hidden_layers={hf_config.num_hidden_layers} but the checkpoint has weights for {n_layers} layers"
        )
    # Dimensions the RoPE table (built on the CPU even under the meta device) needs bounded.
    check_config(config_path, {k: getattr(hf_config, k, None) for k in ("model_type", "hidden_size", "num_attention_heads", "head_dim")})
    if shape_check is not None:
        shape_check(config_path, hf_config, tensors)


# -- an HF folder -----------------------------------------------------------------------------------
_validated: dict[tuple, tuple] = {}


def _state(paths: Iterable[str]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((p, None, None))
    return tuple(out)


def validate_model_dir(model_dir: str, load_config: Optional[Callable[[str], Any]] = None, shape_check: Optional[ShapeCheck] = None) -> None:
    """Check an HF model folder's config.json and weight headers against each other before
    anything is allocated from them; remembered until one of those files changes. Without
    ``shape_check`` (a process without torch: a server front) the names and shapes against the
    config are left to the engine core, which checks them before loading.

    Args:
        load_config: ``model_dir -> transformers config`` (default: AutoConfig, local files only).
        shape_check: the model's name and shape check (see :func:`check_weights`), or None.

    Raises:
        ModelFileError: naming the file and what is wrong with it.
    """
    import glob

    cfg_path = os.path.join(model_dir, "config.json")
    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    key = (os.path.abspath(model_dir), shape_check is not None)
    state = _state([cfg_path, *files])
    if _validated.get(key) == state:
        return
    check_config(cfg_path, read_json(cfg_path, "config.json"))
    if load_config is None:
        from transformers import AutoConfig

        def load_config(d: str):
            return AutoConfig.from_pretrained(d, local_files_only=True)

    try:
        hf_config = load_config(model_dir)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(cfg_path, f"transformers cannot read it ({describe(e)})") from None
    if not files:
        raise ModelFileError(model_dir, "no *.safetensors weight files in this folder")
    tensors: dict[str, TensorSpec] = {}
    for f in files:
        for name, spec in read_safetensors_header(f).items():
            if name in tensors:
                raise ModelFileError(f, f"tensor {short(name)} is also in {tensors[name].path}")
            tensors[name] = spec
    check_weights(cfg_path, hf_config, tensors, shape_check)
    if len(_validated) > 64:
        _validated.clear()
    _validated[key] = state
