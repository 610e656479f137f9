"""KVCacheManager: tables, prefix hits, sharing, eviction, verified-only hashing. The stateful
model check, which also tracks what each KV slot holds, is test_kv_cache_manager_stateful.py."""

from __future__ import annotations

import pytest

from dynaspec.kv.kv_cache_manager import KVCacheManager
from tests.unit.kv_requests import req, run_prompt, snapshot

BS = 4


def test_allocation_grows_in_whole_blocks():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    r = req("a", range(10))
    assert kv.allocate_slots(r, 10)
    assert kv.block_table("a") == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 slots still fit in 3 blocks
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.allocate_slots(r, 3)
    assert kv.block_table("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks() == 4 and kv.usage() == pytest.approx(0.5)
    assert kv.block_table("unknown") == []
    kv.check_integrity()


def test_block_table_is_a_copy():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    r = req("a", range(5))
    kv.allocate_slots(r, 5)
    kv.block_table("a").append(99)
    assert kv.block_table("a") == [0, 1]


def test_rollback_keeps_draft_slots():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    r = req("a", range(7))
    kv.allocate_slots(r, 7 + 4)  # prompt + 4 drafts -> 11 slots, 3 blocks
    r.num_computed_tokens = 7  # all drafts rejected
    kv.allocate_slots(r, 1)
    assert kv.block_table("a") == [0, 1, 2]
    kv.check_integrity()


def test_no_prefix_caching_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    run_prompt(kv, req("a", range(9)))
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert kv.pool.num_cached_blocks() == 0
    assert kv.prefix_cache_queries == 0


def test_shared_prefix_shares_blocks_with_refcounts():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    run_prompt(kv, a)
    ta = kv.block_table("a")
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44])
    blocks, hit = kv.get_computed_blocks(b)
    assert (blocks, hit) == (ta[:2], 8)
    assert kv.allocate_slots(b, b.num_tokens - hit, blocks, hit)
    tb = kv.block_table("b")
    assert tb[:2] == ta[:2] and tb[2] not in ta
    assert [kv.pool.ref_cnt[x] for x in ta] == [2, 2, 1]
    kv.check_integrity()
    kv.free(a)
    assert [kv.pool.ref_cnt[x] for x in ta] == [1, 1, 0]
    assert not kv.pool.is_evictable(ta[0])  # still held by b
    kv.free(b)
    assert kv.num_free_blocks() == 16 and kv.usage() == 0.0
    kv.check_integrity()


def test_hit_never_covers_the_last_token_of_a_block_aligned_prompt():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    run_prompt(kv, req("a", range(8)))
    blocks, hit = kv.get_computed_blocks(req("b", range(8)))
    assert hit == 4 and len(blocks) == 1  # 8 cached, but token 7 must be computed
    blocks, hit = kv.get_computed_blocks(req("c", range(9)))
    assert hit == 8 and len(blocks) == 2
    assert kv.get_computed_blocks(req("d", range(4))) == ([], 0)
    assert kv.get_computed_blocks(req("e", [0])) == ([], 0)


def test_hit_can_extend_into_output_tokens():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = req("a", range(6), output=[50, 51, 52])
    run_prompt(kv, a)
    blocks, hit = kv.get_computed_blocks(req("b", [0, 1, 2, 3, 4, 5, 50, 51, 52, 53]))
    assert hit == 8 and blocks == kv.block_table("a")[:2]


def test_lru_eviction_order_and_eviction_removes_hash():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a, b = req("a", range(100, 109)), req("b", range(200, 209))
    for r in (a, b):
        blocks, hit = kv.get_computed_blocks(r)
        kv.allocate_slots(r, 8)  # two full blocks each, both get cached
        r.num_computed_tokens = 8
        kv.cache_full_blocks(r, 8)
    ta, tb = kv.block_table("a"), kv.block_table("b")
    kv.free(a)
    kv.free(b)
    # a freed first; within a request the tail goes first so the shared head lives longest.
    assert kv.pool.evictable_order() == [ta[1], ta[0], tb[1], tb[0]]
    assert kv.num_free_blocks() == 4 and kv.usage() == 0.0
    c = req("c", range(300, 305))
    assert kv.allocate_slots(c, 5)
    assert kv.block_table("c") == [ta[1], ta[0]]
    assert kv.get_computed_blocks(req("a2", range(100, 109))) == ([], 0)
    assert kv.get_computed_blocks(req("b2", range(200, 209))) == (tb, 8)
    assert kv.pool.block_hash[ta[0]] is None and kv.pool.block_hash[ta[1]] is None
    kv.check_integrity()


def test_hit_on_evictable_blocks_revives_them():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = req("a", range(9))
    run_prompt(kv, a)
    kv.free(a)
    b = req("b", range(9))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert kv.allocate_slots(b, 1, blocks, hit)
    assert all(not kv.pool.is_evictable(x) for x in blocks)
    assert [kv.pool.ref_cnt[x] for x in blocks] == [1, 1]
    kv.check_integrity()


