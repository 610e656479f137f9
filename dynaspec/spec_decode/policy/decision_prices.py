"""What one goodput decision reads many times, read once: each K's width cost, the prior's
rates, the draft lengths' survival, and every request's best goodput alone.

At c32 with K = 0 chosen on every step, the decision was the whole per-step cost a configured
drafter added to a plain step (0.9 ms, 1.8 ms with trees, on the engine thread: a drafter that
did not draft still cost a few percent). Most of it was calls, not arithmetic: cost(width) and
runnable(k) through closures per cap per request, rate(i) through a history view per position,
the same prior and survival rebuilt per request. This object holds them as lists for the one
decision it serves (it lives no longer), and prices with the same additions and products in
the same order as the reference functions in ``step_pricing.py``, so every float, and so
every decision and report, is bit-for-bit the one those give (tests/unit/test_decision_prices).
"""

from __future__ import annotations

from collections.abc import Callable

from dynaspec.spec_decode.policy.acceptance import DraftLengths
from dynaspec.spec_decode.policy.step_pricing import PricedRow, price_rates


class DecisionPrices:
    """`cost(width)`, `runnable(k)`: the decision's; `prior(i)`: the rate of a request with no
    history of its own (the engine's, or synthetic mode's for every request); `lengths`: the
    draft lengths of a request with none of its own."""

    def __init__(self, cost: Callable[[int], float], runnable: Callable[[int], int],
                 follow: bool, prior: Callable[[int], float], own_rates: bool,
                 lengths: DraftLengths, ceiling: int) -> None:
        self._cost, self._runnable, self.follow = cost, runnable, follow
        self._prior_of, self.own_rates, self._lengths = prior, own_rates, lengths
        self.width_costs = [cost(1 + runnable(k)) for k in range(ceiling + 1)]  # [ceiling + 1]
        self.prior = [prior(i) for i in range(ceiling)]  # [ceiling]
        self._survival: dict[int, list[float]] = {}
        self._alone: dict[tuple, float] = {}
        self._seconds: dict[tuple, list[float]] = {}
        self._fixed: dict[tuple[int, int], tuple[PricedRow, PricedRow]] = {}
        # Per cap, the priced shape of a request with no rates or lengths of its own (the
        # policy fills it): new requests, and every request of a run that never drafts.
        self.shared: dict[int, tuple] = {}

    def rates(self, own: list[float] | None, n: int) -> list[float]:
        """[n] rates of a request whose own observed rates are `own` (None or empty: none), the
        prior's past them (goodput_settings.Deeper); synthetic mode ignores `own`. A request
        whose caps stayed low has seen only its first positions, and repeating its deepest
        rate would price positions that other requests reach (suffix drafts that get that far
        are usually right) from one that says nothing about them."""
        prior = self.prior
        if n > len(prior):
            prior.extend(self._prior_of(i) for i in range(len(prior), n))
        if not own or not self.own_rates:
            return prior[:n]
        return own[:n] + prior[len(own):n]

    def survival(self, lengths: DraftLengths | None, n: int) -> list[float]:
        """[n]: `lengths` (a request's own, read deeper from the decision's), else the
        decision's own."""
        if lengths is not None:
            return lengths.survival(n)
        got = self._survival.get(n)
        if got is None:
            got = self._survival[n] = self._lengths.survival(n)
        return got

    def row(self, rates: list[float], survival: list[float], limit: int) -> PricedRow:
        return price_rates(rates, survival, limit, True)

    def fixed(self, row: PricedRow, limit: int) -> PricedRow:
        """`row` not following the step's K, at `limit` drafts (0: cut, 1: a probe); one
        object per row and limit (the row is the shared one of requests priced alike)."""
        key = (id(row), limit)  # the entry holds `row`: its id is not reused while it lives
        got = self._fixed.get(key)
        if got is None:
            got = self._fixed[key] = (row, PricedRow(False, limit, row.accepted, row.drafted,
                                                     row.survival))
        return got[1]

    def seconds_by_cap(self, row: PricedRow) -> list[float]:
        """step_pricing.one_row_seconds_by_cap(row, cost, runnable, follow), from the list;
        once per draft-length survival (every tree shares its cap's, and every request
        without lengths of its own the engine's)."""
        key = (row.limit, row.survival)
        got = self._seconds.get(key)
        if got is None:
            got = self._seconds[key] = self._seconds_by_cap(row)
        return got

    def _seconds_by_cap(self, row: PricedRow) -> list[float]:
        costs = self._costs(row.limit)
        if not self.follow:
            return costs[:row.limit + 1]
        out, total, below = [], 0.0, 0.0
        survival, limit = row.survival, row.limit
        for top in range(limit + 1):
            c = costs[top]
            out.append(total + (1.0 - below) * c if 1.0 > below else total)
            if top < limit:
                at_most = 1.0 * (1.0 - survival[top])
                if at_most > below:
                    total += (at_most - below) * c
                    below = at_most
        return out

    def best_alone(self, row: PricedRow) -> float:
        """max over caps 1..limit of (1 + accepted) / seconds for a row that follows K, once
        per distinct row in the decision (requests with the same rates share it)."""
        key = (row.accepted, row.survival)
        got = self._alone.get(key)
        if got is None:
            secs, accepted = self.seconds_by_cap(row), row.accepted
            got = self._alone[key] = max((1.0 + accepted[k]) / secs[k]
                                         for k in range(1, row.limit + 1))
        return got

    def _costs(self, limit: int) -> list[float]:
        costs = self.width_costs
        if limit >= len(costs):  # a row past the ceiling it was built for: price it all the same
            costs.extend(self._cost(1 + self._runnable(k)) for k in range(len(costs), limit + 1))
        return costs
