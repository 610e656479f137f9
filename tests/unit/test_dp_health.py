"""dp/health.py: what /health says of a data-parallel engine, read from its roster."""

from __future__ import annotations

from dynaspec.dp.health import failure, health_detail
from dynaspec.dp.roster import Roster


def _roster(serving: set[int]) -> Roster:
    roster = Roster(3, {0, 1, 2}, lambda rank, msg: None, lambda rank: None, 60.0)
    roster.serving = frozenset(serving)
    return roster


def test_every_rank_serving_is_ok_and_nothing_failed():
    roster = _roster({0, 1, 2})
    assert health_detail(roster) == {"status": "ok", "ranks_serving": [0, 1, 2],
                                     "data_parallel_size": 3}
    assert failure(roster, closing=False) is None


def test_fewer_ranks_is_degraded_with_the_ranks_being_replaced_and_the_last_loss():
    roster = _roster({0, 2})
    roster.starting[1] = 5.0
    roster.last_loss = "data-parallel rank 1 was killed"
    detail = health_detail(roster)
    assert detail["status"] == "degraded" and detail["ranks_serving"] == [0, 2]
    assert detail["ranks_starting"] == [1] and detail["ranks_given_up"] == []
    assert detail["last_loss"] == "data-parallel rank 1 was killed"
    assert failure(roster, closing=False) is None  # a rank serves: not a 503


def test_no_rank_serving_names_the_last_loss_and_closing_says_shut_down():
    roster = _roster(set())
    assert failure(roster, closing=False) == "no data-parallel rank is serving"
    roster.last_loss = "data-parallel rank 0 stopped answering"
    assert "last loss: data-parallel rank 0 stopped answering" in failure(roster, closing=False)
    assert failure(_roster({0, 1, 2}), closing=True) == "the data-parallel engine is shut down"
