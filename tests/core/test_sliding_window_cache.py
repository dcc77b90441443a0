"""The KV cache manager with a sliding window (every layer reads only the last ``window`` keys,
as Mistral v0.1): blocks that left the window of every future query go back to the pool as a
request moves on, the table keeps its indexes, prefix hits need only the window's blocks before
the hit point, and the pool's invariants hold through preemption and aborts. No model: the fake
worker of core_utils and a simulated slot array stand in for the model runner.
"""
from __future__ import annotations

import random

import pytest

from core_utils import B, EOS, assert_scheduler_idle, check_invariants, make_kv_manager, make_request, make_scheduler, step
from pagedserve.bench.window_memory import measure_window_blocks, window_report
from pagedserve.core.kv_cache_manager import UNHELD, blocks_held_alone, num_skipped_blocks
from pagedserve.core.outputs import ModelRunnerOutput
from pagedserve.core.request import RequestStatus


def _skippable_by_definition(c: int, window: int) -> int:
    """Leading blocks none of whose positions a query at position >= c reads (it reads k with
    q - window < k <= q)."""
    n = 0
    while all(k <= c - window for k in range(n * B, (n + 1) * B)):
        n += 1
    return n


@pytest.mark.parametrize("window", [1, 3, 4, 5, 8, 9, 16])
def test_skipped_blocks_match_the_window_definition(window):
    for c in range(0, 80):
        assert num_skipped_blocks(c, window, B) == _skippable_by_definition(c, window), c
    assert num_skipped_blocks(79, None, B) == 0


