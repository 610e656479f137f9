"""The support matrix's rules (bench/matrix.py): when a cell stops adding pairs and when it
passes, on synthetic pair results."""

from __future__ import annotations

import pytest

from dynaspec.bench.matrix import (
    MatrixSettings,
    enough_pairs,
    half_width,
    verdict,
)
from dynaspec.bench.stats import RatioEstimate, paired_ratio


def _est(ratios: list[float]) -> RatioEstimate:
    return paired_ratio([100.0] * len(ratios), [100.0 * r for r in ratios])


def test_half_width_is_the_wider_side_of_the_interval_as_a_share_of_its_point():
    est = RatioEstimate(1.0, 0.95, 1.10, 5, 0.95, 0.1)
    assert half_width(est) == pytest.approx(0.10)
    assert half_width(RatioEstimate(1.0, None, None, 1, 0.95, None)) is None


def test_a_steady_cell_stops_at_min_pairs_a_noisy_one_goes_on_until_the_cap():
    steady = _est([1.20, 1.21, 1.19, 1.20, 1.20])
    assert half_width(steady) < 0.03
    assert enough_pairs(steady, 5, 20, 0.03)
    assert not enough_pairs(_est([1.20, 1.21, 1.19]), 5, 20, 0.03), "under min_pairs"
    noisy = _est([1.0, 1.3, 0.8, 1.2, 0.9])
    assert half_width(noisy) > 0.03
    assert not enough_pairs(noisy, 5, 20, 0.03)
    assert enough_pairs(_est([1.0, 1.3, 0.8, 1.2, 0.9] * 4), 5, 20, 0.03), "the cap"
    # A wider target accepts the same noise sooner.
    assert enough_pairs(noisy, 5, 20, 0.5)


@pytest.mark.parametrize(("ratios", "status", "why"), [
    ([1.00, 1.01, 0.99, 1.00, 1.00], "pass", ""),
    ([0.985, 0.99, 0.98, 0.985, 0.99], "pass", ""),  # just above the point, tight interval
    ([0.97, 0.975, 0.97, 0.97, 0.975], "fail", "below plain"),  # point under 0.98
    ([1.10, 0.85, 1.15, 0.90, 1.05], "fail", "below plain"),  # point fine, lower bound < 0.95
    ([1.5], "fail", "one pair"),
])
def test_a_cell_passes_at_a_point_of_098_with_its_lower_bound_at_095(ratios, status, why):
    est = _est(ratios)
    got, reason = verdict(est, (8, 8), (8, 8))
    assert got == status and why in reason
    if status == "fail" and est.lo is not None:
        assert est.ratio < 0.98 or est.lo < 0.95


def test_a_fast_cell_whose_greedy_output_differs_fails():
    est = _est([1.5, 1.5, 1.5, 1.5, 1.5])
    assert verdict(est, (7, 8), None) == ("fail", "the drafter's greedy output differs from "
                                                   "plain on 1 of 8 requests")
    status, reason = verdict(est, (8, 8), (6, 8))
    assert status == "fail" and "oracle's greedy output differs" in reason
    assert verdict(est, None, None)[0] == "pass", "sampled cells are not compared"


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="min-pairs"):
        MatrixSettings(min_pairs=1)
    with pytest.raises(ValueError, match="min-pairs"):
        MatrixSettings(min_pairs=6, max_pairs=5)
    with pytest.raises(ValueError, match="unknown matrix workload 'poems'"):
        MatrixSettings(workloads=("poems",))
    with pytest.raises(ValueError, match="unknown matrix drafter 'magic'"):
        MatrixSettings(drafters=("magic",))
    with pytest.raises(ValueError, match="--concurrency"):
        MatrixSettings(concurrencies=(0,))
