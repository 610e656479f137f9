"""`bench async` arithmetic: time outside the forward and the share async recovers."""

from __future__ import annotations

import pytest

from dynaspec.bench.async_cmd import outside_forward, recovered_share
from dynaspec.bench.compare import RunRecord


def _rec(arm: str, pair: int, elapsed: float, forward: float, sample: float = 0.0) -> RunRecord:
    r = RunRecord(arm, pair, 100, elapsed)
    r.phase_s = {"forward": forward, "sample": sample, "schedule": 0.1}
    return r


def test_outside_forward_is_wall_minus_forward_and_verify():
    assert outside_forward({"forward": 7.0, "sample": 1.0, "update": 0.5}, 10.0) == pytest.approx(
        2.0
    )
    assert outside_forward({"forward": 11.0}, 10.0) == 0.0  # clock skew never goes negative


def test_recovered_share_pairs_sync_outside_with_the_wall_saved():
    sync = [_rec("a", i, 10.0, 7.0, 1.0) for i in range(3)]  # 2 s outside the forward each
    asyn = [_rec("b", 0, 9.0, 7.0), _rec("b", 1, 9.5, 7.0), _rec("b", 2, 8.5, 7.0)]
    out = recovered_share(sync, asyn)
    assert out["recovered"] == pytest.approx([0.5, 0.25, 0.75])
    assert out["recovered_mean"] == pytest.approx(0.5)
    lo, hi = out["ci95"]
    assert lo < 0.5 < hi and hi - 0.5 == pytest.approx(0.5 - lo)
    assert out["sync_outside_share"] == pytest.approx([0.2] * 3)
    slower = recovered_share(sync[:1], [_rec("b", 0, 11.0, 7.0)])
    assert slower["recovered"] == pytest.approx([-0.5]) and slower["ci95"] is None
