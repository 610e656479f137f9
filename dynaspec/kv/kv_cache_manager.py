"""Per-request block tables over a BlockPool, with prefix caching.

Contract the scheduler relies on:
- A request's table only grows while it runs; it covers every slot written so far, including
  speculative draft slots. After a rollback the caller lowers num_computed_tokens and the
  extra slots are rewritten next step, so nothing is freed until free(request).
- Only blocks made entirely of tokens whose KV is written and verified are hashed
  (cache_full_blocks), so a prefix hit never serves a draft's KV or an unwritten slot.
- A prefix hit is always whole blocks and never covers the last prompt token, so a request
  never writes into a block it shares with another request.
- request.all_token_ids is append-only while the request lives: block hashes are cached per
  request and extended incrementally, never recomputed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from dynaspec.kv.block_pool import ROOT_HASH, BlockHash, BlockPool, hash_block_tokens


class _ReqState:
    """What the manager remembers about one request between calls."""

    __slots__ = ("table", "hashes", "num_cached_blocks", "lookup_queries", "lookup_hits")

    def __init__(self) -> None:
        self.table: list[int] = []
        # hashes[i] = chained hash of block i of all_token_ids (full blocks only).
        self.hashes: list[BlockHash] = []
        # Table blocks [0, num_cached_blocks) were already offered to the prefix cache.
        self.num_cached_blocks = 0
        # The lookup counted in the hit-rate metric for this admission (replaced, not added,
        # when a waiting request is looked up again on a later step).
        self.lookup_queries = 0
        self.lookup_hits = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found, cumulative
        self._reqs: dict[str, _ReqState] = {}

    # ------------------------------------------------------------------ prefix lookup
    def get_computed_blocks(self, request: Any) -> tuple[list[int], int]:
        """Longest prefix-cache hit in whole blocks, capped so at least one token is computed.

        Takes no references: pass the result straight to allocate_slots. The hit-rate metric
        counts one lookup per admission: looking up a still-waiting request again replaces its
        previous count instead of adding to it.
        """
        if not self.enable_prefix_caching:
            return [], 0
        num_tokens = request.num_tokens
        max_blocks = max(0, (num_tokens - 1) // self.block_size)
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqState()
        hashes = self._hash_chain(request, state, max_blocks)
        hit: list[int] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(hashes[i])
            if block is None:
                break
            hit.append(block)
        hit_tokens = len(hit) * self.block_size
        self.prefix_cache_queries += num_tokens - state.lookup_queries
        self.prefix_cache_hits += hit_tokens - state.lookup_hits
        state.lookup_queries, state.lookup_hits = num_tokens, hit_tokens
        return hit, hit_tokens

    def _hash_chain(self, request: Any, state: _ReqState, num_blocks: int) -> list[BlockHash]:
        """Extend the request's cached hash chain to at least num_blocks full blocks."""
        hashes = state.hashes
        if len(hashes) < num_blocks:
            bs = self.block_size
            tokens = request.token_slice(len(hashes) * bs, num_blocks * bs)
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(0, len(tokens), bs):
                parent = hash_block_tokens(parent, tokens[i : i + bs])
                hashes.append(parent)
        return hashes

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> bool:
        """Grow the table to cover num_computed_tokens + num_new_computed_tokens + num_new_tokens
        slots. Returns False and changes nothing if the pool (free + evictable) is too small."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got {num_new_tokens} new, {num_new_computed_tokens} "
                f"computed"
            )
        state = self._reqs.get(request.request_id)
        table = state.table if state is not None else []
        hit = new_computed_blocks or []
        if hit or num_new_computed_tokens:
            state = self._check_hit(request, state, hit, num_new_computed_tokens)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        need = max(0, -(-total // self.block_size) - len(table) - len(hit))
        # Sharing a free cached block takes it out of the allocatable set too.
        reclaimed = sum(1 for b in hit if self.pool.ref_cnt[b] == 0)
        if need + reclaimed > self.pool.num_free_blocks():
            return False
        if state is None:
            state = self._reqs[request.request_id] = _ReqState()
        if hit:
            self.pool.touch(hit)
            state.table.extend(hit)
            # Hit blocks are already in the cache; cache_full_blocks starts after them.
            state.num_cached_blocks = len(hit)
        if need:
            state.table.extend(self.pool.allocate(need))
        return True

    def _check_hit(
        self, request: Any, state: _ReqState | None, hit: list[int], num_hit_tokens: int
    ) -> _ReqState:
        """Reject a prefix hit that is malformed or went stale since get_computed_blocks.

        A stale hit (a block evicted and reused in between) would silently serve another
        sequence's KV, so it is an error, not a quiet miss.
        """
        if not self.enable_prefix_caching:
            raise ValueError("prefix caching is off; allocate_slots got computed blocks")
        if state is not None and state.table:
            raise ValueError(
                f"request {request.request_id}: computed blocks only on the first allocation"
            )
        if request.num_computed_tokens != 0:
            raise ValueError(
                f"request {request.request_id}: prefix hit with num_computed_tokens != 0"
            )
        if num_hit_tokens != len(hit) * self.block_size:
            raise ValueError(
                f"request {request.request_id}: {num_hit_tokens} hit tokens for {len(hit)} blocks "
                f"of {self.block_size}"
            )
        if num_hit_tokens > request.num_tokens - 1:
            raise ValueError(
                f"request {request.request_id}: prefix hit must leave one token to compute"
            )
        if state is None:
            state = self._reqs[request.request_id] = _ReqState()
        hashes = self._hash_chain(request, state, len(hit))
        for i, block in enumerate(hit):
            if self.pool.block_hash[block] != hashes[i]:
                raise ValueError(
                    f"request {request.request_id}: stale prefix hit, block {block} no longer "
                    f"holds "
                    f"block {i} of the prompt; call get_computed_blocks right before allocate_slots"
                )
        return state

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids (empty if it holds none)."""
        state = self._reqs.get(request_id)
        return list(state.table) if state is not None else []

    def free(self, request: Any) -> None:
        """Drop the request's refs and forget it. Idempotent.

        Freed in reverse so a sequence's tail blocks enter the LRU before its head blocks and
        are evicted first: a head block serves every request sharing the prefix, a tail block
        is useless once its parent is gone.
        """
        state = self._reqs.pop(request.request_id, None)
        if state is not None and state.table:
            self.pool.free_blocks(reversed(state.table))

    # ------------------------------------------------------------------ prefix registration
    def cache_full_blocks(self, request: Any, num_verified_tokens: int) -> None:
        """Register the request's blocks made entirely of its first num_verified_tokens tokens.

        Capped at num_computed_tokens and num_tokens as well: a block whose last slot is still
        unwritten (e.g. the bonus token just sampled) must not be served to anyone. Idempotent;
        a block whose hash another block already holds stays unhashed.
        """
        if not self.enable_prefix_caching:
            return
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        n_tokens = min(num_verified_tokens, request.num_computed_tokens, request.num_tokens)
        num_full = min(n_tokens // self.block_size, len(state.table))
        if num_full <= state.num_cached_blocks:
            return
        hashes = self._hash_chain(request, state, num_full)
        pool = self.pool
        for i in range(state.num_cached_blocks, num_full):
            block = state.table[i]
            if pool.block_hash[block] is None:
                pool.cache_block(block, hashes[i])
        state.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (cold-cache measurements); held blocks stay held."""
        self.pool.reset_prefix_cache()

    # ------------------------------------------------------------------ metrics
    def num_free_blocks(self) -> int:
        """Blocks available to allocate, evictable cached blocks included."""
        return self.pool.num_free_blocks()

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks() / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def check_integrity(self) -> None:
        """Pool invariants plus: each block's ref count equals the tables that hold it, and
        every hashed block in a table carries the hash of that table position."""
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        for rid, state in self._reqs.items():
            assert len(set(state.table)) == len(state.table), f"request {rid} holds a block twice"
            holders.update(state.table)
            assert state.num_cached_blocks <= len(state.table), (
                f"request {rid}: {state.num_cached_blocks} cached blocks > table length "
                f"{len(state.table)}"
            )
            for i in range(min(state.num_cached_blocks, len(state.hashes))):
                h = self.pool.block_hash[state.table[i]]
                assert h is None or h == state.hashes[i], (
                    f"request {rid}: block {state.table[i]} at position {i} carries another "
                    f"prefix's hash"
                )
        for block in range(self.num_blocks):
            assert self.pool.ref_cnt[block] == holders[block], (
                f"block {block}: ref count {self.pool.ref_cnt[block]} but {holders[block]} tables "
                f"hold it"
            )
        assert 0 <= self.prefix_cache_hits <= self.prefix_cache_queries, (
            "hit tokens exceed query tokens"
        )
