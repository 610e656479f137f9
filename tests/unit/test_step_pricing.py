"""StepPricing: expected tokens and step seconds when drafters stop before their caps, checked
against enumeration over every combination of draft lengths."""

from __future__ import annotations

import itertools

import pytest

from dynaspec.spec_decode.policy.step_pricing import StepPricing, one_row_seconds, price_row


def cost(width: int) -> float:
    return 0.01 * (1 + 0.4 * (width - 1)) + 0.001 * width * width  # any increasing shape


def ident(k: int) -> int:
    return k


def length_pmf(survival: list[float], cap: int) -> list[float]:
    """P(min(L, cap) = d) for d = 0..cap, from P(L > i)."""
    s = [1.0] + list(survival[:cap])
    return [s[d] - (s[d + 1] if d < cap else 0.0) for d in range(cap + 1)]


def brute_force(rows, k: int) -> tuple[float, float]:
    """(tokens, seconds) by enumerating every row's draft length."""
    caps = [min(k, limit) if follows else limit for follows, limit, _, _ in rows]
    pmfs = [length_pmf(surv, c) for (_, _, surv, _), c in zip(rows, caps)]
    seconds = tokens = 0.0
    for ds in itertools.product(*(range(c + 1) for c in caps)):
        p = 1.0
        for pmf, d in zip(pmfs, ds):
            p *= pmf[d]
        seconds += p * cost(1 + max(ds, default=0))
        for (_, _, _, rates), d in zip(rows, ds):
            run, acc = 1.0, 0.0
            for i in range(d):  # accepted prefix length given d drafts
                run *= rates[i]
                acc += run
            tokens += p * (1 + acc)
    return tokens, seconds


ROWS = [  # (follows the step's K, limit, survival P(L > i), conditional acceptance rates)
    (True, 4, [0.9, 0.5, 0.4, 0.1], [0.8, 0.7, 0.9, 0.95]),
    (True, 2, [0.3, 0.3], [0.5, 0.5]),
    (False, 1, [0.7], [0.6]),  # a one-draft probe
    (False, 0, [], []),  # cut to 0
]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_expectations_match_enumeration_over_draft_lengths(k):
    rows = [price_row(lambda i, r=rates: r[i], surv, limit, follows)
            for follows, limit, surv, rates in ROWS]
    pricing = StepPricing(rows, cost, ident, widths_follow_drafts=True)
    tokens, seconds = brute_force(ROWS, k)
    assert pricing.tokens(k) == pytest.approx(tokens, rel=1e-12)
    assert pricing.seconds(k) == pytest.approx(seconds, rel=1e-12)


def test_full_lengths_reduce_to_width_one_plus_k():
    rows = [price_row(lambda i: 0.5, [1.0] * 3, 3, True)]
    pricing = StepPricing(rows, cost, ident, widths_follow_drafts=True)
    assert pricing.seconds(2) == pytest.approx(cost(3))
    assert pricing.tokens(2) == pytest.approx(1 + 0.5 + 0.25)


def test_padded_widths_cost_the_cap_whatever_the_drafts():
    rows = [price_row(lambda i: 0.5, [0.1] * 3, 3, True)]
    assert StepPricing(rows, cost, ident, widths_follow_drafts=False).seconds(3) == cost(4)
    assert StepPricing(rows, cost, ident, widths_follow_drafts=True).seconds(3) < cost(2)


@pytest.mark.parametrize("follow", [True, False])
def test_one_row_seconds_is_the_pricing_of_that_row_alone_bit_for_bit(follow):
    """The policy's per-request check skips building a StepPricing for one row: the same
    floats, at every K, on both width models."""
    for follows, limit, surv, rates in ROWS:
        if not follows:
            continue
        row = price_row(lambda i, r=rates: r[i], surv, limit, True)
        pricing = StepPricing([row], cost, ident, follow)
        for k in range(0, limit + 2):
            assert one_row_seconds(row, k, cost, ident, follow) == pricing.seconds(k)


@pytest.mark.parametrize("follow", [True, False])
def test_seconds_by_cap_equals_one_row_seconds_bit_for_bit(follow):
    from dynaspec.spec_decode.policy.step_pricing import one_row_seconds_by_cap

    costs = {w: 0.01 + 0.003 * w ** 1.3 for w in range(1, 12)}
    for survival in ((1.0,) * 6, (0.9, 0.7, 0.7, 0.2, 0.1, 0.0), (0.5, 0.6, 0.1, 0.3, 0.0, 0.0)):
        row = price_row(lambda i: 0.8 - 0.05 * i, survival, 6, True)
        for runnable in (lambda k: k,
                         lambda k: 0 if k == 0 else min(x for x in (2, 4, 6) if x >= k)):
            got = one_row_seconds_by_cap(row, costs.__getitem__, runnable, follow)
            want = [one_row_seconds(row, k, costs.__getitem__, runnable, follow)
                    for k in range(row.limit + 1)]
            assert got == want
