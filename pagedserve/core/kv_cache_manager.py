"""Per-request block tables on top of the BlockPool, with prefix caching.

Block hashes are chained from position 0 (vLLM automatic prefix caching):
``hash_i = H(hash_{i-1} or SEED, token ids of block i, extra keys)`` over *full* blocks only,
with H = xxh3-128 over a canonical byte encoding, so two processes (e.g. a prefill and a
decode instance) compute the same hashes. SEED is derived from the model identity (path and
dtype), so a cache never serves KV computed by another model. A request's ``cache_salt`` is
mixed into its first block only: requests with different salts never share a block.

Sliding-window attention (every layer reads only the last ``window`` keys: Mistral v0.1) frees
blocks as a request moves on, after vLLM's ``SlidingWindowManager``: a query at position p reads
keys k with ``p - window < k <= p``, and every query from now on sits at ``num_computed_tokens``
or later, so the keys at positions ``<= num_computed_tokens - window`` are never read again and
the leading ``(num_computed_tokens - window + 1) // block_size`` blocks go back to the pool
(:func:`num_skipped_blocks`). Their entries stay in the block table, so position p still maps
to ``block_table[p // B]``. A hybrid model (Gemma 2/3: local and global layers over one block
table) frees nothing: its global layers read every block; separate tables per layer group
(vLLM's hybrid allocator) would, and ``pagedserve.bench.window_memory`` measures what that costs.
"""

from __future__ import annotations

import struct
from typing import Optional

import xxhash

from pagedserve.core.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.request import Request
from pagedserve.lora_request import first_block_extra_keys

# The table entry of a block a sliding-window request never held (a prefix hit needs only the
# window's blocks before the hit point): block 0's id, never read unmasked (see KVCacheManager).
UNHELD = KVCacheBlock(0)


def hash_seed(model_identity: str) -> bytes:
    """The parent hash of every first block (16 bytes), fixed for a given model identity."""
    return xxhash.xxh3_128_digest(b"pagedserve-prefix-cache-v1\x00" + model_identity.encode())


