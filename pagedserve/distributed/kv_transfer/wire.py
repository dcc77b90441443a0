"""The NetworkConnector's wire format (pyzmq DEALER -> ROUTER over TCP; msgpack headers of plain
values, KV blocks as raw bytes; never pickle).

Requests (consumer -> producer), each one msgpack list:
- ``["hello", layout, expected_engine_id]`` -> ``["ok", layout]`` or ``["error", "handshake", why]``
- ``["read", transfer_id, block_indices, block_hashes]`` -> ``["blocks", n, digests]`` plus one
  frame of ``n`` blocks, each ``[layers, 2 (K/V), kv_heads, block_size, head_dim]`` in the
  pool's dtype (an int8 pool: ``[layers, 2, kv_heads, cell_bytes]``, values and scales), or ``["error", code, why]`` with code "unknown" (not registered yet: retry),
  "released" (read, expired or never held), "hash_mismatch", "bad_request"
- ``["done", transfer_id]`` -> ``["ok"]`` (idempotent: a repeated or unknown notice is fine)

``layout`` is :func:`kv_layout`: two instances may exchange blocks only when every entry is
equal. A digest is xxh3-64 of one block's bytes.
"""

from __future__ import annotations

from typing import Any, Optional

import msgpack
import xxhash

PROTOCOL_VERSION = 1
MAX_READ_BLOCKS = 32  # blocks per read reply (bounds one message: 32 x 16 tokens)
MAX_HEADER_BYTES = 1 << 20


def kv_layout(
    model: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, hash_seed: bytes, weights: str = ""
) -> dict:
    """What a peer must match: the model's fingerprint, the weights' kind (``bfloat16``,
    ``Q4_1+Q8_0``: KV computed by other weights is other KV), the KV dtype, block size and
    shape, and the seed of the chained block hashes."""
    return {
        "protocol": PROTOCOL_VERSION,
        "model": model,
        "weights": weights,
        "dtype": dtype,
        "block_size": block_size,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "order": "layer,kv,head,token,dim",
        "hash_seed": hash_seed.hex(),
    }


SHOWN_KEYS = ("protocol", "weights", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "order")


def layout_mismatch(producer: dict, consumer: Any) -> Optional[str]:
    """A sentence naming what differs (values only of the shape keys: the model fingerprint
    and hash seed are not told to a stranger), or None when the layouts match."""
    if not isinstance(consumer, dict) or not all(isinstance(k, str) for k in consumer) or set(consumer) != set(producer):
        return "the peer's KV layout is not this protocol's"
    diffs = [
        f"{k}: producer {producer[k]!r}, consumer {consumer[k]!r}" if k in SHOWN_KEYS else f"{k} differs"
        for k in producer
        if producer[k] != consumer[k]
    ]
    return ("KV layouts differ (" + "; ".join(diffs) + ")") if diffs else None


def digest(buf: Any) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def pack(msg: list) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> list:
    """Raises ValueError for anything but a non-empty msgpack list of plain values."""
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack's errors are not one class
        raise ValueError(f"malformed message: {e}") from None
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
        raise ValueError("a message is a list that starts with its kind")
    return msg
