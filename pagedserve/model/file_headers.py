"""Model files' headers, read before anything is allocated from them (torch-free).

Every reader here reads only headers, never tensor data, and sizes nothing from a header field
before that field was checked against the file: a dimension is bounded, a tensor's byte size
must lie inside the file, a count can only be walked as far as the file has bytes for it. What
fails is a :class:`ModelFileError`, a ``ValueError`` whose text is one line, ``<file>: <what is
wrong>``, which the CLI prints as is (no traceback) and ``LLM(...)`` raises.

- :func:`read_safetensors_header`: a ``*.safetensors`` file's tensor table, checked as the
  safetensors library would (known dtype, byte size = shape x dtype, contiguous offsets that
  cover the data exactly) and bounded (header at most 100 MB, dims at most ``MAX_DIM``).
- :func:`read_gguf_header`: a GGUF file's metadata and tensor table (known ggml type, at most 4
  dims, data aligned and inside the file, no two tensors overlapping).

:mod:`pagedserve.model.validation` checks what they read against the config.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Any, NamedTuple, Optional

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

# GGUF tensor types pagedserve loads: the float ones as they are, the quantized ones repacked into
# pagedserve's quantized layout (pagedserve.model.gguf_quant); a file with another type is refused.
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

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
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "gemma3")


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