def num_skipped_blocks(num_computed_tokens: int, window: Optional[int], block_size: int) -> int:
    """Leading blocks that no query at position ``>= num_computed_tokens`` reads with a
    ``window``-token sliding window (0 without a window): block i ends at position
    ``(i + 1) * B - 1``, which is out of every such query's window when it is
    ``<= num_computed_tokens - window``."""
    if window is None:
        return 0
    return max(0, (num_computed_tokens - window + 1) // block_size)


def blocks_held_alone(max_len: int, block_size: int, window: Optional[int] = None, max_chunk: Optional[int] = None) -> int:
    """The most blocks one request of up to ``max_len`` tokens holds at once: all of them, or
    with a sliding ``window`` and chunks of at most ``max_chunk`` tokens (chunked prefill;
    None: a whole prompt in one step) the window's blocks plus one chunk's. Before a chunk
    runs with ``c`` tokens computed, the table holds blocks ``num_skipped_blocks(c)`` to
    ``ceil((c + chunk) / B) - 1``: at most ``ceil((window + max_chunk + B - 2) / B)``."""
    full = -(-max_len // block_size)
    if window is None or max_chunk is None:
        return full
    return min(full, -(-(window + max_chunk + block_size - 2) // block_size))


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

    With ``sliding_window``, the leading ``num_released[request_id]`` entries of a request's
    table (``req_to_blocks``) are no longer held (:func:`num_skipped_blocks`): their blocks went
    back to the pool (a hashed one to the free queue's tail, evictable, hit-able like a finished
    request's) or were never taken (a prefix hit needs only the window before the hit point).
    Such an entry keeps the id it had, or :data:`UNHELD` (block 0) where the request never held
    one: the worker's table only grows (``SchedulerOutput`` sends new ids as diffs), so it keeps
    those ids too, and they must stay valid indexes. No kernel reads them unmasked: a windowed
    layer's prefill reads from the window's first block on, and the PyTorch decode path
    gathers the whole table but masks keys outside the window (the pool is zero-initialised
    and every block holds finite K/V, so a masked read of a reused block adds exactly 0).

    Args:
        num_blocks: KV cache pool size (blocks).
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        model_identity: folded into the hash seed (model path, dtype, ...).
        sliding_window: the window (tokens) of every layer, or None (full attention, or a hybrid
            model: nothing is freed before the request ends).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, model_identity: str = "", sliding_window: Optional[int] = None
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_released: dict[str, int] = {}
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
        if self.sliding_window is not None:
            hits = self._window_hit(request.block_hashes[:max_blocks], self.sliding_window)
            return hits, len(hits) * self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hit(self, hashes: list[bytes], window: int) -> list[KVCacheBlock]:
        """The longest hit of a sliding-window request whose full blocks have ``hashes``: the
        largest n such that the blocks the window reads before token ``n * B`` (from
        :func:`num_skipped_blocks` of ``n * B`` to n - 1) are all cached; the entries before them
        are :data:`UNHELD`. A block's hash chains every token before it, so a cached block
        after an evicted one is still this prefix's (vLLM's ``find_longest_cache_hit``: scan
        from the right for ``ceil((window - 1) / B)`` cached blocks in a row)."""
        B = self.block_size
        need = max(1, -(-(window - 1) // B))
        n = run = 0
        for i in range(len(hashes) - 1, -1, -1):
            if self.block_pool.get_cached_block(hashes[i]) is None:
                run = 0
                continue
            run += 1
            if run == need:
                n = i + need
                break
        else:
            n = run  # the cached run from block 0, shorter than the window
        first = num_skipped_blocks(n * B, window, B)
        return [UNHELD] * first + [self.block_pool.cached_blocks[h] for h in hashes[first:n]]

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
        nothing (no ref count, no block table), except that with a sliding window the blocks
        that left it are released first either way (no query reads them again). Block tables
        only grow. ``register_new=False`` leaves the new blocks out of the prefix cache (a KV
        connector fills them later; they are registered by the request's next allocation).
        """
        new_computed_blocks = new_computed_blocks or []
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        computed = request.num_computed_tokens + num_new_computed_tokens
        total = computed + num_new_tokens
        skip = num_skipped_blocks(computed, self.sliding_window, self.block_size)
        if skip:
            self._release(rid, blocks, min(skip, len(blocks)))
        held_hits = new_computed_blocks[max(0, skip - len(blocks)) :]  # the window's hit blocks
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hit blocks that no one holds sit in the free queue: touching them takes them out.
        num_evictable_hits = sum(1 for b in held_hits if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        if new_computed_blocks:
            self.block_pool.touch(held_hits)
            blocks.extend(new_computed_blocks)
            if skip > self.num_released.get(rid, 0):
                self.num_released[rid] = skip
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
            start = max(self.num_cached_blocks.get(rid, 0), self.num_released.get(rid, 0))
            for i in range(start, num_full):
                self.block_pool.cache_block(blocks[i], request.block_hashes[i])
            self.num_cached_blocks[rid] = max(start, num_full)
        return new_blocks

    def _release(self, request_id: str, blocks: list[KVCacheBlock], upto: int) -> None:
        """Drop the request's hold on its table entries before ``upto`` (sliding window); the
        entries stay in the table with their ids."""
        released = self.num_released.get(request_id, 0)
        if upto > released:
            self.block_pool.free_blocks(blocks[released:upto])
            self.num_released[request_id] = upto

    def cache_loaded_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` in the prefix cache (their
        KV was loaded from outside, see ``allocate_slots(register_new=False)``)."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        start = max(self.num_cached_blocks.get(request.request_id, 0), self.num_released.get(request.request_id, 0))
        end = min(num_tokens // self.block_size, len(blocks), len(request.block_hashes))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def block_hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of every full block of the request's tokens (16 bytes each)."""
        self.update_block_hashes(request, force=True)
        return request.block_hashes

    def free(self, request: Request) -> None:
        """Release all blocks of a request (finished, aborted or preempted) that it still holds."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        released = self.num_released.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(blocks[released:])

    def free_tail(self, request: Request, num_kept: int) -> None:
        """Release the request's blocks after its first ``num_kept`` (a finished request whose
        full prompt blocks stay held for a KV transfer)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and len(blocks) > num_kept:
            released = self.num_released.get(request.request_id, 0)
            tail = blocks[max(num_kept, released) :]
            del blocks[num_kept:]
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks.get(request.request_id, 0), num_kept)
            if released > num_kept:
                self.num_released[request.request_id] = num_kept
            self.block_pool.free_blocks(tail)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (ids; with a sliding window, released entries included)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def held_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The blocks the request holds a reference on (its table less the released entries)."""
        return self.req_to_blocks.get(request_id, [])[self.num_released.get(request_id, 0) :]

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