def test_cache_full_blocks_hashes_only_verified_full_blocks():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    r = req("a", range(7))
    kv.allocate_slots(r, 7 + 3)  # prompt + 3 drafts: blocks [0, 1, 2]
    r.num_computed_tokens = 7
    r.output_token_ids.append(77)  # bonus token completes block 1, but its KV is not written
    kv.cache_full_blocks(r, 8)  # caller over-reports; capped at num_computed_tokens
    assert [kv.pool.block_hash[x] is not None for x in kv.block_table("a")] == [True, False, False]
    assert kv.get_computed_blocks(req("b", [0, 1, 2, 3, 4, 5, 6, 77, 9]))[1] == 4
    kv.allocate_slots(r, 1 + 3)  # verify 77 + 3 drafts (slots 8..10), accept 1 draft
    r.num_computed_tokens = 9
    r.output_token_ids += [78, 79]
    kv.cache_full_blocks(r, 9)
    kv.cache_full_blocks(r, 9)  # idempotent
    assert [kv.pool.block_hash[x] is not None for x in kv.block_table("a")] == [True, True, False]
    blocks, hit = kv.get_computed_blocks(req("c", [0, 1, 2, 3, 4, 5, 6, 77, 78, 79]))
    assert hit == 8 and blocks == kv.block_table("a")[:2]
    kv.check_integrity()


def test_duplicate_content_leaves_second_block_unhashed():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a, b = req("a", range(5)), req("b", range(5))
    for r in (a, b):  # both admitted before either is cached: no hit
        kv.allocate_slots(r, 5)
        r.num_computed_tokens = 5
    kv.cache_full_blocks(a, 5)
    kv.cache_full_blocks(b, 5)
    first_a, first_b = kv.block_table("a")[0], kv.block_table("b")[0]
    assert kv.pool.block_hash[first_a] is not None and kv.pool.block_hash[first_b] is None
    kv.check_integrity()
    kv.free(b)
    assert not kv.pool.is_evictable(first_b)  # unhashed: straight to the free list
    kv.free(a)
    assert kv.pool.evictable_order() == [first_a]
    kv.check_integrity()


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = req("a", range(9))
    run_prompt(kv, a)
    kv.free(a)  # 2 evictable cached blocks, 2 plain free ones
    filler = req("f", range(500, 504))
    assert kv.allocate_slots(filler, 4)  # 1 block held -> 3 free, 2 of them a's cached blocks
    b = req("b", list(range(8)) + list(range(600, 610)))  # 18 tokens: 2 hit + 3 new blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    before = snapshot(kv)
    # Reviving the 2 hit blocks uses 2 of the 3 free blocks; 3 new ones do not fit.
    assert not kv.allocate_slots(b, b.num_tokens - hit, blocks, hit)
    assert snapshot(kv)[:4] == before[:4]
    assert kv.block_table("b") == []
    assert not kv.allocate_slots(filler, 20)  # 5 blocks: 4 more than it holds, 3 free
    assert snapshot(kv) == before
    kv.check_integrity()
    assert kv.allocate_slots(req("c", range(700, 712)), 12)  # 3 blocks fit (evicting a's)


def test_evictable_blocks_count_as_free():
    kv = KVCacheManager(2, BS, enable_prefix_caching=True)
    a = req("a", range(8))
    run_prompt(kv, a)
    kv.free(a)
    assert kv.num_free_blocks() == 2 and kv.pool.num_evictable_blocks() == 2
    assert kv.allocate_slots(req("b", range(50, 58)), 8)
    assert kv.pool.num_cached_blocks() == 0
    kv.check_integrity()


def test_free_is_idempotent():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    a = req("a", range(9))
    run_prompt(kv, a)
    kv.free(a)
    kv.free(a)
    kv.free(req("never", [1]))
    assert kv.num_free_blocks() == 4 and kv.block_table("a") == []
    kv.check_integrity()


def test_stale_or_malformed_hit_is_rejected():
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    a = req("a", range(9))
    run_prompt(kv, a)
    kv.free(a)
    b = req("b", range(9))
    blocks, hit = kv.get_computed_blocks(b)
    with pytest.raises(ValueError, match="hit tokens"):
        kv.allocate_slots(b, 1, blocks, hit - 1)
    kv.allocate_slots(req("x", range(900, 912)), 12)  # evicts both cached blocks
    with pytest.raises(ValueError, match="stale prefix hit"):
        kv.allocate_slots(b, 1, blocks, hit)
    kv.check_integrity()


def test_hit_rate_counts_one_lookup_per_admission():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    run_prompt(kv, req("a", range(9)))
    b = req("b", range(10))
    kv.get_computed_blocks(b)
    kv.get_computed_blocks(b)  # still waiting: looked up again, counted once
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9 + 10, 8)
    kv.free(b)  # preempted / never admitted: the next lookup is a new query
    kv.get_computed_blocks(b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9 + 20, 16)
    assert kv.prefix_cache_hit_rate == pytest.approx(16 / 29)


def test_reset_prefix_cache_forgets_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    a = req("a", range(9))
    run_prompt(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    kv.free(a)
    assert kv.num_free_blocks() == 8
    kv.check_integrity()
