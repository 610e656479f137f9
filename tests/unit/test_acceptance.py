"""AcceptanceHistory's prior weight and DraftLengths' censoring: what the goodput policy
learns from each verified step."""

from __future__ import annotations

import pytest

from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory, DraftLengths


def test_a_weighted_prior_moves_at_a_running_means_pace_then_as_the_ema():
    h = AcceptanceHistory(alpha=0.05, prior=0.6, prior_weight=2.0)
    h.update(1, 0)  # one rejection: 0.6 -> 0.6 - 0.6/3, not to 0 (seeded) nor 0.57 (alpha)
    assert h.rates == [pytest.approx(0.4)]
    for _ in range(3):
        h.update(1, 1)
    assert h.rates[0] == pytest.approx((0.6 * 2 + 0 + 3) / 6)  # the running mean with the prior
    for _ in range(100):
        h.update(1, 1)
    before = h.rates[0]
    h.update(1, 0)
    assert h.rates[0] == pytest.approx(before * 0.95)  # 1/(n+2) < alpha: the EMA from here
    seeded = AcceptanceHistory(alpha=0.05)
    seeded.update(2, 0)
    assert seeded.rates == [0.0]  # no prior: the first observation seeds it (per request)


def test_lengths_learn_below_the_cap_only():
    h = DraftLengths(alpha=0.5)
    h.update(4, 4)  # filled its cap: drafts 1..3 followed, nothing said about a 5th
    assert h.rates == [1.0, 1.0, 1.0]
    h.update(4, 1)  # stopped after one draft
    assert h.rates == [0.5, 1.0, 1.0]
    h.update(3, 2)
    assert h.rates == [0.75, 0.5, 1.0] and h.survival(4) == pytest.approx([1, 0.75, 0.375, 0.375])
    h.update(4, 0)  # no draft: verifies nothing, costs what plain decode does; not counted
    assert h.rates == [0.75, 0.5, 1.0] and h.num_updates == 3
    assert DraftLengths().survival(2) == [1.0, 1.0]  # unobserved: drafts fill their caps
    with pytest.raises(ValueError, match="num_drafted <= cap"):
        h.update(2, 3)
