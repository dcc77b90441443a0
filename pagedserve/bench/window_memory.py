"""KV bytes per request with sliding-window attention: what freeing the blocks that left the
window saves, and what the single block table costs a hybrid model.

* Pure sliding window (every layer the same window: Mistral v0.1): one request of ``context``
  tokens is driven through the core's own allocator (:class:`KVCacheManager` with
  ``sliding_window``): its prompt in chunks of ``chunk`` tokens, then decodes up to ``context``.
  Reported: the most blocks it held at once (a chunk plus the window), the most it held while
  decoding, and the ``ceil(context / B)`` blocks it would hold without freeing.
* Hybrid (Gemma 2/3: local layers with a window, global layers without): pagedserve keeps one
  block table for all layers, so a block is freed only when every layer is done with it, which
  the global layers never are: every layer holds the whole context. Per-group tables (vLLM's
  hybrid allocator: the local layers' table frees as above, the global layers' does not) would
  hold ``context`` tokens in the global layers only and the window's blocks in the local ones.
  Computed from each layer's window (``pagedserve.model.registry.layer_windows``) and the
  measured local-group blocks.

Bytes: ``blocks x block_size x bytes per token per layer x layers`` (K and V: ``2 x kv heads x
head_dim x dtype bytes`` per token per layer; every tensor-parallel rank's share together).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedserve.core.kv_cache_manager import KVCacheManager, blocks_held_alone
from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams


def measure_window_blocks(context: int, block_size: int, window: Optional[int], chunk: int, num_decode: int = 256) -> dict[str, int]:
    """One request through the allocator: a ``context - num_decode``-token prompt in chunks
    of ``chunk`` tokens, then ``num_decode`` decodes (one token each).

    Returns:
        ``peak_blocks`` (the most held at once), ``decode_blocks`` (the most held while decoding),
        ``full_blocks`` (``ceil(context / B)``, what a table that frees nothing holds).
    Raises:
        ValueError: ``num_decode`` not in ``[0, context)`` or ``chunk < 1``.
    """
    if not 0 <= num_decode < context or chunk < 1:
        raise ValueError(f"need 0 <= num_decode ({num_decode}) < context ({context}) and chunk ({chunk}) >= 1")
    B = block_size
    kv = KVCacheManager(blocks_held_alone(context, B, window, chunk), B, enable_caching=False, sliding_window=window)
    req = Request("probe", [0] * (context - num_decode), SamplingParams(max_tokens=num_decode + 1))
    peak = decode = 0
    while req.num_computed_tokens < context:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        if kv.allocate_slots(req, n) is None:
            raise RuntimeError(f"the allocator ran out of its {kv.num_total_blocks} blocks at {req.num_computed_tokens} tokens")
        held = kv.block_pool.num_used_blocks
        peak = max(peak, held)
        if req.num_output_tokens:
            decode = max(decode, held)
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < context:
            req.append_output_token_ids([0])
    kv.free(req)
    return {"peak_blocks": peak, "decode_blocks": decode, "full_blocks": -(-context // B)}


def window_report(
    windows: Sequence[Optional[int]], bytes_per_token_layer: int, context: int, block_size: int, chunk: int, num_decode: int = 256
) -> dict[str, Any]:
    """KV bytes of one request of ``context`` tokens for a model whose layer i has window
    ``windows[i]`` (None: full attention); see the module docstring.

    Returns a dict (JSON-ready): the shape (``layers``, ``local_layers``, ``window``,
    ``context``, ``block_size``, ``chunk``, ``bytes_per_token_layer``); ``kind`` ("none",
    "pure" or "hybrid"); ``bytes_no_freeing``; for "pure": ``bytes_freeing_peak`` and
    ``bytes_freeing_decode`` (pagedserve today); for "hybrid": ``bytes_one_table`` (pagedserve
    today, equal to no freeing) and ``bytes_per_group_peak`` / ``bytes_per_group_decode``
    (vLLM's hybrid allocator), with the measured local-group blocks.
    """
    local = [w for w in windows if w is not None]
    if len(set(local)) > 1:
        raise ValueError(f"layers with different windows ({sorted(set(local))}) are not modelled")
    window = local[0] if local else None
    B = block_size
    per_block_layer = B * bytes_per_token_layer
    n_layers, n_local = len(windows), len(local)
    full_blocks = -(-context // B)
    out: dict[str, Any] = {
        "layers": n_layers,
        "local_layers": n_local,
        "window": window,
        "context": context,
        "block_size": B,
        "chunk": chunk,
        "bytes_per_token_layer": bytes_per_token_layer,
        "bytes_no_freeing": full_blocks * per_block_layer * n_layers,
    }
    if window is None:
        out["kind"] = "none"
        return out
    m = measure_window_blocks(context, B, window, chunk, num_decode)
    out["local_blocks"] = m
    if n_local == n_layers:
        out["kind"] = "pure"
        out["bytes_freeing_peak"] = m["peak_blocks"] * per_block_layer * n_layers
        out["bytes_freeing_decode"] = m["decode_blocks"] * per_block_layer * n_layers
    else:
        out["kind"] = "hybrid"
        out["bytes_one_table"] = out["bytes_no_freeing"]
        global_bytes = full_blocks * per_block_layer * (n_layers - n_local)
        out["bytes_per_group_peak"] = global_bytes + m["peak_blocks"] * per_block_layer * n_local
        out["bytes_per_group_decode"] = global_bytes + m["decode_blocks"] * per_block_layer * n_local
    return out


def describe_report(r: dict[str, Any]) -> str:
    """One line per scheme, in MiB per request and as a share of no freeing."""

    def mib(key: str) -> str:
        return f"{r[key] / 2**20:.1f} MiB ({100 * r[key] / r['bytes_no_freeing']:.0f} %)"

    head = f"KV per request at {r['context']} tokens ({r['layers']} layers, {r['local_layers']} with a {r['window']}-token window, blocks of {r['block_size']}, chunks of {r['chunk']}): "
    if r["kind"] == "none":
        return head + f"{r['bytes_no_freeing'] / 2**20:.1f} MiB (no window: nothing to free)"
    if r["kind"] == "pure":
        return (
            head
            + f"without freeing {mib('bytes_no_freeing')}; freeing the window's blocks (pagedserve): peak {mib('bytes_freeing_peak')}, decoding {mib('bytes_freeing_decode')}"
        )
    return head + (
        f"one block table for all layers (pagedserve: frees nothing) {mib('bytes_one_table')}; "
        f"per-group tables (vLLM's hybrid allocator, not built): peak {mib('bytes_per_group_peak')}, decoding {mib('bytes_per_group_decode')}"
    )
