"""A rank's word at the step exchange (dp/rank_state.py): its row and back, and the tick's
sums over the gathered rows (dp/agreement.py)."""

from __future__ import annotations

from dynaspec.dp.agreement import StepAgreement
from dynaspec.dp.rank_state import RankState, StepObservation


def test_rank_state_round_trips_through_its_row():
    obs = StepObservation(4, 300, 3, 0.012, 0.002, 8, 11, 412.5)
    s = RankState.of_step(5, [100, 300, 2], 7, True, 3, 0.25, True, obs,
                          (4.0, 3.0, 1.0, 3.0, 1.0, 0.0))
    assert RankState.of_row(s.row(3)) == s
    quiet = RankState.of_step(0, [])
    back = RankState.of_row(quiet.row(2))
    assert back.observation is None and back.acceptance == (0.0,) * 4
    assert StepObservation.of_values(StepObservation(1, 2, 3, 0.1, 0.0, 0, 1).values()) \
        .modelled_goodput is None


def test_tick_sums_the_ranks_and_pairs_the_step_observation():
    rows = [RankState.of_step(3, [100, 200], 3, join_epoch=2, step_seconds=0.5, ran_step=True,
                              observation=StepObservation(3, 150, 4, 0.02, 0.003, 6, 5, 100.0),
                              acceptance=(2.0, 1.0, 2.0, 0.0)),
            RankState.of_step(1, [400], 1, join_epoch=2, step_seconds=0.75, ran_step=True,
                              observation=StepObservation(1, 400, 2, 0.03, 0.001, 1, 2),
                              acceptance=(1.0, 0.0, 0.0, 0.0))]
    a = StepAgreement(lambda row, t: [r.row(2) for r in rows], 0, 2, 2, grace_s=1, idle_poll_s=0)
    tick = a.exchange(rows[0])
    v = tick.view
    assert (v.num_reqs, v.num_decoding, v.sum_ctx, v.max_ctx, v.max_rank_reqs) == \
        (4, 3, 700, 400, 3)
    assert (tick.num_unfinished, tick.stopping, tick.join_epoch, tick.longest_step_s) == \
        (4, False, 2, 0.75)
    # ctx: ceil((150 * 3 + 400 * 1) / 4), the request-weighted mean
    assert tick.step_observation() == StepObservation(3, 213, 4, 0.03, 0.004, 7, 7, 100.0)
    assert tick.acceptance(2) == ([3.0, 1.0], [2.0, 0.0])
    # a rank that ran a step without an observation (not a pure decode step): none is priced
    a.begin_step()
    rows[1] = RankState.of_step(1, [400], ran_step=True)
    assert a.exchange(rows[0]).step_observation() is None
