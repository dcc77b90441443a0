"""Config dataclasses given as a dict or its JSON text (``--kv-transfer-config``,
``--speculative-config``): one parser with vLLM-style errors. Torch-free."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

T = TypeVar("T")


def dataclass_from_value(cls: type[T], value: Any, name: str) -> T:
    """``cls`` from an instance of it, a dict or a JSON object's text; ``name`` is the field
    the errors name.

    Raises:
        ValueError: invalid JSON, not an object, or a key ``cls`` does not have (and whatever
            ``cls`` raises for its values).
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**value)
