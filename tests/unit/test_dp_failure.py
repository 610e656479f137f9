"""The failure watch's verdicts without processes, on an injected clock: a silent heartbeat names
a rank at once; a rank that keeps beating is never named by it, however long its step; a stall
of the front end itself names nobody; a death outranks silence; timeout 0 turns the rule off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynaspec.config import ParallelConfig
from dynaspec.dp.failure import SETTLE_S, FailureWatch
from dynaspec.dp.heartbeat import MAX_CREDIT_S
from dynaspec.dp.messages import GroupLost


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FrontEnd:
    """What the watch reads of the supervisor: config, roster, processes, and its action."""

    def __init__(self, heartbeat_timeout_s: float = 1.0, world: int = 2) -> None:
        self.config = SimpleNamespace(parallel=ParallelConfig(
            data_parallel_size=world, dp_rank_timeout_s=10.0,
            dp_heartbeat_timeout_s=heartbeat_timeout_s))
        self.roster = SimpleNamespace(serving=frozenset(range(world)), members=tuple(range(world)),
                                      epoch=0, regroup_all=lambda: None)
        self.procs: dict = {}
        self._closing, self._started = False, True
        self.declared: list[dict[int, str]] = []

    def _declare_lost(self, culprits: dict[int, str]) -> None:
        self.declared.append(dict(culprits))
        self.roster.serving = self.roster.serving - set(culprits)
        self.roster.members = tuple(r for r in self.roster.members if r not in culprits)


def _run(watch: FailureWatch, clock: Clock, seconds: float, beating: set[int],
         step_s: float = 0.125) -> None:
    """The pump's loop: every step_s the beating ranks' heartbeats are read, then a check
    (steps of 1/8 s: exact in binary, so "exactly the timeout" is exact)."""
    for _ in range(round(seconds / step_s)):
        clock.t += step_s
        for r in beating:
            watch.beats.beat(r)
        watch.check()


def _watch(**kw) -> tuple[FailureWatch, FrontEnd, Clock]:  # type: ignore[no-untyped-def]
    eng, clock = FrontEnd(**kw), Clock()
    watch = FailureWatch(eng, clock)
    for r in eng.roster.members:
        watch.beats.beat(r)
    return watch, eng, clock


def test_a_silent_heartbeat_names_the_rank_at_once_after_the_timeout():
    watch, eng, clock = _watch()
    _run(watch, clock, 3.0, {0, 1})
    assert eng.declared == []
    _run(watch, clock, 1.0, {0})  # rank 1 stopped (SIGSTOP): its beats stop
    assert eng.declared == []  # silent for exactly the timeout: not yet
    _run(watch, clock, 0.125, {0})
    assert len(eng.declared) == 1, eng.declared  # at once: no settle (SETTLE_S) waited for
    assert 0.125 < SETTLE_S
    (culprits,) = eng.declared
    assert list(culprits) == [1]
    assert culprits[1].startswith("stopped answering (no heartbeat for 1.1 s)"), culprits
    _run(watch, clock, 5.0, {0})  # named once: the survivor keeps beating and is never named
    assert len(eng.declared) == 1


def test_a_rank_busy_in_a_long_step_keeps_beating_and_is_not_named():
    watch, eng, clock = _watch()
    # Neither rank sends a step report for 8 s (one long step, the other waiting on it in the
    # exchange), but both heartbeat threads run.
    _run(watch, clock, 8.0, {0, 1})
    assert eng.declared == []
    assert watch.beats.longest_gap_s == 0.125


def test_a_stall_of_the_front_end_itself_names_nobody():
    watch, eng, clock = _watch()
    _run(watch, clock, 1.0, {0, 1})
    clock.t += 30.0  # the front end did not run (a paused VM): nobody's beats were read
    watch.beats.beat(0)  # the pump reads what arrived meanwhile before it checks
    watch.check()
    assert eng.declared == []  # the 30 s counted as MAX_CREDIT_S of running time
    assert MAX_CREDIT_S < 1.0
    _run(watch, clock, 0.5, {0})  # rank 1 still silent once the front end runs again
    assert eng.declared == []  # 0.5 + 0.5 s: exactly the timeout
    _run(watch, clock, 0.125, {0})
    assert [list(c) for c in eng.declared] == [[1]]


def test_a_death_is_named_as_one_even_when_its_heartbeat_went_silent_too():
    watch, eng, clock = _watch()
    _run(watch, clock, 1.0, {0, 1})
    _run(watch, clock, 1.0, {0})
    watch.on_exit(1, -9)  # seen in the same pump round as the silence
    _run(watch, clock, 0.125, {0})
    assert eng.declared == [{1: "died (exit code -9)"}]


def test_the_exchange_backstop_still_names_a_rank_that_beats_but_does_not_step():
    """A rank alive (beating) but stuck outside the exchange: its peer's exchange times out, it
    reports GroupLost, and the one member that did not report is named after the settle."""
    watch, eng, clock = _watch()
    _run(watch, clock, 1.0, {0, 1})
    watch.heard(0, GroupLost(0, 0, "step exchange failed after waiting up to 11.0 s"))
    _run(watch, clock, 0.125, {0, 1})
    assert eng.declared == [{1: "stopped answering (no step within 10.0 s past the longest "
                                "step)"}]


def test_timeout_zero_turns_the_heartbeat_rule_off():
    watch, eng, clock = _watch(heartbeat_timeout_s=0.0)
    _run(watch, clock, 1.0, {0, 1})
    _run(watch, clock, 10.0, {0})
    assert eng.declared == []


def test_a_rank_never_heard_beating_is_left_to_the_other_rules():
    eng, clock = FrontEnd(), Clock()
    watch = FailureWatch(eng, clock)
    _run(watch, clock, 5.0, {0})  # rank 1 never sent a heartbeat (none yet, or no thread)
    assert eng.declared == []


def test_a_negative_heartbeat_timeout_is_refused_with_its_name():
    with pytest.raises(ValueError, match="dp_heartbeat_timeout_s"):
        ParallelConfig(dp_heartbeat_timeout_s=-1.0)
