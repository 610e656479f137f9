"""Lockstep K agreement without processes: ranks are threads, the all-gather a barrier.

The property under test: with different local batches, different per-request histories and
different step timings on each rank, every rank's K is the same at every step, because the
step K depends only on the gathered view and on state every rank updates identically.
"""

from __future__ import annotations

import random
import threading

import pytest

from dynaspec.dp.agreement import SharedAcceptance, StepAgreement, Tick
from dynaspec.dp.lockstep_policy import LockstepPolicy
from dynaspec.dp.rank_state import RankState
from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy
from dynaspec.spec_decode.policy.k_policy import GlobalStepView, RequestView, StepView, TablePolicy


class ThreadGroup:
    """An all_gather over threads: each rank's row lands in a shared slot, a barrier syncs."""

    def __init__(self, world: int) -> None:
        self.rows: list = [None] * world
        self.barrier = threading.Barrier(world)

    def gather_for(self, rank: int):
        def gather(row, timeout_s):
            self.rows[rank] = list(row)
            self.barrier.wait(timeout=30)
            out = [list(r) for r in self.rows]
            self.barrier.wait(timeout=30)  # nobody overwrites a slot before all have read
            return out
        return gather


def exchange(a: StepAgreement, pol: LockstepPolicy | None, num_reqs: int,
             ctxs: list[int]) -> Tick:
    """The rank loop's exchange: the expected step and the policy's report of the last one."""
    obs, acceptance = pol.report() if pol is not None else (None, ())
    return a.exchange(RankState.of_step(num_reqs, ctxs, ran_step=obs is not None,
                                        observation=obs, acceptance=acceptance))


def _cost() -> StepCostModel:
    grid = CostGrid((1, 4, 16), (16, 512), (1, 2, 3, 4))
    # Verify gets dearer with width and batch: K depends on the shared state, not a constant.
    secs = [[[0.001 * b * (1 + 0.4 * (w - 1)) * (1 + c / 1024) for w in grid.widths]
             for c in grid.contexts] for b in grid.batches]
    return StepCostModel(grid, secs, alpha=0.3)


