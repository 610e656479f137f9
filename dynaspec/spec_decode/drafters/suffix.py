"""Suffix decoding proposer (SuffixDecoding, Oliaro et al., NeurIPS'25; vLLM's `suffix` method).

Two structures answer each request-step (both are `SuffixIndex`es, see suffix_index.py):
  * the request's own prompt + output, kept in sync as tokens are accepted;
  * a global cache of recent requests' outputs, so traffic that repeats across requests (agent
    loops, repeated edits of the same code) drafts from what earlier requests produced.
Each structure matches the longest suffix of the request's context, then follows the most
frequent continuation. The draft with the higher score (sum of its tokens' estimated
probabilities, as arctic-inference scores) wins; a tie goes to the request's own structure.

Draft length follows the evidence, with vLLM's meanings of the knobs:
  * ``max_depth`` bounds match length + draft length (vLLM suffix_decoding_max_tree_depth, 24);
  * ``spec_factor``: at most floor(spec_factor * match length) drafts (..._max_spec_factor, 1.0);
  * ``min_token_prob``: stop before a token whose estimated probability (the running product of
    count(chosen continuation) / count(all continuations)) is below it (..._min_token_prob, 0.1);
  * the K policy's per-request cap k, always.
The match is searched up to max(D - k, ceil(D / (1 + spec_factor))) tokens: the longest match
that still leaves room for the most drafts the three limits allow.

Global cache bounds: at most ``max_cached_requests`` outputs (vLLM's default 10000; 0 turns the
cache off) and ``max_cached_tokens`` tokens; the least recently used output goes first (an
output is used when it is inserted and when it supplies a draft). Evicted slots are marked dead
and compacted away once they outnumber the live ones, so memory stays within
`memory_bound_bytes` of the caps; `cache_stats()` reports what is held.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynaspec.draft_tree import DraftTree
from dynaspec.request import Request
from dynaspec.spec_decode.drafters.base import (
    DrafterCacheStats,
    Drafts,
    Proposer,
    deterministic_drafts,
    tree_shapes,
)
from dynaspec.spec_decode.drafters.suffix_index import SuffixIndex

_MIN_COMPACT = 4096  # dead tokens tolerated before a compaction, at least
# Upper bound on bytes one token slot can cost in a SuffixIndex: int32 array at 2x capacity (8),
# the sorted keys and positions (16), and a recent-dict entry for 1/8 of the slots (<= 200 / 8).
_BYTES_PER_SLOT = 8 + 16 + 25


def memory_bound_bytes(max_cached_tokens: int, max_cached_requests: int) -> int:
    """What the global cache can hold at most: live + dead slots (dead <= max(live, floor)),
    one separator per entry, each at _BYTES_PER_SLOT, plus fixed overhead for the entry table."""
    slots = 2 * max_cached_tokens + _MIN_COMPACT + 2 * max_cached_requests
    return _BYTES_PER_SLOT * slots + 400 * max_cached_requests + (1 << 16)


@dataclass(frozen=True)
class SuffixParams:
    max_depth: int = 24
    spec_factor: float = 1.0
    min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.max_depth < 3:
            raise ValueError(
                f"suffix max_depth must be >= 3 (a 2-token match and 1 draft), got {self.max_depth}"
            )
        if not self.spec_factor > 0:
            raise ValueError(f"suffix spec_factor must be > 0, got {self.spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {self.min_token_prob}")

    def pattern_len(self, k: int) -> int:
        """Longest match worth searching for a cap of k drafts (module docstring)."""
        d = self.max_depth
        return max(2, min(d - 1, max(d - k, math.ceil(d / (1.0 + self.spec_factor)))))

    def draft_len(self, k: int, match_len: int) -> int:
        return max(0, min(k, int(self.spec_factor * match_len + 1e-9), self.max_depth - match_len))


@dataclass
class SuffixDraft:
    token_ids: list[int]
    probs: list[float]
    match_len: int
    parents: list[int] | None = None  # a token tree's (depth-first); None: a chain

    def as_draft(self) -> list[int] | DraftTree:
        if self.parents is None:
            return self.token_ids
        return DraftTree(tuple(self.token_ids), tuple(self.parents))

    @property
    def score(self) -> float:
        return sum(self.probs)



def draft_from(index: SuffixIndex, pattern: np.ndarray, k: int, params: SuffixParams,
               before: int | None = None, tree: bool = False) -> tuple[SuffixDraft, np.ndarray]:
    """The draft `index` offers for `pattern` (its tail), and the match's end positions.
    tree: a token tree of at most k nodes, as deep as a chain could go (`follow_tree`)."""
    ends, m = index.match(pattern, before)
    n = params.draft_len(k, m) if m else 0
    if n == 0:
        return SuffixDraft([], [], m), ends
    if tree:
        tokens, parents, probs = index.follow_tree(ends, k, n, params.min_token_prob)
        return SuffixDraft(tokens, probs, m, parents), ends
    tokens, probs = index.follow(ends, n, params.min_token_prob)
    return SuffixDraft(tokens, probs, m), ends


class GlobalSuffixCache:
    """Recent requests' outputs, one SuffixIndex with a -1 separator before each, LRU-bounded."""

    def __init__(self, max_cached_requests: int, max_cached_tokens: int) -> None:
        if max_cached_requests < 0 or max_cached_tokens < 1:
            raise ValueError("need max_cached_requests >= 0 and max_cached_tokens >= 1, got "
                             f"{max_cached_requests} and {max_cached_tokens}")
        self.max_requests, self.max_tokens = max_cached_requests, max_cached_tokens
        self.reset()

    def reset(self) -> None:
        """Empty the cache (the caps stay)."""
        self.index = SuffixIndex()
        self.entries: OrderedDict[str, tuple[int, int]] = OrderedDict()  # LRU first
        self._starts: list[int] = []  # physical order (ascending), dead entries included
        self._ids: list[str] = []
        self.live_tokens = self.dead_tokens = self.num_evicted = self.num_compactions = 0

    @property
    def enabled(self) -> bool:
        return self.max_requests > 0

    def insert(self, request_id: str, tokens: Sequence[int]) -> None:
        if not self.enabled or len(tokens) < 2:
            return
        tokens = list(tokens[-self.max_tokens:])  # an output longer than the cap keeps its tail
        if request_id in self.entries:
            self._evict(request_id)
        start = self.index.length + 1
        self.index.append([-1] + tokens)
        self.entries[request_id] = (start, start + len(tokens))
        self._starts.append(start)
        self._ids.append(request_id)
        self.live_tokens += len(tokens)
        while len(self.entries) > self.max_requests or self.live_tokens > self.max_tokens:
            self._evict(next(iter(self.entries)))
        if self.dead_tokens > max(self.live_tokens, _MIN_COMPACT):
            self._compact()

    def draft(self, pattern: np.ndarray, k: int, params: SuffixParams,
              tree: bool = False) -> SuffixDraft:
        if not self.entries:
            return SuffixDraft([], [], 0)
        found, ends = draft_from(self.index, pattern, k, params, tree=tree)
        if found.token_ids:
            self._touch(int(ends[-1]))
        return found

    def stats(self) -> dict:
        return {"requests": len(self.entries), "live_tokens": self.live_tokens,
                "dead_tokens": self.dead_tokens, "evictions": self.num_evicted,
                "compactions": self.num_compactions, "bytes": self.nbytes(),
                "max_requests": self.max_requests, "max_tokens": self.max_tokens,
                "bound_bytes": memory_bound_bytes(self.max_tokens, self.max_requests)}

    def nbytes(self) -> int:
        # Entry table: OrderedDict node + key + tuple per entry, and the two position lists.
        return self.index.nbytes() + 200 * len(self.entries) + 100 * len(self._starts)

    def _touch(self, position: int) -> None:
        i = bisect.bisect_right(self._starts, position) - 1
        rid = self._ids[i] if i >= 0 else None
        span = self.entries.get(rid) if rid is not None else None
        if rid is not None and span is not None and span[0] <= position < span[1]:
            self.entries.move_to_end(rid)

    def _evict(self, request_id: str) -> None:
        start, end = self.entries.pop(request_id)
        self.index.kill(start, end)
        self.live_tokens -= end - start
        self.dead_tokens += end - start
        self.num_evicted += 1

    def _compact(self) -> None:
        """Rebuild from the live entries, in LRU order (one vectorised index build)."""
        old = self.index.view()
        parts, entries, starts, ids, at = [], OrderedDict(), [], [], 1
        for rid, (s, e) in self.entries.items():
            parts += [np.full(1, -1, dtype=np.int32), old[s:e]]
            entries[rid] = (at, at + e - s)
            starts.append(at)
            ids.append(rid)
            at += e - s + 1
        self.index = SuffixIndex()
        if parts:
            self.index.append(np.concatenate(parts))
        self.entries, self._starts, self._ids = entries, starts, ids
        self.dead_tokens = 0
        self.num_compactions += 1


