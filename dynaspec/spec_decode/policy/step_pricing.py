"""What a step is expected to emit and cost at each K: the goodput policy's arithmetic.

A request allowed n drafts proposes d = min(n, L) of them, L being how far its drafter goes
(`DraftLengths`: suffix drafts stop where their evidence ends, n-gram drafts where no match is
found), and draft i is accepted with the conditional rate of `AcceptanceHistory`:

    E[accepted | n] = sum_{i<n} P(L > i) * prod_{j<=i} rate(j)

On the eager path the step verifies width 1 + max_r d_r, so its expected cost is taken over
the distribution of that maximum, P(max <= l) = prod_r P(d_r <= l), with draft lengths treated
as independent across requests. Where a fixed-shape path pads every row, the width is
1 + max_r n_r whatever the drafts. With every P(L > i) = 1 (nothing observed) both reduce to
the plain model: width 1 + K and the rates' own expected_accepted.

Everything is precomputed per request once per decision (O(requests x ceiling)); each candidate
K then costs O(requests + K).

`goodput` is the one formula both K decisions use: one rank's (its requests' rows) and data
parallel's (rows every rank prices alike, from shared state: goodput_policy.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PricedRow:
    """One request's expectations at every cap up to its limit."""

    follows: bool  # its cap is the step's K (False: fixed at 0 drafts or a one-draft probe)
    limit: int  # the most drafts it may verify: its cap, or its fixed K
    # Priced up to the request's cap; a row fixed below it (a probe) keeps the longer tuples.
    accepted: tuple[float, ...]  # [>= limit + 1]: expected accepted drafts at caps 0..
    drafted: tuple[float, ...]  # [>= limit + 1]: expected drafts proposed at caps 0..
    survival: tuple[float, ...]  # [>= limit]: P(L > i)

    def cap_at(self, k: int) -> int:
        return min(k, self.limit) if self.follows else self.limit


def price_row(rate: Callable[[int], float], survival: Sequence[float], limit: int,
              follows: bool) -> PricedRow:
    """`rate(i)`: P(draft i accepted | drafted and 0..i-1 accepted); `survival`: [limit]."""
    return price_rates([rate(i) for i in range(limit)], survival, limit, follows)


def price_rates(rates: Sequence[float], survival: Sequence[float], limit: int,
                follows: bool) -> PricedRow:
    """price_row from the rates read out: `rates`, `survival`: [>= limit]."""
    accepted, drafted, run = [0.0], [0.0], 1.0
    for i in range(limit):
        run *= rates[i]
        accepted.append(accepted[-1] + survival[i] * run)
        drafted.append(drafted[-1] + survival[i])
    return PricedRow(follows, limit, tuple(accepted), tuple(drafted), tuple(survival[:limit]))


