"""One K per step across a re-formed group (§7d), without processes: ranks are threads.

Three ranks step in lockstep; one is lost; the survivors form a group of two through the real
handshake (``GroupSwitch._handshake``) after one of them applied a tick the other did not (a
peer that died mid-exchange); a replacement with a fresh policy and a different cost table
joins through the handshake again. In every phase every member picks the same K at every step.
The control: a joiner that skips the handshake's state picks a different K.
"""

from __future__ import annotations

import random
import threading

import pytest

from dynaspec.dp.agreement import StepAgreement, Tick
from dynaspec.dp.group import Membership
from dynaspec.dp.lockstep_policy import LockstepPolicy
from dynaspec.dp.rank_state import RankState, StepObservation
from dynaspec.dp.regroup import GroupSwitch
from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy
from dynaspec.spec_decode.policy.k_policy import GlobalStepView, RequestView, StepView
from tests.unit.test_dp_agreement import ThreadGroup, _cost, exchange

PLAN = build_spec_plan("ngram", 3, [[1, 4, 3], [5, 12, 2], [13, 64, 1]])


class FakeGroup:
    """RankGroup's surface (gather, broadcast_object, index, rank, membership) over threads."""

    def __init__(self, shared: ThreadGroup, members: tuple[int, ...], rank: int, epoch: int):
        self.shared, self.rank = shared, rank
        self.membership = Membership(epoch, members)
        self.index = members.index(rank)
        self.size = len(members)
        self.gather = shared.gather_for(self.index)

    def broadcast_object(self, obj, root_index: int, timeout_s: float):  # type: ignore[no-untyped-def]
        self.shared.rows[self.index] = obj
        self.shared.barrier.wait(timeout=30)
        out = self.shared.rows[root_index]
        self.shared.barrier.wait(timeout=30)
        return out


class Rank:
    def __init__(self, rank: int, cost_scale: float = 1.0) -> None:
        self.rank, self.rng = rank, random.Random(rank * 7 + 1)
        self.agreement = StepAgreement(None, rank, 1, 3, grace_s=5, idle_poll_s=0)  # type: ignore[arg-type]
        cost = _cost()
        cost.seconds = [[[s * (cost_scale if w > 1 else 1.0) for w, s in enumerate(c)]
                         for c in b] for b in cost.seconds]
        self.policy = LockstepPolicy(GoodputPolicy(PLAN, cost), self.agreement)
        self.log: list[int] = []

    def step(self) -> None:
        """The rank loop's order: exchange, apply the gathered observations, decide, observe."""
        a, pol, rng = self.agreement, self.policy, self.rng
        a.begin_step()
        n = rng.randrange(0, 8)
        views = tuple(RequestView(f"r{self.rank}-{i}", rng.randrange(5, 900), rng.randrange(1, 9),
                                  1000) for i in range(n))
        tick = exchange(a, pol, n, [v.context_len for v in views])
        pol.apply_tick(tick)
        d = pol.decide(StepView(views, n, tick.view))
        self.log.append(d.k)
        for rid, cap in d.per_request.items():
            pol.observe(rid, cap, rng.randrange(0, cap + 1), 10)
        if n:
            pol.observe_step(n, 300, 1 + d.k, rng.uniform(0.001, 0.02), 0.0005 * n,
                             sum(d.per_request.values()), n)


def _in_threads(ranks: list[Rank], fn) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    def run(r: Rank) -> None:
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def _form(ranks: list[Rank], epoch: int, sync: bool = True) -> None:
    shared = ThreadGroup(len(ranks))
    members = tuple(r.rank for r in ranks)

    def handshake(r: Rank) -> None:
        group = FakeGroup(shared, members, r.rank, epoch)
        if sync:
            GroupSwitch._handshake(group, r.agreement, r.policy, timeout=30)  # type: ignore[arg-type]
        r.agreement.gather, r.agreement.world_size = group.gather, group.size

    _in_threads(ranks, handshake)


def _phase(ranks: list[Rank], steps: int) -> list[list[int]]:
    start = [len(r.log) for r in ranks]
    _in_threads(ranks, lambda r: [r.step() for _ in range(steps)])
    return [r.log[s:] for r, s in zip(ranks, start)]


def _apply_alone(policy: LockstepPolicy, obs: StepObservation) -> None:
    """A tick whose gathered rows only this rank saw (its peer died in the exchange)."""
    row = RankState.of_step(0, [], ran_step=True, observation=obs, acceptance=(0.0,) * 6)
    policy.apply_tick(Tick(0, GlobalStepView(0, 0, 0, 0, 0), 0, False, 0, 0.0, (row,)))


def _regrouped(sync_joiner: bool) -> list[list[list[int]]]:
    r0, r1, r2 = Rank(0), Rank(1), Rank(2)
    _form([r0, r1, r2], 0)
    phases = [_phase([r0, r1, r2], 60)]
    # Rank 2 dies after rank 0 had the last exchange's rows but before rank 1 did: rank 0
    # applies one more tick's observations, so the survivors' shared state differs.
    for _ in range(20):  # (a tick's worth of drastic observations, so the gap shows in K)
        _apply_alone(r0.policy, StepObservation(3, 300, 4, 0.5, 0.001, 6, 3))
        _apply_alone(r0.policy, StepObservation(7, 300, 3, 0.5, 0.001, 6, 7))
    r0.agreement.num_ticks += 1
    _form([r0, r1], 1)
    phases.append(_phase([r0, r1], 60))
    joiner = Rank(2, cost_scale=0.4)  # its own, different table: wide steps look cheap
    joiner.rng = random.Random(99)
    if sync_joiner:
        _form([r0, r1, joiner], 2)
    else:
        _form([r0, r1], 2)
        _form([joiner], 2, sync=False)
        shared = ThreadGroup(3)
        for r in (r0, r1, joiner):
            r.agreement.gather = shared.gather_for((r0, r1, joiner).index(r))
            r.agreement.world_size = 3
    phases.append(_phase([r0, r1, joiner], 60))
    return phases


def test_one_k_per_step_before_during_and_after_a_loss():
    phases = _regrouped(sync_joiner=True)
    for i, logs in enumerate(phases):
        for r, log in enumerate(logs[1:], 1):
            assert log == logs[0], f"phase {i}: member {r} chose a different K"
    assert len({k for logs in phases for k in logs[0]}) >= 2, "the test never moved K"


def test_a_joiner_without_the_handshake_state_would_disagree():
    """The control: the handshake's state transfer is what keeps the joiner's K equal."""
    logs = _regrouped(sync_joiner=False)[-1]
    assert logs[0] == logs[1]
    assert logs[2] != logs[0], "the joiner agreed without the state: the test shows nothing"


@pytest.mark.parametrize("epoch", [0, 3])
def test_handshake_continues_at_the_highest_tick(epoch):
    ranks = [Rank(0), Rank(1)]
    ranks[1].agreement.num_ticks = 41
    ranks[1].agreement.longest_step_s = 0.25
    _form(ranks, epoch)
    assert [r.agreement.num_ticks for r in ranks] == [41, 41]
    assert [r.agreement.longest_step_s for r in ranks] == [0.25, 0.25]
