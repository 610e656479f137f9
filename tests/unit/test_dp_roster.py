"""The roster without processes: group epochs after a loss and a join, bounded replacement."""

from __future__ import annotations

import time

from dynaspec.dp.messages import Regroup
from dynaspec.dp.roster import BACKOFF_S, MAX_START_ATTEMPTS, Roster


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []
        self.spawned: list[int] = []


def _roster(world: int = 2, local: set[int] | None = None) -> tuple[Roster, Recorder]:
    rec = Recorder()
    roster = Roster(world, set(range(world)) if local is None else local,
                    lambda r, m: rec.sent.append((r, m)), rec.spawned.append, 600.0)
    for r in range(world):
        roster.joined(r, 0)
    return roster, rec


def _far() -> float:
    return time.monotonic() + 1000.0


def test_loss_moves_survivors_now_and_a_replacement_joins_by_agreement():
    roster, rec = _roster(3)
    roster.lost({1: "died (exit code -9)"})
    assert roster.serving == {0, 2} and roster.counts.rank_losses == 1
    assert rec.sent == [(0, Regroup(1, (0, 2), False)), (2, Regroup(1, (0, 2), False))]
    assert roster.last_loss == "data-parallel rank 1 died (exit code -9)"
    rec.sent.clear()
    roster.tick(time.monotonic())  # the first restart is immediate
    assert rec.spawned == [1] and 1 in roster.starting
    roster.ready(1)
    assert {r for r, _ in rec.sent} == {0, 1, 2}
    assert all(m == Regroup(2, (0, 1, 2), True) for _, m in rec.sent)
    assert roster.serving == {0, 2}  # not before it stepped in the new group
    roster.joined(1, 2)
    assert roster.serving == {0, 1, 2} and roster.counts.replacements == 1


def test_a_slot_failing_at_start_is_retried_with_backoff_then_given_up():
    roster, rec = _roster(2)
    roster.lost({1: "died (exit code -9)"})
    t = time.monotonic()
    for attempt in range(MAX_START_ATTEMPTS):
        roster.tick(_far())
        assert rec.spawned == [1] * (attempt + 1)
        roster.lost({1: "died (exit code 1)"})  # died while loading: not a new rank loss
        if attempt + 1 < MAX_START_ATTEMPTS:
            wait = roster.retry_at[1] - t
            assert abs(wait - BACKOFF_S[attempt]) < 0.5, (attempt, wait)
    assert roster.given_up == {1} and 1 not in roster.retry_at
    assert roster.counts.rank_losses == 1 and roster.counts.given_up == 1
    roster.tick(_far())
    assert rec.spawned == [1] * MAX_START_ATTEMPTS  # no more tries
    assert roster.serving == {0}


def test_remote_rank_is_not_restarted_and_closing_starts_nothing():
    roster, rec = _roster(2, local={0})
    roster.lost({1: "closed its control channel"})
    roster.tick(_far())
    assert rec.spawned == [] and roster.serving == {0}
    roster.closing = True
    roster.lost({0: "died"})
    roster.tick(_far())
    assert rec.spawned == [] and roster.serving == frozenset() and roster.members == ()


def test_a_start_timeout_is_reported_to_the_pump():
    roster, rec = _roster(2)
    roster.lost({1: "died"})
    roster.tick(time.monotonic())
    assert roster.tick(time.monotonic() + 601.0) == [1]
