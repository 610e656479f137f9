"""The EAGLE head and a lookup drafter in one token tree (`--speculator hybrid`, design §4c).

A lookup drafter (n-gram or suffix) copies long exact runs where the context repeats and drafts
nothing elsewhere; the head guesses on every step at a lower rate. Each step, per request:
- the lookup's chain (up to the node budget) and the head's chain are asked for;
- they are merged into one tree: the lookup's chain is the first root path (its copies are the
  likelier ones, and the policy prices a tree's first path at the request's chain rate), the
  head's tokens share its nodes as far as the two agree and branch off where they part;
- the budget is filled lookup first, the head's branch keeping at least the head's own share.
So a request gets the lookup's long copies where they exist, the head's guesses where the
lookup has nothing, and both where the lookup's match is short or its first token uncertain.

The head drafts a budget's remainder (`head_budget`), at most `head_depth` tokens (the depth it
was trained to chain): where the lookup found nothing, or past a short match; where the lookup
filled the budget the head is not asked (measured on held-out code edits: a guess beside a
full suffix match was accepted at 0.11 and cost 0.80x of suffix alone). Where the K policy
asks a request for a chain (or trees cannot be verified here), it drafts as lookup-first does:
the lookup's chain, else the head's. A self-sizing lookup (suffix) keeps its pricing: the policy
gives a request its whole cap or none, as for suffix alone.

Every node is labelled with its source (`Drafts.sources`: the lookup's name, or "eagle" for
the head's own branch; nodes both drafted count as the lookup's), so /metrics counts draft and
accepted tokens by source. Drafts stay deterministic (argmax, lookup), so verification is the
greedy-exact tree walk: lossless as either drafter alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynaspec.draft_tree import DraftTree
from dynaspec.request import Request
from dynaspec.spec_decode.drafters.base import Drafts, Proposer, tree_shapes
from dynaspec.spec_decode.drafters.lookup_head_pair import LookupHeadPair

HEAD_SOURCE = "eagle"  # the metrics' label of the head's own nodes


def head_budget(budget: int, lookup_len: int, tree: bool, depth: int) -> int:
    """Drafts the head is asked for, given a node budget, the lookup's chain length and the
    head's own depth cap."""
    if budget <= 0:
        return 0
    if not lookup_len:
        return min(budget, depth)
    if not tree:
        return 0  # a chain: the lookup's alone
    return min(max(budget - lookup_len, 0), depth)


def merge(lookup: Sequence[int], head: Sequence[int], budget: int,
          lookup_source: str) -> tuple[DraftTree, tuple[str, ...]]:
    """One tree of at most `budget` nodes from the two chains, and each node's source.

    The lookup's chain comes first (the first root path); the head's chain shares its first
    `s` nodes where the two agree and continues as a branch off node s-1 (a sibling of the
    lookup's token at depth s). The head's branch keeps its tokens; the lookup's chain is cut
    to the rest of the budget, but never below its shared part nor its first token."""
    s = 0
    while s < min(len(lookup), len(head)) and lookup[s] == head[s]:
        s += 1
    rest = list(head[s:])
    n_look = min(len(lookup), budget, max(s, 1, budget - len(rest)))
    rest = rest[: max(budget - n_look, 0)]
    tokens = list(lookup[:n_look]) + rest
    parents = list(range(-1, n_look - 1))
    if rest:
        parents += [s - 1] + list(range(n_look, n_look + len(rest) - 1))
    sources = (lookup_source,) * n_look + (HEAD_SOURCE,) * len(rest)
    return DraftTree(tuple(tokens), tuple(parents)), sources


class HybridTreeProposer(LookupHeadPair):
    def __init__(self, lookup: Proposer, head: Proposer, lookup_source: str,
                 tree: bool = True, head_depth: int = 3) -> None:
        super().__init__(lookup, head, "hybrid")
        if lookup.drafts_trees:
            raise ValueError("hybrid drafting merges the lookup's chains: build it without trees")
        self.lookup_source = lookup_source
        self.drafts_trees = tree  # False where trees cannot be verified: lookup-first chains
        self.sizes_own_drafts = lookup.sizes_own_drafts
        self.head_depth = head_depth

    def measure_draft_cost(self) -> float | None:
        return self.head.measure_draft_cost()  # the lookup's share is negligible beside it

    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int], *,
                fallback_k: Sequence[int] | None = None,
                trees: Sequence[bool] | None = None) -> Drafts:
        if len(requests) != len(k_per_request):
            raise ValueError(f"{len(requests)} requests but {len(k_per_request)} k values")
        shapes = tree_shapes(self.drafts_trees, len(requests), trees)
        found = self.lookup.propose(requests, k_per_request)
        head_k = [head_budget(k, len(d), t, self.head_depth)
                  for d, k, t in zip(found.token_ids, k_per_request, shapes)]
        ask = [i for i, k in enumerate(head_k) if k > 0]
        more = self.head.propose([requests[i] for i in ask], [head_k[i] for i in ask]) \
            if ask else Drafts([], None, [])
        if more.probs is not None:
            raise ValueError("hybrid drafting needs a deterministic head (greedy drafts)")
        guess: list[list[int]] = [[] for _ in requests]
        head_skip: list[str | None] = [None] * len(requests)
        for i, d, why in zip(ask, more.token_ids, more.skip_reasons):
            guess[i], head_skip[i] = list(d), why
        token_ids, skips = [], []
        out_trees: list[DraftTree | None] = []
        sources: list[tuple[str, ...] | None] = []
        for i, (look, k) in enumerate(zip(found.token_ids, k_per_request)):
            tree, src = merge(look, guess[i], k, self.lookup_source) if k > 0 \
                else (DraftTree((), ()), ())
            token_ids.append(list(tree.tokens))
            out_trees.append(tree if len(tree) and not tree.is_chain else None)
            sources.append(src)
            skips.append(None if len(tree) or k <= 0
                         else head_skip[i] or found.skip_reasons[i] or "no_match")
        return Drafts(token_ids=token_ids, probs=None, skip_reasons=skips,
                      setup_seconds=found.setup_seconds + more.setup_seconds,
                      trees=out_trees if any(t is not None for t in out_trees) else None,
                      sources=sources)

    def continue_after(self, requests: Sequence[Request], prefixes: Sequence[Sequence[int]],
                       k_per_request: Sequence[int]) -> Drafts:
        """After a grammar's forced tokens: the lookup's match on the context with them (the
        head has no features for tokens not yet run)."""
        return self.lookup.continue_after(requests, prefixes, k_per_request)
