"""A token sequence indexed for suffix matching: the structure behind the suffix drafter.

It answers the two questions a suffix tree answers for SuffixDecoding, without building one:
  * match: the longest suffix of a pattern that occurs in the sequence, and where;
  * follow: from those occurrences, the path of most frequent next tokens, with each token's
    estimated probability (count of the chosen continuation / count of all continuations),
    the product taken along the path, as in a suffix tree whose node counts are occurrence
    counts.
The occurrences of a suffix are exactly the leaves under its suffix-tree node, so walking
occurrence lists gives the same counts as walking the tree, at O(occurrences) per query.

Layout: tokens in one int32 array (-1 = a dead or separator slot; never a real token, so a match
or a path never crosses it) and an index from each bigram to the positions where it ends, so a
query starts from the few places where the last two tokens occur instead of scanning the array.
The index has two parts: `_keys`/`_pos`, sorted arrays over positions [0, _frozen) built in one
vectorised pass (a prompt, a compaction), and `_recent`, a dict of lists for positions appended
since, merged into the sorted part when it grows past 1/8 of it (amortised O(log n) per token, in
numpy). Match lengths start at 2: one shared token is too weak a signal to draft from.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Sequence

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)
_MIN_CAPACITY = 256
_MIN_RECENT = 1024  # recent positions kept in the dict before a merge, at least
_MAX_GATHER = 1 << 15  # candidates x lengths compared in one gather, at most


def _bigram_keys(tokens: np.ndarray) -> np.ndarray:
    """[n] int32 -> [n-1] int64 key of each (tokens[i], tokens[i+1]); -1 where either is dead."""
    a, b = tokens[:-1].astype(np.int64), tokens[1:].astype(np.int64)
    return np.where((a >= 0) & (b >= 0), (a << 32) | b, -1)


class SuffixIndex:
    """Tokens plus a bigram -> end positions index. Not thread-safe; one owner."""

    def __init__(self) -> None:
        self._tokens = np.full(_MIN_CAPACITY, -1, dtype=np.int32)
        self.length = 0
        self._keys = _EMPTY  # [n_frozen_pairs] sorted bigram keys
        self._pos = _EMPTY  # [n_frozen_pairs] end position of each key, ascending within a key
        self._frozen = 0  # positions < _frozen are in the sorted arrays
        self._recent: dict[int, list[int]] = {}
        self._num_recent = 0

    # ---- building ------------------------------------------------------------------------
    def view(self) -> np.ndarray:
        return self._tokens[: self.length]

    def append(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append token ids (-1 appends a separator). Large batches take the vectorised path."""
        new = np.asarray(tokens, dtype=np.int32)
        n = new.shape[0]
        if n == 0:
            return
        end = self.length + n
        if end > self._tokens.shape[0]:
            grown = np.full(max(2 * self._tokens.shape[0], end), -1, dtype=np.int32)
            grown[: self.length] = self._tokens[: self.length]
            self._tokens = grown
        start = self.length
        self._tokens[start:end] = new
        self.length = end
        if self._num_recent + n > max(_MIN_RECENT, self._frozen // 8):
            self._rebuild()
            return
        prev = int(self._tokens[start - 1]) if start > 0 else -1
        for p, t in enumerate(new.tolist(), start):
            if prev >= 0 and t >= 0:
                self._recent.setdefault((prev << 32) | t, []).append(p)
                self._num_recent += 1
            prev = t

    def kill(self, start: int, end: int) -> None:
        """Mark [start, end) dead: its positions stay indexed but never match again."""
        self._tokens[start:end] = -1

    def _rebuild(self) -> None:
        keys = _bigram_keys(self.view())  # [length-1]; key i ends at position i+1
        ends = np.flatnonzero(keys >= 0)
        order = np.argsort(keys[ends], kind="stable")  # stable: positions stay ascending
        self._keys = keys[ends][order]
        self._pos = ends[order] + 1
        self._frozen = self.length
        self._recent, self._num_recent = {}, 0

    # ---- queries -------------------------------------------------------------------------
    def bigram_ends(self, a: int, b: int) -> np.ndarray:
        """Ascending positions p with tokens[p-1:p+1] == (a, b) when indexed (may include dead)."""
        key = (a << 32) | b
        lo, hi = np.searchsorted(self._keys, [key, key + 1])
        frozen = self._pos[lo:hi]
        recent = self._recent.get(key)
        if recent is None:
            return frozen
        return np.concatenate([frozen, np.asarray(recent, dtype=np.int64)])

    def match(self, pattern: np.ndarray, before: int | None = None) -> tuple[np.ndarray, int]:
        """(end positions, m): the longest suffix of `pattern` (m >= 2 tokens, m <= len(pattern))
        that occurs ending before position `before` (default: anywhere), and where it ends.
        Returns (empty, 0) when not even the last two tokens occur."""
        if pattern.shape[0] < 2 or pattern[-1] < 0 or pattern[-2] < 0:
            return _EMPTY, 0
        cand = self.bigram_ends(int(pattern[-2]), int(pattern[-1]))
        if before is not None:
            cand = cand[cand < before]
        tokens = self._tokens
        cand = cand[tokens[cand] == pattern[-1]]  # drop dead (killed) positions
        if cand.size == 0:
            return _EMPTY, 0
        m = 2
        # Narrow one length at a time while the candidates are many; then settle the rest in
        # one [candidates, lengths] comparison (fewer numpy calls: this runs every step).
        while cand.size * (pattern.shape[0] - m) > _MAX_GATHER and m < pattern.shape[0]:
            nxt = cand[cand >= m]
            nxt = nxt[tokens[nxt - m] == pattern[-1 - m]]
            if nxt.size == 0:
                return cand, m
            cand, m = nxt, m + 1
        if m == pattern.shape[0]:
            return cand, m
        offsets = np.arange(m, pattern.shape[0])  # [L] lengths still to check, as back offsets
        idx = cand[:, None] - offsets  # [C, L]
        eq = (tokens[np.maximum(idx, 0)] == pattern[::-1][offsets]) & (idx >= 0)  # [C, L]
        run = np.cumprod(eq, axis=1).sum(axis=1)  # [C] extra matched tokens per candidate
        best = int(run.max())
        return cand[run == best], m + best

    def follow(
        self, ends: np.ndarray, max_tokens: int, min_prob: float
    ) -> tuple[list[int], list[float]]:
        """The most frequent continuation path after the occurrences ending at `ends`.

        Step j keeps the occurrences that agree with the path so far; its token is the most
        frequent next token among them (ties: the one seen most recently), and its probability
        is the running product of count(chosen) / count(all continuations). The path stops
        before a token whose probability falls below `min_prob`, at a dead slot, or at the end.
        """
        tokens, length = self._tokens, self.length
        pos = ends + 1
        if pos.shape[0] == 1:  # one occurrence (long matches): its continuation, probability 1
            run = tokens[int(pos[0]): min(length, int(pos[0]) + max_tokens)]
            dead = np.flatnonzero(run < 0)
            run = run[: dead[0]] if dead.size else run
            return run.tolist(), [1.0] * run.shape[0]
        out: list[int] = []
        probs: list[float] = []
        prob = 1.0
        for _ in range(max_tokens):
            pos = pos[pos < length]
            nxt = tokens[pos]
            live = nxt >= 0
            pos, nxt = pos[live], nxt[live]
            if nxt.size == 0:
                break
            best, share = _most_frequent(nxt)
            prob *= share
            if prob < min_prob:
                break
            out.append(best)
            probs.append(prob)
            pos = pos[nxt == best] + 1
        return out, probs

    def follow_tree(self, ends: np.ndarray, max_nodes: int, max_depth: int, min_prob: float
                    ) -> tuple[list[int], list[int], list[float]]:
        """SuffixDecoding's greedy tree expansion after the occurrences ending at `ends`: every
        continuation seen is a candidate node, its estimated probability the running product of
        count(token) / count(all continuations) along its path; the likeliest candidate joins
        the tree next (its own continuations become candidates) until `max_nodes` nodes, none
        deeper than `max_depth` or below `min_prob`. Returns (tokens, parents, probabilities),
        depth-first with the likelier child first; a tree with one child per node is the
        `follow` chain."""
        tokens, length = self._tokens, self.length
        heap: list[tuple[float, int, int, int, int, np.ndarray]] = []
        order = 0  # tie-break: the earlier candidate (heapq compares the tuple in order)

        def push(pos: np.ndarray, parent: int, prob: float, depth: int) -> None:
            nonlocal order
            if depth >= max_depth:
                return
            pos = pos[pos < length]
            nxt = tokens[pos]
            live = nxt >= 0
            pos, nxt = pos[live], nxt[live]
            if nxt.size == 0:
                return
            vals, counts = np.unique(nxt, return_counts=True)
            for v, c in zip(vals.tolist(), counts.tolist()):
                p = prob * c / nxt.size
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, parent, v, depth, pos[nxt == v] + 1))
                    order += 1

        push(ends + 1, -1, 1.0, 0)
        toks: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        depths: list[int] = []
        while heap and len(toks) < max_nodes:
            neg, _, parent, tok, depth, pos = heapq.heappop(heap)
            toks.append(tok)
            parents.append(parent)
            probs.append(-neg)
            depths.append(depth)
            push(pos, len(toks) - 1, -neg, depth + 1)
        return _depth_first(toks, parents, probs)

    def nbytes(self) -> int:
        """Bytes held: the arrays exactly, the recent dict as CPython sizes (lists, ints, keys)."""
        recent = sys.getsizeof(self._recent) + sum(
            sys.getsizeof(v) + 28 * len(v) + 32 for v in self._recent.values()
        )
        return int(self._tokens.nbytes + self._keys.nbytes + self._pos.nbytes + recent)


