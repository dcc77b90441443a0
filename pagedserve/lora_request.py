"""A request's LoRA adapter (vLLM's ``LoRARequest``) and the identity its KV is cached under.

``LoRARequest(lora_name, lora_int_id, lora_path)``: ``lora_name`` is what clients send as
``model``, ``lora_int_id`` a positive integer unique per adapter in one engine, ``lora_path`` a
PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``). The prefix cache keys a
request's first block by :func:`adapter_digest` (the adapter's files, so an adapter reloaded
under the same name with other weights never meets KV of the old one); two requests of the same
adapter share KV, two adapters never do. Torch-free: the engine core imports this.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass
from typing import Optional

import xxhash

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_LORA_INT_ID = 2**31 - 1  # ids are small ints (vLLM's); steps carry them as int64


@dataclass
class LoRARequest:
    """One LoRA adapter a request runs with (vLLM's shape).

    Attributes:
        lora_name: the adapter's name (the API's ``model``): not blank, no whitespace at either
            end, no control characters, no ``/``.
        lora_int_id: its id in the engine, 1 to 2**31 - 1 (0 and None mean the base model in vLLM).
        lora_path: the PEFT adapter folder.
        base_model_name: the model the adapter was trained on, if the client says (logged
            when it differs from the served model; shapes decide whether it fits).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if self.lora_name != self.lora_name.strip():
            raise ValueError(f"lora_name must not begin or end with whitespace, got {self.lora_name!r}")
        if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in self.lora_name) or "/" in self.lora_name:
            raise ValueError(f"lora_name must not hold control characters or '/', got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or not 1 <= self.lora_int_id <= MAX_LORA_INT_ID:
            raise ValueError(f"lora_int_id must be an integer from 1 to {MAX_LORA_INT_ID}, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {type(self.lora_path).__name__}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def adapter_digest(path: str) -> str:
    """xxh3-128 hex of the adapter's config and weights files (what its KV is cached under).

    Raises:
        ValueError: the folder or either file is missing or unreadable.
    """
    h = xxhash.xxh3_128()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            raise ValueError(f"LoRA adapter {path!r}: cannot read {name} ({e.strerror or e})") from None
        h.update(b"\0")
    return h.hexdigest()


def parse_lora_modules(values: Optional[list]) -> list[LoRARequest]:
    """``--lora-modules`` (vLLM's forms): ``name=path`` or a JSON object ``{"name", "path",
    "base_model_name"}``; ids are given in order from 1.

    Raises:
        ValueError: a malformed entry or a name given twice.
    """
    import json

    out: list[LoRARequest] = []
    for i, v in enumerate(values or [], start=1):
        if isinstance(v, dict):
            obj = v
        elif isinstance(v, str) and v.lstrip().startswith("{"):
            try:
                obj = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {v!r} is not valid JSON: {e}") from None
        elif isinstance(v, str) and "=" in v:
            name, _, p = v.partition("=")
            obj = {"name": name.strip(), "path": p.strip()}
        else:
            raise ValueError(f"--lora-modules entries are name=path or a JSON object with name and path, got {v!r}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules: {v!r} needs a name and a path")
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: unknown key(s) {', '.join(sorted(unknown))} in {v!r}")
        if any(r.lora_name == obj["name"] for r in out):
            raise ValueError(f"--lora-modules: the name {obj['name']!r} is given twice")
        out.append(LoRARequest(obj["name"], i, obj["path"], obj.get("base_model_name")))
    return out


def first_block_extra_keys(cache_salt: Optional[str], lora_key: Optional[str]) -> Optional[bytes]:
    """The extra bytes of a request's first block hash: its cache salt and its adapter's digest
    (None with neither)."""
    if not cache_salt and not lora_key:
        return None
    return (cache_salt or "").encode() + (b"\0lora:" + lora_key.encode() if lora_key else b"")
