"""BlockPool: ref counts, free list vs evictable LRU, hash map, integrity checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaspec.kv.block_pool import ROOT_HASH, BlockPool, hash_block_tokens


def h(i: int) -> bytes:
    return hash_block_tokens(ROOT_HASH, [i])


def snapshot(pool: BlockPool) -> tuple:
    return (
        list(pool.ref_cnt),
        list(pool.block_hash),
        list(pool._free),
        pool.evictable_order(),
        dict(pool._hash_to_block),
    )


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(4, enable_prefix_caching=True)
    assert pool.num_free_blocks() == 4
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_cnt == [1, 1, 1, 0]
    assert pool.num_free_blocks() == 1
    pool.check_integrity()


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_rejects_bad_size(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad, enable_prefix_caching=True)


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(3, enable_prefix_caching=True)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    assert snapshot(pool) == before


def test_unhashed_block_goes_to_free_list_hashed_to_lru():
    pool = BlockPool(3, enable_prefix_caching=True)
    a, b, _ = pool.allocate(3)
    assert pool.cache_block(a, h(1))
    pool.free_blocks([a, b])
    assert pool.evictable_order() == [a]
    assert list(pool._free) == [b]
    assert pool.num_free_blocks() == 2
    pool.check_integrity()


def test_allocation_prefers_free_list_over_eviction():
    pool = BlockPool(2, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1))
    pool.free_blocks([a, b])
    assert pool.allocate(1) == [b]  # the worthless block first
    assert pool.get_cached_block(h(1)) == a  # the cached prefix survives
    pool.check_integrity()


def test_lru_evicts_least_recently_freed_first_and_drops_its_hash():
    pool = BlockPool(3, enable_prefix_caching=True)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, h(i))
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert pool.evictable_order() == [2, 0, 1]
    assert pool.allocate(1) == [2]
    assert pool.get_cached_block(h(2)) is None
    assert pool.block_hash[2] is None
    assert pool.get_cached_block(h(0)) == 0
    assert pool.allocate(1) == [0]
    pool.check_integrity()


def test_touch_revives_evictable_block_and_shares_held_one():
    pool = BlockPool(2, enable_prefix_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(7))
    pool.touch([a])
    assert pool.ref_cnt[a] == 2
    pool.free_blocks([a, a])
    assert pool.is_evictable(a)
    pool.touch([a])
    assert not pool.is_evictable(a) and pool.ref_cnt[a] == 1
    pool.check_integrity()


def test_touch_of_free_uncached_block_is_an_error():
    pool = BlockPool(2, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="free and uncached"):
        pool.touch([1])


def test_double_free_is_an_error():
    pool = BlockPool(2, enable_prefix_caching=True)
    (a,) = pool.allocate(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])


def test_duplicate_hash_keeps_first_mapping():
    pool = BlockPool(2, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1))
    assert not pool.cache_block(b, h(1))
    assert not pool.cache_block(a, h(2))  # a block carries one hash for life
    assert pool.get_cached_block(h(1)) == a and pool.block_hash[b] is None
    pool.check_integrity()


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, h(1))
    pool.free_blocks([a])
    assert pool.num_evictable_blocks() == 0
    pool.check_integrity()


def test_caching_a_free_block_is_an_error():
    pool = BlockPool(2, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="not held"):
        pool.cache_block(0, h(1))


def test_reset_prefix_cache():
    pool = BlockPool(3, enable_prefix_caching=True)
    a, b, _ = pool.allocate(3)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks() == 0 and pool.num_evictable_blocks() == 0
    assert pool.num_free_blocks() == 1
    pool.check_integrity()
    pool.free_blocks([b])
    assert pool.num_evictable_blocks() == 0  # lost its hash, so plain free
    pool.check_integrity()


def test_hash_chain_depends_on_parent_and_tokens():
    a = hash_block_tokens(ROOT_HASH, [1, 2])
    assert a == hash_block_tokens(ROOT_HASH, [1, 2])
    assert a != hash_block_tokens(ROOT_HASH, [2, 1])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(ROOT_HASH, [3, 4])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(
        hash_block_tokens(ROOT_HASH, [1, 3]), [3, 4]
    )


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: p._free.append(0), "twice in the free list"),
        (lambda p: p._evictable.__setitem__(1, None), "both free and evictable"),
        (lambda p: p._free.remove(2), "lost"),
        (lambda p: p.ref_cnt.__setitem__(3, 1), "held block 3"),
        (lambda p: p._hash_to_block.__setitem__(b"x", 0), "hash map"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message):
    pool = BlockPool(4, enable_prefix_caching=True)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


# One op: (kind, argument). The model tracks how many refs the test itself holds per block.
ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 10_000)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 8), caching=st.booleans(), seq=ops)
def test_any_op_sequence_keeps_pool_consistent(num_blocks, caching, seq):
    pool = BlockPool(num_blocks, enable_prefix_caching=caching)
    held: list[int] = []  # one entry per ref the test holds
    for kind, arg in seq:
        if kind == "alloc":
            n = arg % (num_blocks + 2)
            if n > pool.num_free_blocks():
                before = snapshot(pool)
                with pytest.raises(ValueError):
                    pool.allocate(n)
                assert snapshot(pool) == before
            else:
                held += pool.allocate(n)
        elif kind == "free" and held:
            pool.free_blocks([held.pop(arg % len(held))])
        elif kind == "cache" and held:
            pool.cache_block(held[arg % len(held)], h(arg % 5))
        elif kind == "touch":
            cached = [b for b in range(num_blocks) if pool.block_hash[b] is not None]
            if cached:
                blk = cached[arg % len(cached)]
                pool.touch([blk])
                held.append(blk)
        pool.check_integrity()
        assert sorted(b for b in range(num_blocks) for _ in range(pool.ref_cnt[b])) == sorted(held)
        used = sum(1 for r in pool.ref_cnt if r > 0)
        assert pool.num_free_blocks() + used == num_blocks
    pool.free_blocks(held)
    pool.check_integrity()
    assert pool.num_free_blocks() == num_blocks
