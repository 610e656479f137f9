"""KV block pool: reference counts, a free list, an LRU of cached-but-free blocks, and a hash map.

Pure bookkeeping (no tensors): a block id indexes the paged KV tensors the runner owns.

A block is in exactly one of three places:
- held: ref_cnt > 0 (one ref per request table that contains it);
- free list: ref_cnt == 0 and no hash (its contents are worthless);
- evictable LRU: ref_cnt == 0 and hashed (its contents may still serve a prefix hit).
Allocation takes the free list first and evicts from the LRU head only when the free list is
empty, so cached prefixes survive as long as any worthless block is available.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

BlockHash = bytes

# Parent of the first block of every sequence.
ROOT_HASH: BlockHash = b""


def hash_block_tokens(parent_hash: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """Chained hash of (parent_hash, tokens).

    sha256 rather than Python's hash(): a collision here would hand one request another
    request's KV, and tuple hashes are cheap to collide on purpose with crafted prompts.
    Packing the ids as int64 avoids pickling; the parent digest has a fixed length (or is
    empty for the root), so the concatenation is unambiguous.
    """
    return hashlib.sha256(parent_hash + array("q", tokens).tobytes()).digest()


class BlockPool:
    """Blocks with ref counts; free list; LRU of cached-but-free blocks; hash -> block map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # deque so that a fresh pool hands out 0, 1, 2, ... (readable tables in tests and logs).
        self._free: deque[int] = deque(range(num_blocks))
        # Insertion order is LRU order: head = least recently freed = evicted first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}

    # ------------------------------------------------------------------ queries
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the free list plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the hash map (held or evictable)."""
        return len(self._hash_to_block)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._hash_to_block.get(block_hash)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def evictable_order(self) -> list[int]:
        """Evictable blocks, next to be evicted first (for tests and debugging)."""
        return list(self._evictable)

    # ------------------------------------------------------------------ mutations
    def allocate(self, n: int) -> list[int]:
        """Take n blocks with ref 1 each. Raises ValueError (changing nothing) if too few are
        free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks()} free")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._evict_hash(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more ref on each block (a prefix hit); a free cached block leaves the LRU."""
        for block in block_ids:
            if self.ref_cnt[block] == 0:
                if block not in self._evictable:
                    # Only hashed blocks are reachable by a prefix hit; a free unhashed block
                    # here means the caller's hit is stale.
                    raise ValueError(f"block {block} is free and uncached; cannot share it")
                del self._evictable[block]
            self.ref_cnt[block] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one ref on each block, in the order given.

        A block reaching ref 0 goes to the LRU tail if hashed (so it is evicted after every
        block freed before it) or to the free list otherwise.
        """
        for block in block_ids:
            if self.ref_cnt[block] <= 0:
                raise ValueError(f"block {block} freed more often than it was taken")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register block_id under block_hash. Returns False (changing nothing) if the hash is
        already held by another block, or the block already has a hash, or caching is off."""
        if not self.enable_prefix_caching:
            return False
        if self.block_hash[block_id] is not None or block_hash in self._hash_to_block:
            return False
        if self.ref_cnt[block_id] <= 0:
            # Hashing a free block would leave a hashed block on the free list.
            raise ValueError(f"block {block_id} is not held; only held blocks can be cached")
        self.block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash (cold-cache benchmarks). Evictable blocks move to the free list."""
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        for block in self._hash_to_block.values():
            self.block_hash[block] = None
        self._hash_to_block.clear()

    def _evict_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self._hash_to_block[h]
            self.block_hash[block] = None

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        n = self.num_blocks
        assert len(self.ref_cnt) == n and len(self.block_hash) == n, "per-block arrays resized"
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a block appears twice in the free list"
        both = free_set.intersection(self._evictable)
        assert not both, f"blocks {sorted(both)} are both free and evictable"
        for block in self._evictable:
            assert self.block_hash[block] is not None, f"evictable block {block} has no hash"
        for block in range(n):
            ref = self.ref_cnt[block]
            assert ref >= 0, f"block {block} has negative ref count {ref}"
            hashed = self.block_hash[block] is not None
            if ref > 0:
                assert block not in free_set, f"held block {block} (ref {ref}) is on the free list"
                assert block not in self._evictable, f"held block {block} (ref {ref}) is evictable"
            elif hashed:
                assert block in self._evictable, f"free hashed block {block} is not in the LRU"
            else:
                assert block in free_set, (
                    f"free unhashed block {block} is lost (not on the free list)"
                )
        used = sum(1 for r in self.ref_cnt if r > 0)
        assert self.num_free_blocks() + used == n, (
            f"free {self.num_free_blocks()} + used {used} != total {n}"
        )
        for h, block in self._hash_to_block.items():
            assert 0 <= block < n, f"hash map points at nonexistent block {block}"
            assert self.block_hash[block] == h, (
                f"hash map entry for block {block} disagrees with the block"
            )
        num_hashed = sum(1 for h in self.block_hash if h is not None)
        assert num_hashed == len(self._hash_to_block), (
            f"{num_hashed} blocks carry a hash but the map has {len(self._hash_to_block)} entries"
        )
        if not self.enable_prefix_caching:
            assert num_hashed == 0, "prefix caching is off but blocks are hashed"
