"""N-gram (prompt lookup) proposer: draft the tokens that followed an earlier copy of the suffix.

Runs on the CPU every engine step, in the critical path, so it is plain vectorised numpy
(no numba) and keeps one growing token buffer per request instead of rebuilding the context.

Match rule (shared by `ngram_match` and the proposer):
  * n is the longest length in [min_n, max_n] such that the last n tokens also occur earlier
    (starting before position len - n, i.e. not the suffix itself; overlap with it is allowed);
  * among the occurrences of that n-gram, the MOST RECENT one wins. Edits and generation
    tend to continue the region the model is working on (the latest copy of a function, the
    latest row of a table), so the latest occurrence is the likeliest to predict what comes
    next. vLLM's KMP scan keeps the earliest instead; the difference only shows when the
    suffix repeats, and then the latest copy is the more local evidence;
  * the draft is the k tokens following that occurrence. When the context ends sooner (the
    match overlaps the suffix: a periodic run with period p < k), the copy continues into its
    own output, LZ77-style, i.e. the period repeats. Without this the most-recent rule would
    draft only p tokens in exactly the runs (repeated lines, loops) where drafts pay most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dynaspec.draft_tree import DraftTree
from dynaspec.request import Request
from dynaspec.spec_decode.drafters.base import Drafts, Proposer, deterministic_drafts, tree_shapes

_EMPTY = np.zeros(0, dtype=np.int64)
_MIN_CAPACITY = 256
# Above this many last-token candidates, search the most recent ones first (see below).
_TAIL_CANDIDATES = 512


def ngram_match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Longest-suffix match: find the longest n in [min_n, max_n] such that the last n tokens
    occur earlier in `tokens`; return the k tokens that follow that occurrence, the copy running
    on into its own output when the context ends sooner (empty if no match or k <= 0).

    The most recent earlier occurrence wins (see the module docstring for why). Token id 0 is
    an ordinary token. Returns a copy, never a view into `tokens` (the proposer's buffers are
    reused). Cost: one O(len) compare for the last token, then one filtering pass per extra
    suffix length over the surviving candidates: few on natural text, and on long runs or
    short periods mostly settled by the most recent candidates (O(len * max_n) at worst).
    """
    tokens = np.asarray(tokens)
    length = tokens.shape[0]
    # An earlier occurrence of an n-gram needs at least n + 1 tokens in total.
    if k <= 0 or min_n > max_n or length < min_n + 1:
        return _EMPTY
    best_end = _longest_suffix_match_end(tokens, min_n, max_n)
    if best_end < 0:
        return _EMPTY
    follow = tokens[best_end + 1 : best_end + 1 + k]
    if follow.shape[0] >= k:
        return follow.copy()
    # The match overlaps the suffix: period p = len(follow); continue the copy periodically.
    return np.resize(follow, k)


def _longest_suffix_match_end(tokens: np.ndarray, min_n: int, max_n: int) -> int:
    """End index of the most recent earlier occurrence of the longest matching suffix, or -1.

    Works on occurrence END positions j (j <= len - 2, so at least one token follows) whose
    token equals the last one; `_narrow` then extends the match length one token at a time.
    """
    length = tokens.shape[0]
    cand = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if cand.size == 0:
        return -1
    best_end, best_n = _narrow(tokens, cand, min(max_n, length - 1), 1, True)
    return best_end if best_n >= min_n else -1


def _narrow(
    tokens: np.ndarray, cand: np.ndarray, max_n: int, n: int, try_tail: bool
) -> tuple[int, int]:
    """(most recent end, length) of the longest match, capped at max_n, among the sorted
    candidate ends `cand`, all of which already match the last n tokens.

    The candidates for length d + 1 are those for length d whose token d places back also
    matches. Narrowing one length at a time is the same search as "longest n first, stop at
    the first match", but each step only touches the survivors of the previous one.
    """
    last = tokens.shape[0] - 1
    best_end, best_n = int(cand[-1]), n
    for d in range(n, max_n):
        # Sorted distinct ends: only cand[0] == d - 1 can have become too close to the start.
        if cand[0] < d:
            cand = cand[1:]
            if cand.size == 0:
                break
        cand = cand[tokens[cand - d] == tokens[last - d]]
        if cand.size == 0:
            break
        best_end, best_n = int(cand[-1]), d + 1
        if try_tail and cand.size > _TAIL_CANDIDATES and best_n < max_n:
            # Long runs and short periods keep thousands of candidates at every length. Try
            # the most recent ones alone first: a full-length (max_n) match among them is the
            # answer outright, as nothing earlier can be longer or more recent.
            try_tail = False
            end, n_tail = _narrow(tokens, cand[-_TAIL_CANDIDATES:], max_n, best_n, False)
            if n_tail == max_n:
                return end, n_tail
    return best_end, best_n