class StepPricing:
    """Expected tokens, drafts and step seconds at each candidate K for one batch."""

    def __init__(self, rows: Sequence[PricedRow], cost: Callable[[int], float],
                 runnable: Callable[[int], int], widths_follow_drafts: bool) -> None:
        self.rows, self.cost, self.runnable = rows, cost, runnable
        self.follow = widths_follow_drafts
        depth = max((r.limit for r in rows), default=0)
        # P(max_r d_r <= depth) below the step's K (every row still drafting there counts),
        # and at or above it (only rows whose K does not follow the step's).
        self._below = [self._product(d, all_rows=True) for d in range(depth)]
        self._fixed = [self._product(d, all_rows=False) for d in range(depth)]
        # Past the deepest limit of the rows that follow K every row's cap is what it is there,
        # so tokens, drafts and the widest cap are summed once for all of those K (the same sums
        # in the same order: the same floats). At K = 0 on every step no row follows: one sum.
        self._settled = max((r.limit for r in rows if r.follows), default=0)
        self._sums: dict[int, tuple[float, float, int]] = {}

    def _product(self, depth: int, all_rows: bool) -> float:
        p = 1.0
        for r in self.rows:
            if r.limit > depth and (all_rows or not r.follows):
                p *= 1.0 - r.survival[depth]
        return p

    def tokens(self, k: int) -> float:
        """Expected tokens emitted: one per request plus its expected accepted drafts."""
        return self._summed(k)[0]

    def drafted(self, k: int) -> float:
        return self._summed(k)[1]

    def max_cap(self, k: int) -> int:
        return self._summed(k)[2]

    def _summed(self, k: int) -> tuple[float, float, int]:
        k = min(k, self._settled)
        got = self._sums.get(k)
        if got is None:
            caps = [r.cap_at(k) for r in self.rows]
            got = self._sums[k] = (sum([1.0 + r.accepted[c] for r, c in zip(self.rows, caps)]),
                                   sum([r.drafted[c] for r, c in zip(self.rows, caps)]),
                                   max(caps, default=0))
        return got

    def seconds(self, k: int) -> float:
        """Expected target seconds of the step whose requests follow K = k."""
        top = self.max_cap(k)
        if not self.follow:
            return self.cost(1 + self.runnable(top))
        total, below = 0.0, 0.0
        for depth in range(top + 1):
            table = self._below if depth < k else self._fixed
            at_most = table[depth] if depth < len(table) else 1.0
            if depth == top:
                at_most = 1.0  # no row may draft past its cap
            if at_most > below:
                total += (at_most - below) * self.cost(1 + self.runnable(depth))
                below = at_most
        return total


def goodput(pricing: StepPricing, k: int, draft_seconds_per_token: float) -> float:
    """Expected tokens emitted per second of a step whose requests follow K = k:
    sum_r (1 + E_r[accepted]) / (E[target seconds] + drafting seconds per token * E[drafted])."""
    seconds = pricing.seconds(k) + draft_seconds_per_token * pricing.drafted(k)
    return pricing.tokens(k) / seconds


def one_row_seconds(row: PricedRow, k: int, cost: Callable[[int], float],
                    runnable: Callable[[int], int], widths_follow_drafts: bool) -> float:
    """StepPricing([row], ...).seconds(k) for one row that follows K, without building the
    pricing: the same arithmetic in the same order. The goodput policy checks every request
    alone each decision (~25 us a request at batch 32 built the long way)."""
    assert row.follows, "one_row_seconds prices a row that follows the step's K"
    top = min(k, row.limit)
    if not widths_follow_drafts:
        return cost(1 + runnable(top))
    total, below = 0.0, 0.0
    for depth in range(top + 1):
        at_most = 1.0 if depth == top else 1.0 * (1.0 - row.survival[depth])
        if at_most > below:
            total += (at_most - below) * cost(1 + runnable(depth))
            below = at_most
    return total


def one_row_seconds_by_cap(row: PricedRow, cost: Callable[[int], float],
                           runnable: Callable[[int], int], widths_follow_drafts: bool
                           ) -> list[float]:
    """[one_row_seconds(row, k, ...) for k in 0..row.limit] in one pass: the sums for every cap
    share their prefix, so the same additions in the same order give the same floats. The
    policy checks every request at every cap each decision; at c32 with nothing paying (K=0
    every step) that check was most of a decision's ~0.8 ms, a tax on steps that draft nothing."""
    assert row.follows, "one_row_seconds prices a row that follows the step's K"
    if not widths_follow_drafts:
        return [cost(1 + runnable(k)) for k in range(row.limit + 1)]
    out, total, below = [], 0.0, 0.0
    for top in range(row.limit + 1):
        c = cost(1 + runnable(top))
        out.append(total + (1.0 - below) * c if 1.0 > below else total)
        if top < row.limit:  # depth `top` seen from a deeper cap: at most 1 - P(L > top)
            at_most = 1.0 * (1.0 - row.survival[top])
            if at_most > below:
                total += (at_most - below) * c
                below = at_most
    return out
