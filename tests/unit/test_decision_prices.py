"""DecisionPrices: a goodput decision priced from lists read once equals, bit for bit, the same
decision priced the long way (rates and lengths through their views, each cap's seconds through
cost and runnable), over random histories, trees, widths, caps and cost tables."""

from __future__ import annotations

import random

import pytest

from dynaspec.draft_tree import TreeWalk
from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.acceptance import FULL_LENGTHS
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy, GoodputSettings
from dynaspec.spec_decode.policy.goodput_settings import Deeper, FixedRates
from dynaspec.spec_decode.policy.k_policy import RequestView, StepView
from dynaspec.spec_decode.policy.step_pricing import (
    StepPricing,
    one_row_seconds,
    one_row_seconds_by_cap,
    price_row,
)

WIDTHS = tuple(range(1, 10))
_MARGIN = 1 + 1e-9


class LongWay(GoodputPolicy):
    """The decision as priced before DecisionPrices: the reference the fast path must equal.
    It prices every request even where no draft could pay (no `_none_can_pay` shortcut), so the
    shortcut's decision is checked against the long way's too."""

    def _none_can_pay(self, view, ceiling, cost):
        return False

    def _rates(self, r):
        if self.synthetic is not None:
            return self.synthetic
        prior = (self.engine_history if self.engine_history.num_updates
                 else FixedRates(self.settings.prior_rate))
        h = self.history(r)
        if h is not None and h.num_updates:
            return Deeper(h.rates, prior)
        return prior

    def _lengths(self, r):
        own = self.lengths.get(r.request_id)
        if own is not None and own.num_updates:
            return own.deeper(self.engine_lengths)
        return self.engine_lengths if self.engine_lengths.num_updates else FULL_LENGTHS

    def _shape(self, r, cap, cost, trees, prices):
        chain = price_row(self._rates(r).rate, self._lengths(r).survival(cap), cap, True)
        value = self._alone(chain, cost) if cap > 0 else 0.0
        if trees is None or cap < 2:
            return chain, value, False
        tree = trees.row(self._rates(r).rate, cap)
        tree_value = self._alone(tree, cost)
        if tree_value > value * _MARGIN:
            return tree, tree_value, True
        return chain, value, False

    def _alone(self, row, cost, prices=None):
        follow = self.settings.widths_follow_drafts
        if row.limit == 0:
            return 0.0
        if self.settings.whole_cap:
            k = row.limit
            return (1.0 + row.accepted[k]) / one_row_seconds(row, k, cost, self._runnable, follow)
        secs = one_row_seconds_by_cap(row, cost, self._runnable, follow)
        return max((1.0 + row.accepted[k]) / secs[k] for k in range(1, row.limit + 1))


class Shortcut(GoodputPolicy):
    """The policy as shipped, counting the decisions its no-draft-can-pay shortcut made."""

    shortcuts = 0

    def _none_can_pay(self, view, ceiling, cost):
        got = super()._none_can_pay(view, ceiling, cost)
        self.shortcuts += got
        return got


def _pair(rng: random.Random, superlinear: bool = False
          ) -> tuple[GoodputPolicy, GoodputPolicy, bool]:
    base, slope = rng.choice([0.01, 0.1]), rng.choice([0.0, 0.001, 0.004, 0.02, 0.1])
    seconds = [[[base + slope * w * (1 + 0.1 * rng.random()) for w in WIDTHS] for _ in range(2)]
               for _ in range(2)]
    if superlinear:  # a compute-bound batch: width w costs more than w plain steps (c64 here)
        seconds = [[[base * w ** rng.choice([1.05, 1.2]) for w in WIDTHS] for _ in range(2)]
                   for _ in range(2)]
    tree = rng.random() < 0.5
    settings = GoodputSettings(drafts_trees=tree, whole_cap=rng.random() < 0.2,
                               widths_follow_drafts=rng.random() < 0.7,
                               synthetic_rates=(0.7, 0.5) if rng.random() < 0.1 else ())
    allowed = None if rng.random() < 0.7 else (1, 2, 3, 5, 9)
    learn = rng.random() < 0.5
    policies = tuple(cls(build_spec_plan("ngram", 8, None),
                         StepCostModel(CostGrid((1, 64), (1, 4096), WIDTHS), seconds, learn=learn),
                         settings, allowed_widths=allowed) for cls in (Shortcut, LongWay))
    return *policies, tree


def _walk(rng: random.Random, drafted: int, accepted: int) -> TreeWalk:
    offered = tuple(rng.randint(1, 3) for _ in range(accepted + 1))
    chosen = tuple(rng.randint(0, o - 1) for o in offered[:accepted]) + (-1,)
    return TreeWalk(offered=offered, chosen=chosen, first_path=drafted)


@pytest.mark.parametrize("seed", range(12))
def test_the_fast_decision_equals_the_long_way(seed):
    _fast_equals_long(seed, superlinear=False)


@pytest.mark.parametrize("seed", range(8))
def test_where_no_draft_can_pay_the_shortcut_decides_as_the_long_way(seed):
    """Widths dearer than their tokens: the shortcut answers without pricing any request, with
    the decision (K, caps, reasons, report floats) pricing every request gives."""
    fast = _fast_equals_long(seed, superlinear=True)
    assert fast.shortcuts > 0, "the shortcut never fired: the test checked nothing new"