# A tree's occurrences: the most recent ones of the longest matching suffix (bounds its cost).
_TREE_OCCURRENCES = 32


def ngram_tree(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> DraftTree | list[int]:
    """A token tree of at most k nodes from the continuations of the longest matching suffix's
    occurrences (the most recent _TREE_OCCURRENCES), or [] without a match. A node's weight is
    the share of occurrences whose continuation passes through it; nodes join by weight (ties:
    the more recent occurrence), so with one occurrence, or where all agree, it is the chain
    `ngram_match` drafts. The most recent occurrence's continuation runs on periodically as
    there (module docstring)."""
    tokens = np.asarray(tokens)
    length = tokens.shape[0]
    if k <= 0 or min_n > max_n or length < min_n + 1:
        return []
    best_end = _longest_suffix_match_end(tokens, min_n, max_n)
    if best_end < 0:
        return []
    n = min(max_n, length - 1)
    last = length - 1
    cand = np.flatnonzero(tokens[: last] == tokens[last])
    back = np.arange(n)
    idx = cand[:, None] - back  # [C, n]
    run = np.cumprod((idx >= 0) & (tokens[np.maximum(idx, 0)] == tokens[last - back]), axis=1)
    span = run.sum(axis=1)  # [C] matched length of each candidate
    ends = cand[span == span[cand == best_end][0]][::-1][:_TREE_OCCURRENCES]  # most recent first
    conts = [ngram_match(tokens, min_n, max_n, k).tolist()]
    conts += [tokens[e + 1: min(length, e + 1 + k)].tolist() for e in ends if e != best_end]
    return _trie_tree([c for c in conts if c], k)


def _trie_tree(conts: list[list[int]], k: int) -> DraftTree | list[int]:
    """The k heaviest nodes of the continuations' trie (weight: continuations through a node;
    ties: the earlier continuation), depth-first, heavier children first."""
    if len(conts) == 1:
        return conts[0][:k]
    # trie node: (token, parent, weight, first continuation)
    nodes: dict[tuple[int, int], list[int]] = {}  # (parent id, token) -> [id, weight, first]
    for ci, c in enumerate(conts):
        parent = -1
        for t in c:
            key = (parent, t)
            if key not in nodes:
                nodes[key] = [len(nodes), 0, ci]
            nodes[key][1] += 1
            parent = nodes[key][0]
    info = {v[0]: (p, t, v[1], v[2]) for (p, t), v in nodes.items()}  # id -> (parent, token, w, f)
    kids: dict[int, list[int]] = {}
    for i, (p, _, _, _) in info.items():
        kids.setdefault(p, []).append(i)
    rank = lambda i: (-info[i][2], info[i][3], i)  # noqa: E731 - heavier, then earlier
    chosen: set[int] = set()
    frontier = sorted(kids.get(-1, []), key=rank)
    while frontier and len(chosen) < k:
        best = frontier.pop(0)
        chosen.add(best)
        frontier = sorted(frontier + kids.get(best, []), key=rank)
    tokens: list[int] = []
    parents: list[int] = []
    stack = [(i, -1) for i in sorted(kids.get(-1, []), key=rank, reverse=True) if i in chosen]
    while stack:
        i, parent = stack.pop()
        tokens.append(info[i][1])
        parents.append(parent)
        me = len(tokens) - 1
        stack.extend((c, me) for c in sorted(kids.get(i, []), key=rank, reverse=True)
                     if c in chosen)
    return DraftTree(tuple(tokens), tuple(parents))


@dataclass
class _TokenBuffer:
    """A request's prompt + output tokens as a growing numpy array (capacity doubles)."""

    data: np.ndarray
    length: int
    prompt_ref: list[int]  # identity check: a new Request under an old id must not reuse this

    def view(self) -> np.ndarray:
        return self.data[: self.length]


class NgramProposer(Proposer):
    """Prompt-lookup drafter. Deterministic, so `Drafts.probs` is None (treated as one-hot).

    Keeps a token buffer per request id, extended with the new tokens each step. Call
    `forget(request_id)` when a request finishes or is aborted, or its buffer stays alive.
    """

    def __init__(self, min_n: int, max_n: int, tree: bool = False) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tree = tree  # draft token trees: k is then a node budget (docs/design.md §4c)
        self.drafts_trees = tree
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int], *,
                fallback_k: Sequence[int] | None = None,
                trees: Sequence[bool] | None = None) -> Drafts:
        """`trees`: per request, a tree (True) or a chain; None: trees where built with them."""
        shapes = tree_shapes(self.tree, len(requests), trees)
        return deterministic_drafts(requests, k_per_request, self._draft_one, shapes)

    def _draft_one(self, request: Request, k: int, tree: bool) -> list[int] | DraftTree:
        if tree:
            return ngram_tree(self._tokens(request), self.min_n, self.max_n, k)
        return ngram_match(self._tokens(request), self.min_n, self.max_n, k).tolist()

    def continue_after(self, requests: Sequence[Request], prefixes: Sequence[Sequence[int]],
                       k_per_request: Sequence[int]) -> Drafts:
        """The match rule on the context with the prefix appended (one copy per request)."""
        token_ids = [ngram_match(np.concatenate([self._tokens(r), np.asarray(p, np.int64)]),
                                 self.min_n, self.max_n, k).tolist() if k > 0 else []
                     for r, p, k in zip(requests, prefixes, k_per_request)]
        return Drafts(token_ids=token_ids, probs=None,
                      skip_reasons=[None if d else "no_match" for d in token_ids])

    def forget(self, request_id: str) -> None:
        """Drop a finished request's buffer. Unknown ids are ignored (idempotent)."""
        self._buffers.pop(request_id, None)

    def preempt(self, request_id: str) -> None:
        self.forget(request_id)  # nothing outlives a request here: preemption is an end

    def num_cached(self) -> int:
        return len(self._buffers)

    def _tokens(self, request: Request) -> np.ndarray:
        """The request's prompt + output tokens (never drafts), appending only what is new.

        Reads prompt_token_ids / output_token_ids directly: `all_token_ids` concatenates the
        two lists, an O(len) Python copy per request per step that this cache exists to avoid.
        """
        prompt, output = request.prompt_token_ids, request.output_token_ids
        total = len(prompt) + len(output)
        buf = self._buffers.get(request.request_id)
        if buf is None or not self._still_valid(buf, request, total):
            buf = _TokenBuffer(np.empty(max(_MIN_CAPACITY, 2 * total), np.int64), 0, prompt)
            self._buffers[request.request_id] = buf
        if buf.length < total:
            self._append(buf, prompt, output, total)
        return buf.view()

    @staticmethod
    def _still_valid(buf: _TokenBuffer, request: Request, total: int) -> bool:
        # Tokens only ever grow by appending; anything else (a reused id, a shrunk or rewritten
        # output) means the buffer describes another sequence and is rebuilt from scratch.
        if buf.prompt_ref is not request.prompt_token_ids or buf.length > total:
            return False
        return buf.length == 0 or int(buf.data[buf.length - 1]) == request.token_at(buf.length - 1)

    @staticmethod
    def _append(buf: _TokenBuffer, prompt: list[int], output: list[int], total: int) -> None:
        if total > buf.data.shape[0]:
            grown = np.empty(max(2 * buf.data.shape[0], total), np.int64)
            grown[: buf.length] = buf.data[: buf.length]
            buf.data = grown
        start = buf.length
        n_prompt = len(prompt)
        if start < n_prompt:
            buf.data[start:n_prompt] = prompt[start:]
            start = n_prompt
        new = output[start - n_prompt :]
        if len(new) == 1:  # the common decode step: skip list -> array conversion
            buf.data[start] = new[0]
        else:
            buf.data[start:total] = new
        buf.length = total
