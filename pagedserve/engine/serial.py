"""msgpack encoding of the engine's messages: frontend <-> engine-core process today, and the
scheduler -> worker ``SchedulerOutput`` / ``ModelRunnerOutput`` pair for workers elsewhere.

Never pickle: a message is msgpack data, and the only objects decoding can build are the
dataclasses and enums registered here, from their field values by keyword (an unknown type tag
or field is an error, nothing is executed). Dataclasses travel as msgpack extension type 1
(``[type name, field values...]``), enums as type 2 (``[enum name, value]``), sets as type 3.
Tuples come back as lists.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack

from pagedserve.config import EngineConfig
from pagedserve.core.outputs import (
    EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, KVConnectorOutput, ModelRunnerOutput, SchedulerStats,
)
from pagedserve.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.distributed.kv_transfer.base import HoldSpec, KVConnectorMetadata, LoadSpec, ReleaseSpec
from pagedserve.engine.core import EngineCoreInfo
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

_EXT_DATACLASS, _EXT_ENUM, _EXT_SET = 1, 2, 3

_DATACLASSES: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
_ENUMS: dict[str, type] = {"RequestOutputKind": RequestOutputKind}


def register(cls: type) -> type:
    """Allow ``cls`` (a dataclass) in messages."""
    _DATACLASSES[cls.__name__] = cls
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls


for _cls in (EngineConfig, EngineCoreInfo, EngineCoreRequest, SamplingParams, EngineCoreOutput, EngineCoreOutputs, SchedulerStats,
             SchedulerOutput, NewRequestData, CachedRequestData, ModelRunnerOutput, StructuredOutputsParams, KVConnectorOutput,
             LoadSpec, HoldSpec, ReleaseSpec, KVConnectorMetadata):
    register(_cls)


def _default(obj: Any) -> Any:
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is not None:
        return msgpack.ExtType(_EXT_DATACLASS, _packb([cls.__name__, *(getattr(obj, n) for n in names)]))
    if isinstance(obj, enum.Enum) and _ENUMS.get(cls.__name__) is cls:
        return msgpack.ExtType(_EXT_ENUM, _packb([cls.__name__, obj.value]))
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(_EXT_SET, _packb(list(obj)))
    raise TypeError(f"cannot encode {cls.__name__} in an engine message")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_DATACLASS:
        name, *values = _unpackb(data)
        cls = _DATACLASSES.get(name)
        if cls is None:
            raise ValueError(f"unknown message type {name!r}")
        names = _FIELDS[cls]
        if len(values) != len(names):
            raise ValueError(f"{name}: expected {len(names)} fields, got {len(values)}")
        return cls(**dict(zip(names, values)))
    if code == _EXT_ENUM:
        name, value = _unpackb(data)
        if name not in _ENUMS:
            raise ValueError(f"unknown enum {name!r}")
        return _ENUMS[name](value)
    if code == _EXT_SET:
        return set(_unpackb(data))
    raise ValueError(f"unknown msgpack extension type {code}")


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(msg: Any) -> bytes:
    """Bytes of a message: msgpack values, lists, dicts and registered dataclasses/enums."""
    return _packb(msg)


def decode(data: bytes) -> Any:
    """The message ``encode`` made. Raises ValueError / TypeError on anything else."""
    return _unpackb(data)
