"""The messages between the engine's processes and their msgpack codec (vLLM v1's
``EngineCoreRequestType`` + ``serial_utils`` shape).

A message is a pair ``(type, payload)``: the type an enum member, the payload a registered
dataclass (or None where the type carries nothing). Three conversations:

* front -> engine core (:class:`EngineCoreRequestType`): ADD (:class:`AddRequest`, the ``n``
  sequences of one request together), ABORT (:class:`AbortRequests`), RELEASE_KV
  (:class:`ReleaseKV`, a refused request's prefill hold), UTILITY (:class:`UtilityCall`),
  SHUTDOWN (None);
* engine core -> front (:class:`EngineCoreEventType`): READY (:class:`EngineCoreInfo`), OUTPUTS
  (:class:`EngineCoreOutputs`, once per step), UTILITY (:class:`UtilityResult`), ERROR
  (:class:`CoreError`; the process then exits 1), and FAILED (:class:`SequencesFailed`, made by
  the data-parallel client itself when a replica dies under some sequences);
* TP rank 0 <-> ranks 1..N-1 (:class:`WorkerMessageType`): HELLO, INIT, READY, INIT_CACHE, STEP
  (a :class:`SchedulerOutput`), SHUTDOWN, ERROR.

Never pickle: decoding builds only the dataclasses and enums registered here, from their field
values by keyword (an unknown type tag or field is an error, nothing is executed). Dataclasses
travel as msgpack extension type 1 (``[type name, field values...]``), enums as type 2
(``[enum name, value]``), sets as type 3. Tuples come back as lists. :func:`check` tells a
well-formed message of one conversation from anything else (a receiver drops the rest).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional

from pagedserve.config import EngineConfig
from pagedserve.core.kv_connector import HoldSpec, KVConnectorMetadata, LoadSpec, ReleaseSpec
from pagedserve.core.outputs import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerStats,
)
from pagedserve.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class EngineCoreRequestType(enum.Enum):
    """What the front asks of the engine core."""

    ADD = "add"
    ABORT = "abort"
    RELEASE_KV = "release_kv"
    UTILITY = "utility"
    SHUTDOWN = "shutdown"


class EngineCoreEventType(enum.Enum):
    """What the engine core (or the data-parallel client) tells the front."""

    READY = "ready"
    OUTPUTS = "outputs"
    UTILITY = "utility"
    ERROR = "error"
    FAILED = "failed"


class WorkerMessageType(enum.Enum):
    """The control conversation of a tensor-parallel group (rank 0 with each other rank)."""

    HELLO = "hello"
    INIT = "init"
    READY = "ready"
    INIT_CACHE = "init_cache"
    STEP = "step"
    SHUTDOWN = "shutdown"
    ERROR = "error"


@dataclass
class AddRequest:
    requests: list  # [EngineCoreRequest]: the sequences of one request


@dataclass
class AbortRequests:
    request_ids: list  # [str]


@dataclass
class ReleaseKV:
    params: dict  # the kv_transfer_params naming a prefill instance's hold


@dataclass
class UtilityCall:
    """``name`` is one of the core's utilities (``reset_prefix_cache``, ``get_stats``,
    ``get_step_trace`` with ``[since_step, limit]``, ``get_block_map``)."""

    call_id: int
    name: str
    args: list


@dataclass
class UtilityResult:
    call_id: int
    result: Any
    error: Optional[str] = None


@dataclass
class CoreError:
    """A start-up error or a failed step: the exception's type name and message."""

    kind: str
    message: str


@dataclass
class SequencesFailed:
    request_ids: list  # [str] core sequences whose replica died
    reason: str


@dataclass
class WorkerHello:
    rank: int
    pid: int


@dataclass
class WorkerInit:
    """``store_spec``: the torch.distributed store's address, ``["file", path]`` or ``["tcp", host, port]``."""

    config: EngineConfig
    host: str
    store_spec: list


@dataclass
class WorkerReady:
    rank: int
    num_blocks: int  # the most KV blocks this rank can hold


