"""KVTransferConfig: prefill/decode disaggregation's part of :class:`pagedserve.config.EngineConfig`
(its ``kv_transfer_config`` field, ``--kv-transfer-config`` JSON, parsed by
:func:`pagedserve.config.dataclass_from_value`), in vLLM's shape. Torch-free."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Optional

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_KV_CONNECTOR = "NetworkConnector"


@dataclass
class KVTransferConfig:
    """Prefill/decode disaggregation: which KV connector an engine runs and its role, in
    vLLM's ``--kv-transfer-config`` shape (JSON on the command line).

    Attributes:
        kv_connector: the connector; "NetworkConnector" (the default: full KV blocks pulled by
            the decode side over TCP with pyzmq, see ``pagedserve.distributed.kv_transfer``).
        kv_role: "kv_producer" (a prefill instance: keeps a finished request's blocks for a
            decode instance to read), "kv_consumer" (a decode instance: loads them), "kv_both".
        kv_ip: where this instance's transfer socket listens (producer side) and the address
            it tells consumers; 127.0.0.1 unless set.
        kv_port: the transfer socket's TCP port (two instances on one host need two ports).
        engine_id: names this instance to its peers (default: a random id per start).
        kv_load_failure_policy: what a consumer does when a transfer fails or times out:
            "recompute" the prompt locally (default) or "fail" the request with an error.
        kv_lease_s: seconds a producer keeps a finished request's blocks for the consumer to
            read (freed earlier when the consumer says it has read them).
        kv_transfer_timeout_s: seconds a consumer waits for a peer's answer before the
            transfer counts as failed.
        kv_connector_extra_config: NetworkConnector's options: ``allowed_peer_hosts`` (hosts a
            consumer may read from besides loopback and its own kv_ip; ``["*"]`` = any) and
            ``advertise_host`` (the address handed to consumers when kv_ip is 0.0.0.0 or ::),
            ``peer_down_s`` (seconds a consumer fails loads from a peer at once after one of
            its loads timed out; default 5).
    Raises:
        ValueError: an unknown key, role, policy or connector, or a value out of range.
    """

    kv_connector: str = DEFAULT_KV_CONNECTOR
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: Optional[str] = None
    kv_load_failure_policy: str = "recompute"
    kv_lease_s: float = 30.0
    kv_transfer_timeout_s: float = 10.0
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector is None:
            self.kv_connector = DEFAULT_KV_CONNECTOR
        if self.kv_connector != DEFAULT_KV_CONNECTOR:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not available; the one connector is {DEFAULT_KV_CONNECTOR!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be recompute or fail, got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port (1-65535), got {self.kv_port!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_ip must be an address, got {self.kv_ip!r}")
        if self.kv_ip in ("0.0.0.0", "::") and not self.kv_connector_extra_config.get("advertise_host"):
            raise ValueError(
                f"kv_ip {self.kv_ip!r} listens on every interface but is no address a decode instance can "
                "reach: set kv_connector_extra_config.advertise_host to the address to hand out"
            )
        for name in ("kv_lease_s", "kv_transfer_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600], got {v!r}")
        if self.engine_id is None:
            self.engine_id = uuid.uuid4().hex
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
