"""Block pool and KV cache manager unit tests: no model, no torch tensors.

Covers the prefix-cache mechanics of design.md ("KV cache"): the exact chained block hashes,
sharing of full prefix blocks (never partial ones), the LRU free queue with tail-first release,
O(1) removal of hit blocks from the free queue, all-or-nothing allocation, cache_salt, reset.
"""
from __future__ import annotations

import struct

import pytest
import xxhash

from core_utils import B, IDENTITY, assert_pool_idle
from core_utils import make_kv_manager as manager
from core_utils import make_request
from pagedserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedserve.core.kv_cache_manager import KVCacheManager, hash_block_tokens, hash_seed
from pagedserve.core.request import Request


def make_req(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return make_request(rid, tokens, salt, **params)


def admit(kv: KVCacheManager, req: Request) -> tuple[list[KVCacheBlock], int]:
    """Admit a waiting request the way the scheduler does: prefix hit, then the rest of the
    prompt in one chunk. Returns (hit blocks, hit tokens)."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    return hits, num_hit


def table(kv: KVCacheManager, req: Request) -> list[KVCacheBlock]:
    return kv.req_to_blocks[req.request_id]


def free_order(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_queue]


def snapshot(kv: KVCacheManager):
    pool = kv.block_pool
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        free_order(kv),
        {h: b.block_id for h, b in pool.cached_blocks.items()},
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
        dict(kv.num_cached_blocks),
    )


def expected_hashes(tokens: list[int], identity: str = IDENTITY, salt: str | None = None) -> list[bytes]:
    """The hash chain computed by hand: the format is pinned so that two instances (e.g. a
    prefill and a decode instance) agree on it."""
    parent = xxhash.xxh3_128_digest(b"pagedserve-prefix-cache-v1\x00" + identity.encode())
    out = []
    for i in range(len(tokens) // B):
        data = parent + struct.pack(f"<{B}q", *tokens[i * B : (i + 1) * B])
        if i == 0 and salt:
            data += b"\x01" + salt.encode()
        parent = xxhash.xxh3_128_digest(data)
        out.append(parent)
    return out


# 3 full blocks and a half one.
PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 41, 42]


# --------------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------------
def test_hash_chain_of_three_and_a_half_blocks_is_exact():
    kv = manager()
    req = make_req("a", PROMPT)
    hits, num_hit = kv.get_computed_blocks(req)
    assert hits == [] and num_hit == 0
    want = expected_hashes(PROMPT)
    assert len(want) == 3
    assert req.block_hashes == want  # the partial 4th block has no hash
    assert all(len(h) == 16 for h in want)  # xxh3-128
    assert hash_seed(IDENTITY) == xxhash.xxh3_128_digest(b"pagedserve-prefix-cache-v1\x00" + IDENTITY.encode())
    assert hash_block_tokens(want[0], PROMPT[4:8]) == want[1]

    new = kv.allocate_slots(req, len(PROMPT))
    assert new is not None and len(new) == 4
    blocks = table(kv, req)
    assert [b.block_hash for b in blocks] == want + [None]  # partial block never registered
    assert kv.block_pool.cached_blocks == {h: b for h, b in zip(want, blocks)}
    kv.free(req)
    assert_pool_idle(kv)


def test_hash_depends_on_model_identity_parent_and_position():
    a = make_req("a", PROMPT)
    KVCacheManager(8, B, model_identity="m1|float32").update_block_hashes(a)
    b = make_req("b", PROMPT)
    KVCacheManager(8, B, model_identity="m1|bfloat16").update_block_hashes(b)
    assert set(a.block_hashes).isdisjoint(b.block_hashes)
    # Same block content at another position (other parent) hashes differently.
    c = make_req("c", PROMPT[4:8] + PROMPT[4:8])
    KVCacheManager(8, B, model_identity="m1|float32").update_block_hashes(c)
    assert c.block_hashes[1] != a.block_hashes[1]
    # Two managers of the same model agree (no per-process randomness, no Python hash()).
    d = make_req("d", PROMPT)
    KVCacheManager(8, B, model_identity="m1|float32").update_block_hashes(d)
    assert d.block_hashes == a.block_hashes


def test_hashes_extend_as_output_tokens_arrive_and_decode_blocks_are_cached():
    kv = manager()
    req = make_req("a", PROMPT[:6])
    admit(kv, req)
    assert len(req.block_hashes) == 1
    assert [b.block_hash is not None for b in table(kv, req)] == [True, False]
    # Decode: the sampled token is appended, then the next step computes its K/V.
    for tok in (51, 52, 53):
        req.append_output_token_ids([tok])
        kv.update_block_hashes(req)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    # 6 prompt + 3 output tokens, all computed (the engine would have sampled a 4th).
    assert req.num_computed_tokens == 9
    assert req.block_hashes == expected_hashes(PROMPT[:6] + [51, 52])
    blocks = table(kv, req)
    assert blocks[1].block_hash == req.block_hashes[1]  # filled during decode: cached too
    assert blocks[2].block_hash is None
    kv.free(req)
    assert_pool_idle(kv)


# --------------------------------------------------------------------------------------------
# Sharing
# --------------------------------------------------------------------------------------------
def test_second_request_shares_full_prefix_blocks_but_not_the_partial_one():
    kv = manager()
    a = make_req("a", PROMPT)
    admit(kv, a)
    b = make_req("b", PROMPT[:12] + [99, 98, 97])  # same 3 full blocks, another tail
    hits, num_hit = admit(kv, b)
    assert num_hit == 12 and hits == table(kv, a)[:3]
    ta, tb = table(kv, a), table(kv, b)
    assert ta[:3] == tb[:3]
    assert [blk.ref_cnt for blk in ta[:3]] == [2, 2, 2]
    assert ta[3] is not tb[3] and ta[3].ref_cnt == tb[3].ref_cnt == 1  # partial blocks private
    assert kv.block_pool.num_used_blocks == 5
    kv.free(a)
    assert [blk.ref_cnt for blk in tb] == [1, 1, 1, 1]
    kv.free(b)
    assert_pool_idle(kv)


def test_hit_is_capped_so_the_last_token_is_computed():
    kv = manager()
    a = make_req("a", PROMPT)
    admit(kv, a)
    # Exactly 3 full cached blocks: a hit of 12 would leave nothing to compute.
    c = make_req("c", PROMPT[:12])
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8 and len(hits) == 2
    d = make_req("d", PROMPT[:13])
    assert kv.get_computed_blocks(d)[1] == 12
    # The lookup stops at the first miss even if later blocks match.
    e = make_req("e", PROMPT[:4] + [0, 0, 0, 0] + PROMPT[8:])
    assert kv.get_computed_blocks(e)[1] == 4
    kv.free(a)
    assert_pool_idle(kv)


def test_prompt_logprobs_requests_do_not_hit():
    kv = manager()
    a = make_req("a", PROMPT)
    admit(kv, a)
    r = make_req("r", PROMPT, prompt_logprobs=1)
    assert kv.get_computed_blocks(r) == ([], 0)
    kv.free(a)
    assert_pool_idle(kv)


def test_caching_disabled_never_hashes_or_hits():
    kv = manager(caching=False)
    a = make_req("a", PROMPT)
    admit(kv, a)
    assert a.block_hashes == [] and not kv.block_pool.cached_blocks
    b = make_req("b", PROMPT)
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)
    assert_pool_idle(kv)


def test_twin_block_with_same_content_is_not_registered_twice():
    kv = manager()
    a, b = make_req("a", PROMPT), make_req("b", PROMPT)
    # Both computed the same blocks without hitting each other (e.g. two requests prefilling
    # the same prompt in chunks side by side): b's twins stay unregistered, a's serve hits.
    assert kv.allocate_slots(a, len(PROMPT)) is not None
    assert kv.allocate_slots(b, len(PROMPT)) is not None
    assert [blk.block_hash is None for blk in table(kv, b)] == [True] * 4
    assert len(kv.block_pool.cached_blocks) == 3
    kv.free(a)
    kv.free(b)
    assert_pool_idle(kv)


# --------------------------------------------------------------------------------------------
# Free queue: LRU, tail first, O(1) removal on a hit, lazy eviction
# --------------------------------------------------------------------------------------------
def test_free_queue_order_after_free_is_lru_and_tail_first():
    kv = manager(num_blocks=10)
    a = make_req("a", PROMPT)
    admit(kv, a)
    ids_a = [blk.block_id for blk in table(kv, a)]
    assert ids_a == [0, 1, 2, 3]
    b = make_req("b", [7] * 9)  # 2 full blocks + 1 partial
    admit(kv, b)
    ids_b = [blk.block_id for blk in table(kv, b)]
    assert ids_b == [4, 5, 6]
    kv.free(a)  # first freed: its cached blocks are the least recently used
    kv.free(b)
    # Unhashed partial blocks at the head (reused first), then never-used blocks, then cached
    # blocks in the order they were freed, each request's chain released tail first.
    assert free_order(kv) == [6, 3, 7, 8, 9, 2, 1, 0, 5, 4]
    # Reuse evicts from the head; a cached block keeps its hash until it is reused.
    c = make_req("c", list(range(100, 100 + 4 * 6)))  # 6 fresh full blocks, no hit
    admit(kv, c)
    assert [blk.block_id for blk in table(kv, c)] == [6, 3, 7, 8, 9, 2]
    assert kv.block_pool.blocks[2].block_hash == c.block_hashes[5]  # evicted, then re-registered
    # a's tail block 2 is gone from the cache, its first two blocks still hit.
    a2 = make_req("a2", PROMPT)
    hits, num_hit = kv.get_computed_blocks(a2)
    assert num_hit == 8 and [blk.block_id for blk in hits] == [0, 1]
    assert kv.get_computed_blocks(make_req("b2", [7] * 9))[1] == 8
    kv.free(c)
    assert_pool_idle(kv)


def test_a_hit_pulls_the_block_out_of_the_free_queue():
    kv = manager(num_blocks=8)
    a = make_req("a", PROMPT)
    admit(kv, a)
    kv.free(a)
    assert kv.block_pool.num_free_blocks == 8
    before = free_order(kv)
    b = make_req("b", PROMPT[:12] + [5])
    hits, num_hit = admit(kv, b)
    assert [blk.block_id for blk in hits] == [0, 1, 2]
    for blk in hits:
        assert blk.ref_cnt == 1
        assert blk.prev_free is None and blk.next_free is None
    # Three hit blocks left the middle/tail of the queue, one new block came from the head.
    new_block = table(kv, b)[3]
    assert new_block.block_id == before[0]
    assert free_order(kv) == [i for i in before if i not in (0, 1, 2, new_block.block_id)]
    assert kv.block_pool.num_free_blocks == 4
    kv.free(b)
    assert_pool_idle(kv)


def test_free_queue_primitives():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3] and len(q) == 2
    q.appendleft(blocks[4])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [4, 1, 3, 0]
    assert q.popleft() is blocks[4]
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])  # not in the queue
    for _ in range(3):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.popleft()


def test_double_free_is_detected():
    pool = BlockPool(4)
    blks = pool.get_new_blocks(2)
    pool.free_blocks(blks)
    with pytest.raises(RuntimeError):
        pool.free_blocks(blks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    with pytest.raises(ValueError):
        BlockPool(0)


# --------------------------------------------------------------------------------------------
# All-or-nothing allocation
# --------------------------------------------------------------------------------------------
def test_failed_allocation_changes_nothing_for_a_new_request():
    kv = manager(num_blocks=6)
    a = make_req("a", PROMPT)
    admit(kv, a)
    kv.free(a)  # 3 cached blocks (ref 0) + 3 unhashed free blocks
    holder = make_req("h", [9] * 5)
    admit(kv, holder)  # holds 2 blocks: 4 free, 3 of them cached
    before = snapshot(kv)
    # Hits the 3 cached blocks (they leave the free queue) and needs 2 new blocks: only 1 left.
    big = make_req("big", PROMPT[:12] + [1] * 6)
    hits, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 12
    assert kv.allocate_slots(big, big.num_tokens - num_hit, hits, num_hit) is None
    assert snapshot(kv) == before
    assert "big" not in kv.req_to_blocks
    # Needing exactly what is left succeeds.
    ok = make_req("ok", PROMPT[:12] + [1] * 3)
    hits, num_hit = kv.get_computed_blocks(ok)
    assert kv.allocate_slots(ok, ok.num_tokens - num_hit, hits, num_hit) is not None
    assert kv.block_pool.num_free_blocks == 0
    kv.free(ok)
    kv.free(holder)
    assert_pool_idle(kv)


def test_failed_allocation_changes_nothing_for_a_running_request():
    kv = manager(num_blocks=3)
    a = make_req("a", [3] * 8)
    admit(kv, a)
    b = make_req("b", [4] * 3)
    admit(kv, b)
    assert kv.block_pool.num_free_blocks == 0
    before = snapshot(kv)
    a.append_output_token_ids([5])
    kv.update_block_hashes(a)
    assert kv.allocate_slots(a, 1) is None  # position 8 needs a third block
    assert snapshot(kv) == before
    kv.free(b)
    assert kv.allocate_slots(a, 1) is not None
    kv.free(a)
    assert_pool_idle(kv)


# --------------------------------------------------------------------------------------------
# cache_salt
# --------------------------------------------------------------------------------------------
def test_cache_salt_goes_into_the_first_block_only_and_separates_tenants():
    kv = manager()
    plain = make_req("plain", PROMPT)
    admit(kv, plain)
    salted = make_req("s1", PROMPT, salt="tenant-1")
    assert kv.get_computed_blocks(salted) == ([], 0)  # different salt: miss
    assert salted.block_hashes == expected_hashes(PROMPT, salt="tenant-1")
    assert salted.block_hashes[0] != plain.block_hashes[0]
    # The later blocks differ only through the chain: the salt is hashed into block 0 alone.
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], PROMPT[4:8])
    admit(kv, salted)
    assert not set(blk.block_id for blk in table(kv, salted)) & set(blk.block_id for blk in table(kv, plain))
    other = make_req("s2", PROMPT, salt="tenant-2")
    assert kv.get_computed_blocks(other)[1] == 0
    same = make_req("s1b", PROMPT, salt="tenant-1")
    hits, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 12 and hits == table(kv, salted)[:3]
    for r in (plain, salted):
        kv.free(r)
    assert_pool_idle(kv)


# --------------------------------------------------------------------------------------------
# reset
# --------------------------------------------------------------------------------------------
def test_reset_prefix_cache_refused_while_in_use_then_empties_the_cache():
    kv = manager()
    a = make_req("a", PROMPT)
    admit(kv, a)
    before = snapshot(kv)
    assert kv.reset_prefix_cache() is False
    assert snapshot(kv) == before  # refused: nothing changed
    kv.free(a)
    assert kv.get_computed_blocks(make_req("x", PROMPT))[1] == 12
    assert kv.reset_prefix_cache() is True
    assert not kv.block_pool.cached_blocks
    assert all(blk.block_hash is None for blk in kv.block_pool.blocks)
    assert kv.get_computed_blocks(make_req("y", PROMPT)) == ([], 0)
    assert_pool_idle(kv)
    # The cache works again after a reset.
    b = make_req("b", PROMPT)
    admit(kv, b)
    kv.free(b)
    assert kv.get_computed_blocks(make_req("z", PROMPT))[1] == 12
