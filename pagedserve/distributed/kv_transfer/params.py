"""``kv_transfer_params``: what a client (the proxy) sends and what a prefill instance returns,
with vLLM's NixlConnector field names. Torch-free: the server front checks them (HTTP 400) and
the engine core checks them again (a bad value never reaches a socket)."""

from __future__ import annotations

import ipaddress
from typing import Any, Optional

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_PARAMS_LEN = 64  # keys and string lengths are small; block lists are capped separately
MAX_INT = 2**31 - 1  # block ids, ports, token counts: anything larger is not a real value


class KVParamsError(ValueError):
    """kv_transfer_params the engine refuses (the message names the field)."""


def producer_params(engine_id: str, host: str, port: int, transfer_id: str, block_ids: list[int], num_tokens: int) -> dict:
    """What a prefill instance hands back for a finished ``do_remote_decode`` request."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": transfer_id,
        "remote_block_ids": list(block_ids),
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
    }


def wants_remote_decode(params: Optional[dict]) -> bool:
    return bool(params) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: Optional[dict]) -> bool:
    return bool(params) and params.get("do_remote_prefill") is True


def _str(params: dict, key: str) -> str:
    v = params.get(key)
    if not isinstance(v, str) or not v or len(v) > 256:
        raise KVParamsError(f"kv_transfer_params.{key} must be a non-empty string of at most 256 characters")
    return v


def check_params(params: Any, max_blocks: int, allowed_hosts: Optional[list[str]] = None) -> Optional[dict]:
    """Validate client-supplied ``kv_transfer_params``; returns them (None when empty/None).

    Args:
        max_blocks: most blocks a request can have (``ceil(max_model_len / block_size)``).
        allowed_hosts: peers a decode instance may connect to (``remote_host``); None = any.
            Loopback is always allowed.
    Raises:
        KVParamsError: not an object, a wrong type, too many blocks, a host not allowed.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KVParamsError("kv_transfer_params must be a JSON object")
    if len(params) > MAX_PARAMS_LEN:
        raise KVParamsError(f"kv_transfer_params has {len(params)} keys; at most {MAX_PARAMS_LEN}")
    for key, value in params.items():
        _check_plain(value, key, max_blocks + MAX_PARAMS_LEN)
    for key in ("do_remote_prefill", "do_remote_decode"):
        if params.get(key) not in (None, True, False):
            raise KVParamsError(f"kv_transfer_params.{key} must be true or false")
    if not wants_remote_prefill(params):
        return params
    _str(params, "remote_engine_id")
    _str(params, "remote_request_id")
    host = _str(params, "remote_host")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise KVParamsError("kv_transfer_params.remote_port must be a TCP port")
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or len(ids) > max_blocks or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise KVParamsError(f"kv_transfer_params.remote_block_ids must be a list of at most {max_blocks} block ids")
    n = params.get("remote_num_tokens", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise KVParamsError("kv_transfer_params.remote_num_tokens must be a number of tokens")
    if allowed_hosts is not None and host not in LOOPBACK_HOSTS and host not in allowed_hosts and not _is_loopback(host):
        raise KVParamsError(f"kv_transfer_params.remote_host {host!r} is not an allowed KV peer (kv_connector_extra_config.allowed_peer_hosts)")
    return params


def _check_plain(value: Any, key: str, max_len: int, depth: int = 0) -> None:
    """Only JSON scalars (ints in [-2^31, 2^31), strings of at most 1024 characters) and short
    lists of them: anything else would not even cross to the engine core."""
    if value is None or isinstance(value, (bool, float)):
        return
    if isinstance(value, int):
        if not -MAX_INT - 1 <= value <= MAX_INT:
            raise KVParamsError(f"kv_transfer_params.{key}: {value} is out of range")
        return
    if isinstance(value, str):
        if len(value) > 1024:
            raise KVParamsError(f"kv_transfer_params.{key} is longer than 1024 characters")
        return
    if isinstance(value, list) and depth == 0 and len(value) <= max_len:
        for v in value:
            _check_plain(v, key, max_len, 1)
        return
    raise KVParamsError(f"kv_transfer_params.{key} must be a number, a string, true/false/null or a short list of them")


def allowed_hosts_of(config: Any) -> Optional[list[str]]:
    """The peers a decode instance with this :class:`KVTransferConfig` may read from: loopback,
    its own ``kv_ip`` and ``kv_connector_extra_config["allowed_peer_hosts"]`` (``["*"]`` = any).
    A client names the peer, so without this list it could make the server connect anywhere."""
    extra = config.kv_connector_extra_config.get("allowed_peer_hosts", [])
    return None if "*" in extra else [config.kv_ip, *extra]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
