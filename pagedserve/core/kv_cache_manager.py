"""Per-request block tables on top of the BlockPool, with prefix caching.

Block hashes are chained from position 0 (vLLM automatic prefix caching):
``hash_i = H(hash_{i-1} or SEED, token ids of block i, extra keys)`` over *full* blocks only,
with H = xxh3-128 over a canonical byte encoding, so two processes (e.g. a prefill and a
decode instance) compute the same hashes. SEED is derived from the model identity (path and
dtype), so a cache never serves KV computed by another model. A request's ``cache_salt`` is
mixed into its first block only: requests with different salts never share a block.
"""

from __future__ import annotations

import struct
from typing import Optional

import xxhash

from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.request import Request
from pagedserve.lora_request import first_block_extra_keys


def hash_seed(model_identity: str) -> bytes:
    """The parent hash of every first block (16 bytes), fixed for a given model identity."""
    return xxhash.xxh3_128_digest(b"pagedserve-prefix-cache-v1\x00" + model_identity.encode())


def hash_block_tokens(parent_hash: bytes, token_ids, extra_keys: Optional[bytes] = None) -> bytes:
    """Hash of one full block: H(parent, tokens, extra). Returns 16 bytes."""
    h = xxhash.xxh3_128()
    h.update(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(b"\x01")
        h.update(extra_keys)
    return h.digest()


class KVCacheManager:
    """Allocates and frees the blocks of each request and serves prefix-cache hits.

    Args:
        num_blocks: KV cache pool size (blocks).
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        model_identity: folded into the hash seed (model path, dtype, ...).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, model_identity: str = "") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.seed_hash = hash_seed(model_identity)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of each request registered in the cache

    # -- hashing ---------------------------------------------------------------------------
    def update_block_hashes(self, request: Request, force: bool = False) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its tokens (with
        prefix caching off only when ``force``: KV transfer names blocks by these hashes)."""
        if not self.enable_caching and not force:
            return
        B = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * B <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else self.seed_hash
            extra = first_block_extra_keys(request.cache_salt, request.lora_key) if i == 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * B : (i + 1) * B], extra))

    # -- lookup and allocation ------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading cached blocks of a request not yet holding any blocks.

        The hit is capped at ``num_tokens - 1`` tokens: the last token must be computed to give
        logits. Takes no references (``allocate_slots`` does).

        Returns:
            (blocks, number of tokens they cover).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        num_new_computed_tokens: int = 0,
        register_new: bool = True,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after its computed ones
        and the prefix hit ``new_computed_blocks``).

        Either succeeds and returns the newly allocated blocks, or returns None having changed
        nothing (no ref count, no block table). Block tables only grow. ``register_new=False``
        leaves the new blocks out of the prefix cache (a KV connector fills them later; they
        are registered by the request's next allocation).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hit blocks that no one holds sit in the free queue: touching them takes them out.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)

        if not register_new:
            self.num_cached_blocks.setdefault(request.request_id, len(blocks) - len(new_blocks))
        elif self.enable_caching:
            # Register blocks that this step fills completely. Their K/V is written in this
            # step's forward, layer by layer before any attention reads, so a request admitted
            # later in the same step may already hit them.
            self.update_block_hashes(request)
            num_full = min(total, request.num_tokens) // self.block_size
            start = self.num_cached_blocks.get(request.request_id, 0)
            for i in range(start, num_full):
                self.block_pool.cache_block(blocks[i], request.block_hashes[i])
            self.num_cached_blocks[request.request_id] = max(start, num_full)
        return new_blocks

    def cache_loaded_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` in the prefix cache (their
        KV was loaded from outside, see ``allocate_slots(register_new=False)``)."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(blocks), len(request.block_hashes))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def block_hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of every full block of the request's tokens (16 bytes each)."""
        self.update_block_hashes(request, force=True)
        return request.block_hashes

    def free(self, request: Request) -> None:
        """Release all blocks of a request (finished, aborted or preempted)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks)

    def free_tail(self, request: Request, num_kept: int) -> None:
        """Release the request's blocks after its first ``num_kept`` (a finished request whose
        full prompt blocks stay held for a KV transfer)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and len(blocks) > num_kept:
            tail = blocks[num_kept:]
            del blocks[num_kept:]
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks.get(request.request_id, 0), num_kept)
            self.block_pool.free_blocks(tail)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.usage()