@dataclass
class InitCache:
    config: EngineConfig
    num_blocks: int


@dataclass
class WorkerError:
    rank: int
    kind: str
    message: str


# Each type's payload class (None: no payload).
PAYLOADS: dict[enum.Enum, Optional[type]] = {
    EngineCoreRequestType.ADD: AddRequest,
    EngineCoreRequestType.ABORT: AbortRequests,
    EngineCoreRequestType.RELEASE_KV: ReleaseKV,
    EngineCoreRequestType.UTILITY: UtilityCall,
    EngineCoreRequestType.SHUTDOWN: None,
    EngineCoreEventType.READY: EngineCoreInfo,
    EngineCoreEventType.OUTPUTS: EngineCoreOutputs,
    EngineCoreEventType.UTILITY: UtilityResult,
    EngineCoreEventType.ERROR: CoreError,
    EngineCoreEventType.FAILED: SequencesFailed,
    WorkerMessageType.HELLO: WorkerHello,
    WorkerMessageType.INIT: WorkerInit,
    WorkerMessageType.READY: WorkerReady,
    WorkerMessageType.INIT_CACHE: InitCache,
    WorkerMessageType.STEP: SchedulerOutput,
    WorkerMessageType.SHUTDOWN: None,
    WorkerMessageType.ERROR: WorkerError,
}


def check(msg: Any, kind: type) -> tuple[enum.Enum, Any]:
    """``msg`` as ``(type, payload)`` if it is a message of the conversation whose types are the
    enum ``kind``, with the payload its type carries. Raises ValueError otherwise."""
    if not isinstance(msg, (list, tuple)) or len(msg) != 2 or not isinstance(msg[0], kind):
        raise ValueError(f"not a {kind.__name__} message: {type(msg).__name__}")
    tag: enum.Enum = msg[0]  # type: ignore[assignment]  # checked above
    want = PAYLOADS[tag]
    if (msg[1] is not None) if want is None else not isinstance(msg[1], want):
        raise ValueError(f"{tag.name}: expected {want.__name__ if want else 'no payload'}, got {type(msg[1]).__name__}")
    return tag, msg[1]


# -- the codec ---------------------------------------------------------------------------------
_EXT_DATACLASS, _EXT_ENUM, _EXT_SET = 1, 2, 3

_DATACLASSES: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}
_ENUMS: dict[str, type] = {}


def register(cls: type) -> type:
    """Allow ``cls`` (a dataclass or an enum) in messages."""
    if isinstance(cls, enum.EnumMeta):
        _ENUMS[cls.__name__] = cls
        return cls
    _DATACLASSES[cls.__name__] = cls
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls


for _cls in (
    EngineConfig,
    EngineCoreInfo,
    EngineCoreRequest,
    SamplingParams,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
    SchedulerOutput,
    NewRequestData,
    CachedRequestData,
    ModelRunnerOutput,
    StructuredOutputsParams,
    KVConnectorOutput,
    LoadSpec,
    HoldSpec,
    ReleaseSpec,
    KVConnectorMetadata,
    LoRARequest,
    RequestOutputKind,
    EngineCoreRequestType,
    EngineCoreEventType,
    WorkerMessageType,
    *(c for c in PAYLOADS.values() if c is not None),
):
    register(_cls)


def _default(obj: Any) -> Any:
    import msgpack  # imported on first use: the in-process (offline, TP 1) path never encodes a message

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
    import msgpack

    return msgpack.packb(obj, default=_default, use_bin_type=True)


def _unpackb(data: bytes | memoryview) -> Any:
    import msgpack

    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(msg: Any) -> bytes:
    """Bytes of a message: msgpack values, lists, dicts and registered dataclasses/enums.

    Raises:
        TypeError: a value of a type that is not registered.
    """
    return _packb(msg)


def decode(data: bytes | memoryview) -> Any:
    """The message ``encode`` made. Raises ValueError / TypeError on anything else."""
    return _unpackb(data)