def _fast_equals_long(seed: int, superlinear: bool) -> Shortcut:
    rng = random.Random(seed)
    fast, slow, tree = _pair(rng, superlinear)
    n = rng.choice([1, 3, 32])
    for step in range(12):
        reqs = tuple(RequestView(f"r{i}", 50 + step + i, rng.choice([1, 3, 1000]), 10**6,
                                 rng.choice([None, None, 2, 100]))
                     for i in range(n) if rng.random() < 0.9)
        view = StepView(reqs, len(reqs) + rng.randint(0, 2))
        d = fast.decide(view)
        assert d == slow.decide(view)
        assert d.goodput_by_k == slow.decide(view).goodput_by_k  # the floats, not approximately
        for p in (fast, slow):  # both learn the same outcomes
            r2 = random.Random(seed * 1000 + step)
            for r in reqs:
                cap = d.per_request.get(r.request_id, 0)
                drafted = r2.randint(0, cap) if r2.random() < 0.8 else 0
                accepted = r2.randint(0, drafted)
                walk = _walk(r2, drafted, accepted) if tree and drafted >= 2 and \
                    accepted < drafted and r2.random() < 0.5 else None
                p.observe(r.request_id, drafted, accepted, r.context_len, cap, walk=walk)
            p.observe_step(len(reqs), 60, 1 + d.k, 0.01 * (1 + r2.random()), 0.001 * d.k,
                           d.k * len(reqs), len(reqs), modelled_goodput=d.modelled_goodput)
    assert isinstance(fast, Shortcut)
    return fast


def test_step_sums_equal_the_per_row_sums_at_every_k():
    rng = random.Random(7)
    for _ in range(50):
        rows = []
        for _ in range(rng.randint(0, 12)):
            limit = rng.randint(0, 8)
            rates = [rng.random() for _ in range(limit)]
            surv = sorted((rng.random() for _ in range(limit)), reverse=True)
            row = price_row(rates.__getitem__, surv, limit, rng.random() < 0.6)
            if not row.follows:  # a fixed row keeps its longer tuples below its limit
                row = type(row)(False, rng.randint(0, limit), row.accepted, row.drafted,
                                row.survival)
            rows.append(row)
        pricing = StepPricing(rows, lambda w: 0.01 * w, lambda k: k, True)
        for k in rng.sample(range(10), 10):  # in any order: the sums are kept per K
            caps = [r.cap_at(k) for r in rows]
            assert pricing.tokens(k) == sum(1.0 + r.accepted[c] for r, c in zip(rows, caps))
            assert pricing.drafted(k) == sum(r.drafted[c] for r, c in zip(rows, caps))
            assert pricing.max_cap(k) == max(caps, default=0)


@pytest.mark.parametrize("tree", [False, True])
def test_requests_priced_alike_are_priced_once(monkeypatch, tree):
    """At c32 with nothing drafted yet (or a run that never drafts), one row per cap is priced,
    not one per request: the decision's cost must not grow with what it does not draft."""
    import dynaspec.spec_decode.policy.decision_prices as dp
    import dynaspec.spec_decode.policy.tree_pricing as tp

    calls = {"chain": 0, "tree": 0}

    def counted(name, f):
        def g(*a, **k):
            calls[name] += 1
            return f(*a, **k)
        return g

    monkeypatch.setattr(dp, "price_rates", counted("chain", dp.price_rates))
    monkeypatch.setattr(tp, "node_values", counted("tree", tp.node_values))
    # Verify dear, K = 0 for everyone, but not so dear that no draft could pay (a drafter that
    # was always right would: 2 tokens for 0.19 s against 1 for 0.1 s), so requests are priced.
    seconds = [[[0.01 + 0.09 * w for w in WIDTHS]] * 2] * 2
    p = GoodputPolicy(build_spec_plan("ngram", 8, None),
                      StepCostModel(CostGrid((1, 64), (1, 4096), WIDTHS), seconds),
                      GoodputSettings(drafts_trees=tree))
    reqs = [RequestView(f"r{i}", 100 + i, 1000, 10**6) for i in range(32)]
    reqs.append(RequestView("short", 90, 3, 10**6))  # a lower cap (max_tokens): its own row
    d = p.decide(StepView(tuple(reqs), len(reqs)))
    assert d.k == 0 and set(d.per_request.values()) == {0}
    assert calls == {"chain": 2, "tree": 2 if tree else 0}
    # A verified token as dear as a plain step: not even a perfect drafter pays, nothing priced.
    calls.update(chain=0, tree=0)
    p = GoodputPolicy(build_spec_plan("ngram", 8, None),
                      StepCostModel(CostGrid((1, 64), (1, 4096), WIDTHS),
                                    [[[0.1 * w for w in WIDTHS]] * 2] * 2),
                      GoodputSettings(drafts_trees=tree))
    d = p.decide(StepView(tuple(reqs), len(reqs)))
    assert d.k == 0 and set(d.per_request.values()) == {0}
    plain = len(reqs) / 0.1
    assert set(d.goodput_by_k.values()) == {plain} and d.modelled_goodput == plain
    assert calls == {"chain": 0, "tree": 0}