def _run_ranks(make_policy, world: int, steps: int, seed: int):
    """Drive `world` policies in lockstep with rank-specific random batches; K log per rank."""
    group = ThreadGroup(world)
    logs: list[list[int]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        rng = random.Random(seed * 100 + rank)  # each rank its own load and acceptance
        a = StepAgreement(group.gather_for(rank), rank, world, 3, grace_s=5, idle_poll_s=0)
        pol = LockstepPolicy(make_policy(), a)
        try:
            for _ in range(steps):
                a.begin_step()
                n = rng.randrange(0, 6 if rank else 12)  # rank 0 carries more load
                views = tuple(
                    RequestView(f"r{rank}-{i}", rng.randrange(5, 900), rng.randrange(1, 9), 1000)
                    for i in range(n)
                )
                # The rank loop: the exchange of the expected batch's view, before schedule().
                expected = n + rng.randrange(0, 2)
                tick = exchange(a, pol, expected, [v.context_len for v in views])
                pol.apply_tick(tick)
                # The scheduler's two decisions on the agreed view: the expected batch
                # (reservation), then the formed one, which may have lost requests.
                planned = pol.decide(StepView(views, expected, tick.view))
                n = rng.randrange(0, n + 1)
                d = pol.decide(StepView(views[:n], n, tick.view))
                assert d.k == planned.k, "one agreed view: the formed batch's K is the reserved K"
                logs[rank].append(d.k)
                assert all(n <= d.k for n in d.per_request.values()), (d.k, d.per_request)
                for rid, cap in d.per_request.items():  # local, rank-specific observations
                    pol.observe(rid, cap, rng.randrange(0, cap + 1), 10)
                    if rng.random() < 0.3:
                        pol.forget(rid)
                if n and rng.random() < 0.7:
                    pol.observe_step(n, 300, 1 + d.k, rng.uniform(0.001, 0.02), 0.0005 * n,
                                     sum(d.per_request.values()), n,
                                     modelled_goodput=d.modelled_goodput)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return logs


@pytest.mark.parametrize("world", [2, 3])
def test_goodput_ranks_agree_on_k_every_step(world):
    plan = build_spec_plan("ngram", 3, [[1, 4, 3], [5, 12, 2], [13, 64, 1]])
    logs = _run_ranks(lambda: GoodputPolicy(plan, _cost()), world, steps=120, seed=world)
    for r in range(1, world):
        assert logs[r] == logs[0], f"rank {r} chose a different K"
    assert len(set(logs[0])) >= 2, f"the test never moved K: {set(logs[0])}"


def test_table_ranks_agree_and_use_the_global_batch():
    plan = build_spec_plan("ngram", 3, [[1, 4, 3], [5, 12, 2], [13, 64, 1]])
    logs = _run_ranks(lambda: TablePolicy(plan), 2, steps=60, seed=7)
    assert logs[0] == logs[1]
    assert {1, 2} <= set(logs[0])


def test_seed_case_constant_two_is_kept():
    # --num-spec-tokens 3 with every entry resolving to 2: constant(2), never the raw maximum 3.
    plan = build_spec_plan("ngram", 3, [[1, 8, 2], [9, 64, 5]])
    assert plan.kind == "variable"  # 5 clamps to 3, not 2: make every entry resolve to 2
    plan = build_spec_plan("ngram", 3, [[1, 8, 2], [9, 64, 2]])
    assert (plan.kind, plan.max_k) == ("constant", 2)
    logs = _run_ranks(lambda: TablePolicy(plan), 3, steps=30, seed=1)
    assert all(log == [2] * 30 for log in logs)


def test_global_view_statistic_matches_single_rank_definition():
    g = GlobalStepView(num_reqs=5, num_decoding=3, sum_ctx=10, max_ctx=6, max_rank_reqs=3)
    assert g.ctx_stat == 4  # ceil(10 / 3)
    assert GlobalStepView(2, 0, 0, 0, 2).ctx_stat == 1
    v = StepView((RequestView("a", 7, 5, 100),), 2, g)
    assert (v.batch_size, v.ctx_stat) == (5, 4)
    assert (StepView(v.requests, 2).batch_size, StepView(v.requests, 2).ctx_stat) == (2, 7)


def test_shared_acceptance_counts_only_move_on_apply():
    a, b = SharedAcceptance(3), SharedAcceptance(3)
    a.update(3, 1)  # position 0 hit, position 1 reached and missed
    a.update(2, 2)  # positions 0 and 1 hit
    assert a.num_updates == 0 and a.expected_accepted(3) == 0.0
    pending = a.take_pending()
    assert pending == [2, 2, 0, 2, 1, 0]
    for s in (a, b):
        s.apply(pending[:3], pending[3:])
    assert a.rates == b.rates == [1.0, 0.5]
    assert a.expected_accepted(2) == pytest.approx(1.0 + 0.5)
    a.update(1, 0)
    assert a.take_pending() == [1, 0, 0, 0, 0, 0]


def test_two_exchanges_in_one_step_is_an_error():
    group = ThreadGroup(1)
    a = StepAgreement(group.gather_for(0), 0, 1, 2, grace_s=1, idle_poll_s=0)
    exchange(a, None, 0, [])
    with pytest.raises(RuntimeError, match="two step exchanges"):
        exchange(a, None, 0, [])


def test_decide_without_the_agreed_view_is_refused():
    """No collective hides in decide: the view must have been exchanged before schedule()."""
    plan = build_spec_plan("ngram", 3, None)
    a = StepAgreement(ThreadGroup(1).gather_for(0), 0, 1, 3, grace_s=1, idle_poll_s=0)
    pol = LockstepPolicy(TablePolicy(plan), a)
    with pytest.raises(RuntimeError, match="agreed before it"):
        pol.decide(StepView((RequestView("a", 5, 9, 100),), 1))
    tick = exchange(a, pol, 1, [5])
    assert pol.decide(StepView((RequestView("a", 5, 9, 100),), 1, tick.view)).k == 3
    assert a.num_ticks == 1, "decide made no exchange"


@pytest.mark.parametrize("rank0_has_table", [False, True])
def test_a_rank_whose_table_check_disagreed_follows_rank_0(monkeypatch, rank0_has_table):
    """A start-up table refused on one rank only: every rank runs what rank 0 runs."""
    import torch.distributed as dist

    from dynaspec.dp.lockstep_policy import share_cost_model

    plan = build_spec_plan("ngram", 3, None)
    rank0 = _cost().to_json() if rank0_has_table else None
    monkeypatch.setattr(
        dist, "broadcast_object_list", lambda payload, src: payload.__setitem__(0, rank0)
    )
    a = StepAgreement(ThreadGroup(2).gather_for(1), 1, 2, 3, grace_s=5, idle_poll_s=0)
    mine = TablePolicy(plan) if rank0_has_table else GoodputPolicy(plan, _cost())
    pol = LockstepPolicy(mine, a)
    share_cost_model(pol, rank=1)
    if rank0_has_table:
        assert (
            isinstance(pol.inner, GoodputPolicy) and pol.inner.cost_model.seconds == _cost().seconds
        )
        assert pol.inner.engine_history is pol.shared  # the engine-wide prior is shared again
        assert pol.state == pol.inner.state()  # and the state is the new policy's
    else:
        assert type(pol.inner) is TablePolicy


def test_shared_prior_moves_as_a_single_rank_history_would():
    from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory

    shared = SharedAcceptance(2, prior=0.6, prior_weight=2.0)
    local = AcceptanceHistory(alpha=0.05, prior=0.6, prior_weight=2.0)
    # (drafted, accepted) of one step, and the per-position counts a gather would sum it to
    steps = (((1, 0), [1, 0], [0, 0]), ((2, 2), [1, 1], [1, 1]), ((2, 1), [1, 1], [1, 0]))
    for (drafted, accepted), reached, hits in steps:
        shared.apply([float(n) for n in reached], [float(h) for h in hits])
        local.update(drafted, accepted)
    assert shared.rates == pytest.approx(local.rates)


@pytest.mark.parametrize("learned", [False, True])
def test_one_rank_and_the_dp_path_price_the_same_view_the_same(learned):
    """One goodput formula (step_pricing.goodput): a view whose requests carry no history of
    their own is priced by one rank from the engine-wide state, and under DP from the same
    state shared by every rank; every candidate K gets the same goodput, so the same K."""
    plan = build_spec_plan("ngram", 3, None)
    one = GoodputPolicy(plan, _cost())
    a = StepAgreement(ThreadGroup(1).gather_for(0), 0, 1, 3, grace_s=1, idle_poll_s=0)
    dp = LockstepPolicy(GoodputPolicy(plan, _cost()), a)
    if learned:  # the same engine-wide acceptance on both (a rank learns it from the gather)
        for drafted, accepted in ((3, 1), (3, 3), (2, 0), (3, 2)):
            one.observe("old", drafted, accepted, 10)
            dp.observe("old", drafted, accepted, 10)
            a.begin_step()
            dp.apply_tick(exchange(a, dp, 0, []))
        one.forget("old")
        assert dp.state is not None
        assert one.engine_history.rates == pytest.approx(dp.state.acceptance.rates)
        one.engine_history.rates = list(dp.state.acceptance.rates)  # the same floats
    views = tuple(RequestView(f"r{i}", 100 + 37 * i, 50, 1000) for i in range(4))
    local = one.decide(StepView(views, 4))
    a.begin_step()
    tick = exchange(a, dp, 4, [v.context_len for v in views])
    shared = dp.decide(StepView(views, 4, tick.view))
    assert tick.view.max_rank_reqs == 4 and tick.view.ctx_stat == StepView(views, 4).ctx_stat
    assert local.goodput_by_k == shared.goodput_by_k and len(local.goodput_by_k) == 4
    assert (local.k, local.modelled_goodput) == (shared.k, shared.modelled_goodput)


def test_the_modelled_goodput_travels_with_the_step_observation():
    """The decision's report (not a record in the policy) pairs with the step's timing: held
    back with the observation, gathered, and applied on every rank."""
    plan = build_spec_plan("ngram", 3, None)
    a = StepAgreement(ThreadGroup(1).gather_for(0), 0, 1, 3, grace_s=1, idle_poll_s=0)
    pol = LockstepPolicy(GoodputPolicy(plan, _cost()), a)
    pol.observe_step(2, 300, 3, 0.01, 0.0, 4, 5, modelled_goodput=321.0)
    pol.apply_tick(exchange(a, pol, 2, [300, 300]))
    assert pol.goodput_report() == (321.0, pytest.approx(500.0))
    a.begin_step()
    pol.observe_step(2, 300, 3, 0.01, 0.0, 4, 5)  # no decision to pair: the EMAs stay
    pol.apply_tick(exchange(a, pol, 2, [300, 300]))
    assert pol.goodput_report() == (321.0, pytest.approx(500.0))
