"""What a draft tree of n nodes is expected to accept (docs/design.md §4c): per-depth,
per-branch acceptance and the node values the goodput policy prices a tree by.

A verified tree is walked from the root: at depth d the reached node's children are offered in
the drafter's order (rank 0 its likeliest), and at most one of them is accepted. The rates:
- rank 0 at depth d is the request's chain rate at position d (`AcceptanceHistory`): a tree's
  first root path is the chain the drafter would have proposed, and a tree step teaches the
  chain history exactly what that chain would have (`TreeWalk.first_path_accepted`);
- rank b >= 1 at depth d is `BranchRates.rate(d, b)`, engine-wide: P(the rank-b child is
  accepted | the walk reached its parent, ranks < b were rejected, rank b was offered).

A node's value is P(it is on the accepted path): the product over its path of P(its rank is
the accepted one at its depth), P(rank b) = p(d, b) * prod_{j<b} (1 - p(d, j)). A tree's
expected accepted drafts is the sum of its nodes' values. A node budget n is priced at the n
largest values the rates allow (Sequoia's greedy construction: the best tree a drafter with
candidates everywhere could give), node i present with the probability that the drafter's tree
has more than i nodes (a `DraftLengths` over tree steps). A chain is the case of rank 0 only,
so `price_tree_row` of a tree whose branches are never accepted equals `price_row`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from dynaspec.draft_tree import TreeWalk
from dynaspec.spec_decode.policy.step_pricing import PricedRow

MAX_RANK = 4  # children priced per node; deeper ranks are worth 0 to the policy


class BranchRates:
    """Engine-wide rate that the rank-b child (b >= 1) at depth d is the accepted one, given
    that the walk reached its parent and ranks < b were rejected: a running mean from `prior`
    (worth `prior_weight` observations). Observable: `table()`."""

    __slots__ = ("prior", "prior_weight", "reached", "hits", "num_updates")

    def __init__(self, prior: float = 0.25, prior_weight: float = 2.0) -> None:
        if not 0.0 <= prior <= 1.0 or prior_weight <= 0:
            raise ValueError(f"need prior in [0, 1] and prior_weight > 0, got {prior}, "
                             f"{prior_weight}")
        self.prior, self.prior_weight = prior, prior_weight
        self.reached: dict[tuple[int, int], int] = {}
        self.hits: dict[tuple[int, int], int] = {}
        self.num_updates = 0

    def update(self, walk: TreeWalk) -> None:
        for d, (n, c) in enumerate(zip(walk.offered, walk.chosen)):
            if c == 0:
                continue  # the first child was accepted: later ranks were not tried
            for b in range(1, min(n, MAX_RANK)):
                key = (d, b)
                self.reached[key] = self.reached.get(key, 0) + 1
                if b == c:
                    self.hits[key] = self.hits.get(key, 0) + 1
                    break
        self.num_updates += 1

    def rate(self, depth: int, rank: int) -> float:
        key = (depth, rank)
        n = self.reached.get(key, 0)
        return (self.hits.get(key, 0) + self.prior * self.prior_weight) / (n + self.prior_weight)

    def table(self) -> dict[str, float]:
        """{"d<depth>b<rank>": rate} for every (depth, rank) observed."""
        return {f"d{d}b{b}": round(self.rate(d, b), 4) for d, b in sorted(self.reached)}


def node_values(rate0: Sequence[float], branches: Sequence[Sequence[float]],
                n: int) -> list[float]:
    """The n largest node values a tree can hold, descending (a best-first expansion from the
    root: a child is worth at most its parent, so the chosen nodes form a tree). `rate0`[n]:
    the first child's rate per depth; `branches`[n][MAX_RANK - 1]: ranks 1.. per depth."""
    reach: list[list[float]] = []  # [depth][rank]: P(rank accepted | parent reached)
    for d in range(n):
        miss, row = 1.0, []
        for p in (rate0[d], *branches[d]):
            row.append(miss * p)
            miss *= 1.0 - p
        row.sort(reverse=True)  # which rank is worth what does not matter, only the values
        reach.append(row)
    # Lazy expansion: a popped node brings in its best child and its next sibling (each row is
    # sorted), so the heap holds at most two entries a node. Entry: (-value, depth, index in
    # the depth's row, the parent's value).
    heap = [(-reach[0][0], 0, 0, 1.0)]
    out: list[float] = []
    while heap and len(out) < n:
        neg, d, i, parent = heapq.heappop(heap)
        out.append(-neg)
        if i + 1 < len(reach[d]):
            heapq.heappush(heap, (-parent * reach[d][i + 1], d, i + 1, parent))
        if d + 1 < n:
            heapq.heappush(heap, (neg * reach[d + 1][0], d + 1, 0, -neg))
    return out + [0.0] * (n - len(out))


def price_tree_row(rate0: Sequence[float], branches: Sequence[Sequence[float]],
                   survival: Sequence[float], limit: int, follows: bool) -> PricedRow:
    """A request's row (step_pricing.PricedRow) for a tree of up to `limit` nodes: `survival`
    [limit] is P(the drafter's tree has more than i nodes)."""
    values = node_values(rate0, branches, limit)
    accepted, drafted = [0.0], [0.0]
    for i in range(limit):
        accepted.append(accepted[-1] + survival[i] * values[i])
        drafted.append(drafted[-1] + survival[i])
    return PricedRow(follows, limit, tuple(accepted), tuple(drafted), tuple(survival[:limit]))


class TreePricer:
    """Prices tree rows for one decision (and lives only as long): the branch rates and the
    trees' fill are read once, and requests with the same rates share one row (those without a
    history of their own all read the engine's)."""

    def __init__(self, rates: BranchRates, survival: Callable[[int], list[float]],
                 depth: int) -> None:
        self.branches = [[rates.rate(d, b) for b in range(1, MAX_RANK)] for d in range(depth)]
        self._survival_of = survival
        self._survival: dict[int, list[float]] = {}
        self._rows: dict[tuple, PricedRow] = {}

    def row(self, rate0: Callable[[int], float], limit: int) -> PricedRow:
        return self.row_of(tuple(rate0(d) for d in range(limit)))

    def row_of(self, r0: tuple[float, ...]) -> PricedRow:
        """`row` from the first children's rates read out: r0[limit]."""
        limit = len(r0)
        got = self._rows.get(r0)  # the key's length is the limit
        if got is None:
            if limit not in self._survival:
                self._survival[limit] = self._survival_of(limit)
            got = self._rows[r0] = price_tree_row(r0, self.branches, self._survival[limit],
                                                  limit, True)
        return got
