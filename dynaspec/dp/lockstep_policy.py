"""The K policy under data parallelism (docs/design.md §7): one K per step on every rank.

``LockstepPolicy`` wraps a rank's K policy. Its step K is ``inner.decide(view, state)``: the
view carries the global view agreed before ``schedule`` (dp/agreement.py), and ``state`` is the
goodput policy's engine-wide state as one value (spec_decode/policy/policy_state.py: cost table,
draft cost, engine acceptance, guard), which every rank moves alike: a step's observation is
held back (``observe_step``), sent with the next exchange in the rank's ``RankState``
(``report``), and applied gathered, in the same order on every rank (``apply_tick``). A
re-formed group hands the value whole to its members (``adopt``, dp/regroup.py). The
per-request histories stay each rank's own: they only lower that request's own cap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dynaspec.dp.agreement import SharedAcceptance, StepAgreement, Tick
from dynaspec.dp.rank_state import StepObservation
from dynaspec.draft_tree import TreeWalk
from dynaspec.spec_decode.policy.cost_model import StepCostModel
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy
from dynaspec.spec_decode.policy.k_policy import StepK, StepView, TablePolicy
from dynaspec.spec_decode.policy.policy_state import PolicyState

log = logging.getLogger("dynaspec")


class LockstepPolicy:
    def __init__(self, inner: TablePolicy, agreement: StepAgreement) -> None:
        self.agreement = agreement
        self.pending: StepObservation | None = None  # the last step, for the next exchange
        self.set_inner(inner)

    def set_inner(self, inner: TablePolicy) -> None:
        """Wrap `inner` (also when a rank switches to rank 0's policy at start-up)."""
        self.inner, self.keeps_history = inner, inner.keeps_history
        # goodput: the engine-wide prior counts this rank's observations and moves only with
        # every rank's, gathered (SharedAcceptance)
        self.shared: SharedAcceptance | None = None
        if isinstance(inner, GoodputPolicy):
            self.shared = SharedAcceptance(self.agreement.max_k, prior=inner.settings.prior_rate,
                                           prior_weight=inner.settings.engine_prior_weight)
            inner.engine_history = self.shared
        self.refresh()

    def refresh(self) -> None:
        """Take the inner policy's state as the state (at start-up, once it is shared)."""
        self.state: PolicyState | None = (
            self.inner.state() if isinstance(self.inner, GoodputPolicy) else None)

    def adopt(self, state: PolicyState | None) -> None:
        """Continue from a group leader's state (dp/regroup.py); a rank running another kind
        of policy than the leader's follows the leader's kind first."""
        if (state is None) != (self.state is None):
            follow_rank0(self, None if state is None else state.cost.to_json())
        if state is not None:
            assert isinstance(self.inner, GoodputPolicy)  # the kinds agree (above)
            self.inner.load(state)
            self.state = state

    @property
    def plan(self):
        return self.inner.plan

    @property
    def histories(self) -> dict:
        return self.inner.histories

    @property
    def num_reprobes(self) -> int:
        return 0 if self.state is None else self.state.guard.num_reprobes

    def report(self) -> tuple[StepObservation | None, tuple[float, ...]]:
        """This rank's part of the next exchange: the held-back step and the acceptance
        counts since the last one."""
        obs, self.pending = self.pending, None
        return obs, tuple(self.shared.take_pending()) if self.shared is not None else ()

    def apply_tick(self, tick: Tick) -> None:
        """The previous step's observations, gathered from every rank, applied on every rank."""
        inner = self.inner
        if not isinstance(inner, GoodputPolicy):
            return  # the table learns nothing
        assert self.state is not None and self.shared is not None  # set with a goodput inner
        inner.load(self.state)
        obs = tick.step_observation()
        if obs is not None:
            inner.observe_step(obs.num_reqs, obs.ctx, obs.width, obs.target_seconds,
                               obs.draft_seconds, obs.num_drafted, obs.num_emitted,
                               modelled_goodput=obs.modelled_goodput)
        self.shared.apply(*tick.acceptance(self.agreement.max_k))
        self.state = inner.state()

    def decide(self, view: StepView, state: PolicyState | None = None) -> StepK:
        """On the agreed view, from the agreed state (`state`: another one, for tests)."""
        if view.global_view is None:
            raise RuntimeError("data parallel: schedule() needs the step view agreed before it "
                               "(StepAgreement.exchange), or ranks would choose different K")
        return self.inner.decide(view, self.state if state is None else state)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, ctx: int,
                cap: int = 0, fallback: bool = False, walk: TreeWalk | None = None,
                grammar: bool = False) -> None:
        """`walk`: a tree verified as one; it teaches this rank's per-request history and tree
        rates, which a DP decision never reads (goodput prices trees only without a global view).
        `grammar`: forced drafts, priced apart by this rank alone (their caps never widen the
        agreed K)."""
        self.inner.observe(request_id, num_drafted, num_accepted, ctx, cap, fallback,
                           walk=walk, grammar=grammar)

    def observe_step(self, num_reqs: int, ctx: int, width: int, target_seconds: float,
                     draft_seconds: float, num_drafted: int, num_emitted: int,
                     fallback_seconds: float = 0.0, fallback_drafted: int = 0,
                     modelled_goodput: float | None = None) -> None:
        """Held back: sent with the next exchange and applied, gathered, on every rank. A
        fallback is not priced apart under DP (the K is agreed from engine-wide state)."""
        self.pending = StepObservation(num_reqs, ctx, width, target_seconds, draft_seconds,
                                       num_drafted, num_emitted, modelled_goodput)

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)

    def num_cached(self) -> int:
        return self.inner.num_cached()

    def goodput_report(self) -> tuple[float | None, float | None]:
        g = None if self.state is None else self.state.guard
        return (None, None) if g is None else (g.modelled_goodput, g.observed_goodput)