def _most_frequent(values: np.ndarray) -> tuple[int, float]:
    """(value, its share) of the most frequent entry; ties go to the latest (last) occurrence."""
    first = int(values[0])
    if values.shape[0] == 1 or bool((values == first).all()):
        return first, 1.0
    rev = values[::-1]
    vals, first_rev, counts = np.unique(rev, return_index=True, return_counts=True)
    top = counts.max()
    tied = np.flatnonzero(counts == top)
    best = tied[np.argmin(first_rev[tied])]
    return int(vals[best]), float(top) / values.shape[0]


def _depth_first(tokens: list[int], parents: list[int], probs: list[float]
                 ) -> tuple[list[int], list[int], list[float]]:
    """Nodes given in any parents-first order, reordered depth-first, likelier children first."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    out_t: list[int] = []
    out_p: list[int] = []
    out_q: list[float] = []
    stack = [(c, -1) for c in sorted(kids.get(-1, []), key=lambda c: probs[c])]
    while stack:
        node, parent = stack.pop()
        idx = len(out_t)
        out_t.append(tokens[node])
        out_p.append(parent)
        out_q.append(probs[node])
        stack.extend((c, idx) for c in sorted(kids.get(node, []), key=lambda c: probs[c]))
    return out_t, out_p, out_q
