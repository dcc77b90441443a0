"""The pool of KV cache blocks: ref counts, the LRU free queue and the prefix-cache index.

Design after vLLM v1's BlockPool / FreeKVCacheBlockQueue (PagedAttention, Kwon et al., SOSP 2023;
automatic prefix caching as in vLLM's "prefix caching" design doc). Pure Python: no tensors live
here, only block ids; the tensors are owned by the worker.
"""

from __future__ import annotations

from typing import Iterable, Optional


class KVCacheBlock:
    """Metadata of one block of ``block_size`` token slots.

    Attributes:
        block_id: index into the KV cache tensors' block dimension.
        ref_cnt: number of live requests whose block table holds this block.
        block_hash: set while the block is full and registered in the prefix cache; kept after
            the block is freed (so a later request can hit it) and dropped only when the block
            is reused for other tokens (lazy eviction).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop from the head, append at either end and
    removal from the middle (a cached block that gets a prefix hit leaves the queue).

    Eviction takes from the head: never-used and unhashed blocks sit there, cached blocks are
    appended at the tail in the order they were freed, so the least recently used cached block
    is evicted first.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def _link_between(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        self._link_between(block, self._tail.prev_free, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link_between(block, self._head, self._head.next_free)  # type: ignore[arg-type]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free  # type: ignore[assignment]

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All ``num_blocks`` blocks, the free queue and the map from block hash to cached block.

    Args:
        num_blocks: size of the pool (blocks).
        enable_caching: register full blocks by hash so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        # Free blocks that still carry a hash (a later request can hit them), kept up to date
        # at every change so a step trace can read it in O(1).
        self.num_cached_free_blocks = 0
        # KV events for a data-parallel router (vLLM's KV events): None = off (the default, one
        # ``is None`` test per cached/evicted block); else runs ``[kind, [hash, ...]]`` in the
        # order they happened, kind "stored" / "removed" / "cleared", drained by take_kv_events.
        self.kv_events: Optional[list] = None

    def enable_kv_events(self) -> None:
        """Start recording which hashes enter and leave the prefix-cache index."""
        if self.kv_events is None:
            self.kv_events = []

    def take_kv_events(self) -> Optional[list]:
        """The events since the last call (None when off or when nothing changed)."""
        events = self.kv_events
        if not events:
            return None
        self.kv_events = []
        return events

    def _record(self, kind: str, block_hash: bytes) -> None:
        events = self.kv_events
        if events and events[-1][0] == kind:
            events[-1][1].append(block_hash)
        else:
            events.append([kind, [block_hash]])

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live request holds (never used or cached-and-evictable)."""
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by live requests, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue (evicting their cached hashes).

        Raises:
            ValueError: when fewer than ``n`` blocks are free (callers check first).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks from the pool ({self.num_free_blocks} free)")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.num_cached_free_blocks -= 1
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.kv_events is not None:
                    self._record("removed", block.block_hash)
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit block with no owner leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under ``block_hash``. If another block already holds the same
        content, this one stays unregistered (its twin serves future hits)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.kv_events is not None:
            self._record("stored", block_hash)
        if block.ref_cnt == 0 and block.prev_free is not None:  # not reached today: blocks are cached while held
            self.num_cached_free_blocks += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each of a request's blocks (given in block-table order).

        Blocks that reach ref_cnt 0 return to the free queue tail first: unhashed ones at the
        head (reused first), hashed ones at the tail so a chain's first block is evicted last.
        """
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than allocated")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    self.num_cached_free_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use."""
        if self.num_used_blocks != 0:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        self.num_cached_free_blocks = 0
        if self.kv_events is not None:
            self.kv_events = [["cleared", []]]  # what came before no longer matters
        return True