def share_cost_model(policy: LockstepPolicy, rank: int,
                     broadcast: Callable[[object], object] | None = None) -> None:
    """Start every rank from rank 0's step cost table (each rank profiled or loaded its own).
    ``broadcast(obj)`` returns rank 0's ``obj`` (the group's, dp/group.py; by default
    torch.distributed's default group)."""
    inner = policy.inner
    cost = inner.cost_model if isinstance(inner, GoodputPolicy) else None
    # Every rank takes part, with or without a table: a rank whose measured table was refused
    # runs the plan's table instead (spec_decode/cost_profile), and must not leave the others
    # waiting in this broadcast.
    payload: list[object] = [cost.to_json() if rank == 0 and cost is not None else None]
    if broadcast is None:
        import torch.distributed as dist

        dist.broadcast_object_list(payload, src=0)
    else:
        payload[0] = broadcast(payload[0])
    table = payload[0]
    assert table is None or isinstance(table, dict)  # rank 0's StepCostModel.to_json()
    if (table is None) != (cost is None):
        follow_rank0(policy, table)
        return
    if cost is None or table is None:
        return
    if tuple(table["batches"]) != cost.grid.batches or tuple(table["widths"]) != cost.grid.widths \
            or tuple(table["contexts"]) != cost.grid.contexts:
        raise RuntimeError("rank 0's step cost grid differs from this rank's: the ranks were "
                           "started with different settings")
    cost.seconds = [[list(c) for c in r] for r in table["seconds"]]
    cost.source = f"rank 0 ({table.get('source', 'measured')})"
    policy.refresh()


def follow_rank0(policy: LockstepPolicy, table: dict | None) -> None:
    """One rank's start-up table checks disagreed with rank 0's (spec_decode/cost_profile refuses
    a table that fails them, and the policy falls back to the plan's table): every rank runs
    what rank 0 runs, so the step K stays one decision."""
    plan = policy.inner.plan
    new: TablePolicy
    if table is None:  # rank 0 refused its table: the plan's table everywhere
        new = TablePolicy(plan)
    else:  # this rank refused its own: rank 0's table, at the widths this rank's plan runs
        new = GoodputPolicy(plan, StepCostModel.from_json(table),
                            allowed_widths=plan.policy_widths)
    log.warning("K policy: following rank 0 (%s) for one K decision per step",
                "table: its step cost table was refused" if table is None
                else "goodput, its cost table")
    policy.set_inner(new)  # re-wires the shared acceptance for goodput
