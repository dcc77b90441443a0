"""The server's side of prefill/decode disaggregation: checking a request's
``kv_transfer_params`` (HTTP 400) and releasing a prefill instance's hold for a request the
server refused (see ``pagedserve.distributed.kv_transfer``)."""
from __future__ import annotations

from typing import Any

from pagedserve.distributed.kv_transfer import params as kvp
from pagedserve.engine.input_processor import RequestError


def _max_blocks(cfg: Any) -> int:
    return -(-cfg.max_model_len // cfg.block_size)


def check_kv_transfer_params(cfg: Any, params: dict) -> None:
    """Raises RequestError (400, ``param="kv_transfer_params"``) on a server without
    ``--kv-transfer-config``, or for malformed or disallowed parameters."""
    if cfg.kv_transfer_config is None:
        raise RequestError("kv_transfer_params needs a server started with --kv-transfer-config.", param="kv_transfer_params")
    try:
        kvp.check_params(params, _max_blocks(cfg), kvp.allowed_hosts_of(cfg.kv_transfer))
    except kvp.KVParamsError as e:
        raise RequestError(str(e), param="kv_transfer_params") from None


def release_unused_kv(llm: Any, params: Any) -> None:
    """A request refused before reaching the engine may name a prefill instance's hold of its
    prompt's KV: ask the engine to release it now instead of at its lease (nothing for params
    that are malformed: they name nothing this server may contact)."""
    cfg = llm.config
    if cfg.kv_transfer_config is None or not isinstance(params, dict) or not kvp.wants_remote_prefill(params):
        return
    try:
        kvp.check_params(params, _max_blocks(cfg), kvp.allowed_hosts_of(cfg.kv_transfer))
    except kvp.KVParamsError:
        return
    llm.release_kv_transfer(params)