@pytest.mark.parametrize("window,chunk", [(8, 1), (8, 5), (9, 12), (16, 3), (5, 40)])
def test_blocks_held_alone_bounds_a_lone_request_by_brute_force(window, chunk):
    """The most blocks any allocation holds (from num_skipped_blocks(c) to the chunk's end),
    over every computed count c and chunk size up to ``chunk``."""
    worst = max(-(-(c + n) // B) - num_skipped_blocks(c, window, B) for c in range(200) for n in range(1, chunk + 1))
    assert blocks_held_alone(10**6, B, window, chunk) == worst
    assert blocks_held_alone(10, B, window, chunk) == min(worst, 3)
    assert blocks_held_alone(50, B, None, chunk) == blocks_held_alone(50, B, window, None) == 13


def test_long_decode_holds_a_flat_number_of_blocks_past_the_window():
    """Prompt of 10, 80 decodes, window 8 with blocks of 4: once past the window the request
    holds at most ceil(8 / 4) + 1 blocks at every step; without a window it holds them all."""
    window = 8
    used = {}
    for w in (window, None):
        s = make_scheduler(num_blocks=64, window=w)
        s.add_request(make_request("a", list(range(10, 20)), max_tokens=80, ignore_eos=True))
        used[w] = []
        while s.has_unfinished_requests():
            step(s)
            check_invariants(s)
            used[w].append(s.kv_cache_manager.block_pool.num_used_blocks)
        assert_scheduler_idle(s)
    past = used[window][window:-1]  # the last step finished the request
    assert max(past) <= -(-window // B) + 1 and min(past) >= -(-window // B)
    assert used[None][-2] == -(-88 // B)  # the whole table: 88 tokens computed before the last step
    # Table indexes are stable: the fake worker (built from diffs) holds one entry per block.


def test_released_blocks_keep_their_table_entries_and_are_cached_evictable():
    s = make_scheduler(num_blocks=32, window=8)
    req = make_request("a", list(range(100, 124)), max_tokens=3, ignore_eos=True)  # 6 full blocks
    s.add_request(req)
    step(s)  # the whole prompt in one chunk: nothing released yet
    kv = s.kv_cache_manager
    table = list(kv.req_to_blocks["a"])
    assert kv.num_released.get("a", 0) == 0 and len(table) == 6
    step(s)  # the first decode: num_computed 24, (24 - 8 + 1) // 4 = 4 blocks left the window
    assert kv.num_released["a"] == 4
    assert kv.req_to_blocks["a"][:6] == table  # same entries, same ids
    assert [b.ref_cnt for b in table] == [0, 0, 0, 0, 1, 1]
    pool = kv.block_pool
    assert all(b.block_hash is not None and pool.cached_blocks[b.block_hash] is b for b in table[:4])
    assert pool.num_cached_free_blocks == 4
    check_invariants(s)
    while s.has_unfinished_requests():
        step(s)
    assert_scheduler_idle(s)


def _cache(kv, hashes: list[bytes], indexes: set[int]) -> None:
    """Register blocks for the chosen hashes, as finished requests would leave them."""
    pool = kv.block_pool
    blocks = pool.get_new_blocks(len(indexes))
    for b, i in zip(blocks, sorted(indexes)):
        pool.cache_block(b, hashes[i])
    pool.free_blocks(blocks)


def _best_hit_by_definition(cached: set[int], max_blocks: int, window: int) -> int:
    """The largest n <= max_blocks whose window blocks before token n * B are all cached."""
    return max(n for n in range(max_blocks + 1) if all(i in cached for i in range(num_skipped_blocks(n * B, window, B), n)))


@pytest.mark.parametrize("window", [4, 5, 8, 13])
def test_prefix_hit_needs_only_the_window_before_the_hit_point(window):
    rnd = random.Random(window)
    for trial in range(60):
        kv = make_kv_manager(num_blocks=40, window=window)
        req = make_request(f"r{trial}", [rnd.randrange(3, 50) for _ in range(rnd.randint(1, 60))])
        kv.update_block_hashes(req)
        cached = {i for i in range(len(req.block_hashes)) if rnd.random() < 0.7}
        _cache(kv, req.block_hashes, cached)
        hits, num_hit = kv.get_computed_blocks(req)
        n = _best_hit_by_definition(cached, (req.num_tokens - 1) // B, window)
        assert num_hit == n * B and len(hits) == n
        first = num_skipped_blocks(n * B, window, B)
        assert all(b is UNHELD for b in hits[:first])
        assert [b.block_hash for b in hits[first:]] == req.block_hashes[first:n]
        # Only the window's blocks are taken; the table keeps every index.
        free_before = kv.num_free_blocks
        assert kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is not None
        assert kv.num_released.get(req.request_id, 0) == first
        assert len(kv.get_block_ids(req.request_id)) == -(-req.num_tokens // B)
        assert free_before - kv.num_free_blocks == -(-req.num_tokens // B) - first
        kv.free(req)
        assert kv.num_free_blocks == 40 and not kv.num_released and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_a_second_run_of_the_same_prompt_hits_past_the_released_blocks():
    """100-token prompt, window 16, blocks of 4: the first request released its old blocks
    (still cached); the second hits 96 tokens and takes only the window's 4 blocks."""
    s = make_scheduler(num_blocks=64, budget=128, window=16)
    prompt = [(7 * i) % 41 + 3 for i in range(100)]
    for rid in ("first", "second"):
        s.add_request(make_request(rid, prompt, max_tokens=5, ignore_eos=True))
        while s.has_unfinished_requests():
            step(s)
            check_invariants(s)
    st = s.get_stats()
    assert st.prefix_cache_queries == 200 and st.prefix_cache_hits == 96
    assert_scheduler_idle(s)


class WindowHarness:
    """Scheduler + fake model: every scheduled token's (request, token) is written to a
    simulated slot array, then each query checks the slots of every key in its window: a
    block released while still inside a window and reused by another request fails here."""

    def __init__(self, rnd: random.Random, window: int, num_blocks: int, budget: int, caching: bool) -> None:
        max_len = 40
        self.s = make_scheduler(num_blocks=num_blocks, budget=budget, max_num_seqs=4, max_model_len=max_len, caching=caching, window=window)
        assert blocks_held_alone(max_len, B, window, budget) <= num_blocks  # the engine checks this
        self.rnd, self.window, self.slots, self.n = rnd, window, {}, 0

    def add(self) -> None:
        shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16][: self.rnd.choice([0, 8, 12])]
        tokens = (shared + [self.rnd.randrange(3, 9) for _ in range(self.rnd.randint(1, 20))])[:39]
        self.s.add_request(make_request(f"q{self.n}", tokens, max_tokens=self.rnd.randint(1, 30)))
        self.n += 1

    def step(self) -> None:
        s, W = self.s, self.window
        so = s.schedule()
        scheduled = s.fake_worker.apply(so)
        for sr in scheduled:
            bt = sr.block_ids
            for p in range(sr.num_computed_tokens, sr.num_computed_tokens + sr.num_new_tokens):
                self.slots[bt[p // B] * B + p % B] = sr.token_ids[p]
        for sr in scheduled:
            bt, c = sr.block_ids, sr.num_computed_tokens
            for p in range(max(0, c - W + 1), c + sr.num_new_tokens):
                assert self.slots.get(bt[p // B] * B + p % B) == sr.token_ids[p], (sr, p)
        if scheduled and self.rnd.random() < 0.05:  # abort between schedule and update
            s.finish_requests([self.rnd.choice(scheduled).request_id], RequestStatus.FINISHED_ABORTED)
        toks = {sr.request_id: (EOS if self.rnd.random() < 0.05 else self.rnd.randrange(3, 9)) for sr in scheduled if sr.samples}
        for rid, t in toks.items():
            s.fake_worker.token_ids[rid].append(t)
        s.update_from_output(so, ModelRunnerOutput(sampled=toks))
        check_invariants(s)


@pytest.mark.parametrize("seed", range(12))
def test_random_interleavings_with_a_window_keep_the_invariants(seed):
    """Small pools (preemption), chunks that straddle the window edge, shared prefixes (hits
    after released blocks), aborts mid-way; every step's reads and the invariants checked."""
    rnd = random.Random(seed)
    h = WindowHarness(rnd, window=rnd.choice([4, 6, 8, 9]), num_blocks=rnd.randint(9, 16), budget=rnd.choice([3, 5, 8, 16]), caching=seed % 4 != 3)
    s = h.s
    for _ in range(120):
        x = rnd.random()
        if x < 0.25:
            h.add()
        elif x < 0.28 and s.requests:
            s.finish_requests([rnd.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
            check_invariants(s)
        else:
            h.step()
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        h.step()
    assert_scheduler_idle(s)


def test_window_memory_report_pure_and_hybrid():
    """The bench's figures: the allocator's blocks for one request (10 prefill chunks of 100,
    then decodes to 1,100 tokens, window 64, blocks of 16), and the bytes they make for a pure
    and for a 2 local : 1 global model (100 bytes per token per layer)."""
    m = measure_window_blocks(1100, 16, 64, chunk=100, num_decode=100)
    assert m["full_blocks"] == 69
    # e.g. the chunk at 900 computed: blocks (900 - 63) // 16 = 52 to ceil(1000 / 16) - 1 = 62
    assert m["peak_blocks"] == 11 <= blocks_held_alone(10**6, 16, 64, 100)
    decodes = [-(-(c + 1) // 16) - num_skipped_blocks(c, 64, 16) for c in range(1000, 1100)]
    assert m["decode_blocks"] == max(decodes) == 5
    assert measure_window_blocks(1100, 16, None, chunk=100, num_decode=100)["peak_blocks"] == 69
    per_block = 16 * 100
    pure = window_report([64] * 3, 100, 1100, 16, 100, 100)
    assert pure["kind"] == "pure" and pure["bytes_no_freeing"] == 69 * per_block * 3
    assert pure["bytes_freeing_peak"] == 11 * per_block * 3 and pure["bytes_freeing_decode"] == 5 * per_block * 3
    hybrid = window_report([64, 64, None], 100, 1100, 16, 100, 100)
    assert hybrid["kind"] == "hybrid" and hybrid["bytes_one_table"] == hybrid["bytes_no_freeing"] == 69 * per_block * 3
    assert hybrid["bytes_per_group_decode"] == (69 + 5 * 2) * per_block
    assert hybrid["bytes_per_group_peak"] == (69 + 11 * 2) * per_block
    assert window_report([None] * 3, 100, 1100, 16, 100)["kind"] == "none"