@dataclass
class _RequestState:
    index: SuffixIndex
    request: Request  # the live request: its full output is read when it is forgotten


class SuffixProposer(Proposer):
    """Per-request + global suffix drafter. Deterministic, so `Drafts.probs` is None."""

    sizes_own_drafts = True

    def __init__(self, params: SuffixParams, max_cached_requests: int = 10000,
                 max_cached_tokens: int = 1_000_000, tree: bool = False) -> None:
        self.params = params
        self.tree = tree  # draft token trees: k is then a node budget (docs/design.md §4c)
        self.drafts_trees = tree
        self.cache = GlobalSuffixCache(max_cached_requests, max_cached_tokens)
        self._states: dict[str, _RequestState] = {}
        self.num_global_drafts = self.num_local_drafts = 0

    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int], *,
                fallback_k: Sequence[int] | None = None,
                trees: Sequence[bool] | None = None) -> Drafts:
        """`trees`: per request, a tree (True) or a chain; None: trees where built with them."""
        shapes = tree_shapes(self.tree, len(requests), trees)
        return deterministic_drafts(requests, k_per_request, self._draft_one, shapes)

    def _draft_one(self, request: Request, k: int, tree: bool) -> list[int] | DraftTree:
        index = self._synced_index(request)
        pattern = index.view()[-self.params.pattern_len(k):]
        local, _ = draft_from(index, pattern, k, self.params, before=index.length - 1,
                              tree=tree)
        best = local
        # A global draft scores at most one per token and at most k tokens: a full-length,
        # probability-1 local draft cannot be beaten (ties go local), so skip the lookup.
        if self.cache.enabled and local.score < k - 1e-9:
            glob = self.cache.draft(pattern, k, self.params, tree)
            if glob.score > local.score:
                best = glob
        if best.token_ids:
            if best is local:
                self.num_local_drafts += 1
            else:
                self.num_global_drafts += 1
        return best.as_draft()

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: its output joins the global cache."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.insert(request_id, state.request.output_token_ids)

    def preempt(self, request_id: str) -> None:
        """Preempted: drop the per-request structure only (its output is cached when it ends)."""
        self._states.pop(request_id, None)

    def reset_cache(self) -> None:
        """Empty the global cache (benchmarks start every measured pass cold)."""
        self.cache.reset()

    def num_cached(self) -> int:
        return len(self._states)

    def cache_stats(self) -> DrafterCacheStats:
        return DrafterCacheStats(**self.cache.stats(), local_drafts=self.num_local_drafts,
                                 global_drafts=self.num_global_drafts,
                                 request_bytes=sum(s.index.nbytes() for s in self._states.values()))

    def _synced_index(self, request: Request) -> SuffixIndex:
        """The request's index with every prompt/output token appended (never drafts)."""
        prompt, output = request.prompt_token_ids, request.output_token_ids
        total = len(prompt) + len(output)
        state = self._states.get(request.request_id)
        if state is None or not _still_valid(state, request, total):
            state = _RequestState(SuffixIndex(), request)
            self._states[request.request_id] = state
        index = state.index
        n = index.length
        if n < total:
            new = (prompt[n:] + output) if n < len(prompt) else output[n - len(prompt):]
            index.append(new)
        return index


def _still_valid(state: _RequestState, request: Request, total: int) -> bool:
    # Tokens only grow by appending; another Request object under the same id (or a shrunk
    # sequence) means the index describes another sequence and is rebuilt.
    if state.request is not request or state.index.length > total:
        return False
    n = state.index.length
    return n == 0 or int(state.index.view()[n - 1]) == request.token_at(n - 1)
