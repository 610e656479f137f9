"""Lockstep K agreement across data-parallel ranks (docs/design.md §7).

Every engine step each rank forms its batch, then all ranks exchange one small row of numbers
(``all_gather`` of float64, so every rank holds the same rows and computes the same sums bit for
bit) and each rank applies the same pure K decision to the summed view. What the row carries:

- the step view: requests in the step, decoding requests, sum and max of their contexts;
- lockstep control: requests unfinished on the rank (all zero = every rank idles), a stop flag
  (the ranks leave together, on the same tick, so no collective is left waiting), the group
  the rank was told to move to (all members move after the tick where every row names it: a
  replacement joins at one step boundary, dp/group.py), the rank's last step time (the timeout
  grows with the longest step any rank has run);
- the previous step's observations for the K policy's shared state: its shape and time (the
  goodput cost model and draft cost) and per-position acceptance counts (the engine-wide prior).
  Each rank applies the *gathered* observations, the same ones in the same order, so the state
  a decision reads is identical on every rank and the K stays a pure function of the global
  view plus that state. The policy's per-request histories stay local: they only lower that
  request's own cap, never the step's K.

The exchange is explicit: the rank loop (dp/rank.py) calls ``exchange`` with the scheduler's
step view (``Scheduler.step_view``: the batch it expects) *before* ``schedule``, applies the
gathered observations to the policy (``LockstepPolicy.apply_tick``) and passes the global view
into ``schedule(global_view)``. Both of the scheduler's K decisions (the reservation and the
formed batch's) read that one view, so they and the step's K are the same on every rank, and no
collective hides inside a policy call: ``LockstepPolicy.decide`` refuses a view without the
agreed global view. A rank with nothing to do still exchanges (the dummy step: collectives
only, no forward, since ranks share no collective inside the forward).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dynaspec.draft_tree import TreeWalk
from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory
from dynaspec.spec_decode.policy.k_policy import GlobalStepView, StepK, StepView

# Row layout (one float64 per field, then 2 * max_k acceptance counts).
_FIELDS = ("num_reqs", "num_decoding", "sum_ctx", "max_ctx", "num_unfinished", "stopping",
           "join_epoch", "step_seconds", "obs_ran", "obs_valid", "obs_num_reqs", "obs_ctx",
           "obs_width", "obs_target_s", "obs_draft_s", "obs_drafted", "obs_emitted",
           "obs_modelled")
_IX = {name: i for i, name in enumerate(_FIELDS)}

Gather = Callable[[list[float], float], list[list[float]]]  # (row, timeout_s) -> every rank's row


class CollectiveError(RuntimeError):
    """The step exchange failed or timed out: a peer rank died or stopped answering."""


@dataclass(frozen=True)
class Tick:
    """What every rank learns from one exchange (identical on every rank)."""

    index: int
    view: GlobalStepView
    num_unfinished: int  # on all ranks, before this step
    stopping: bool
    join_epoch: int  # the group every member is ready to move to after this step (0: none)
    longest_step_s: float  # longest step any rank has reported so far
    rows: tuple[tuple[float, ...], ...]


class SharedAcceptance(AcceptanceHistory):
    """The engine-wide acceptance prior, identical on every rank.

    An ``AcceptanceHistory`` (its ``rate`` and ``expected_accepted``) whose ``update`` (called
    per request by the policy's ``observe``) only counts this rank's observations; the rates
    move in ``apply``, with every rank's counts summed. Position i is observed when every
    earlier draft was accepted; n observations in one step move the EMA as n single updates
    with rate ``alpha`` would.
    """

    def __init__(self, max_k: int, alpha: float = 0.05, prior: float | None = None,
                 prior_weight: float | None = None) -> None:
        super().__init__(alpha, prior, prior_weight)
        self.max_k = max_k
        self.reached = [0] * max_k
        self.hits = [0] * max_k

    def update(self, num_drafted: int, num_accepted: int) -> None:
        for i in range(min(num_accepted + 1, num_drafted, self.max_k)):
            self.reached[i] += 1
            self.hits[i] += i < num_accepted

    def take_pending(self) -> list[float]:
        row = [float(n) for n in self.reached + self.hits]
        self.reached, self.hits = [0] * self.max_k, [0] * self.max_k
        return row

    def apply(self, reached: list[float], hits: list[float]) -> None:
        if not any(reached):
            return
        for i, (n, h) in enumerate(zip(reached, hits)):
            if n <= 0:
                break  # position i unobserved implies every later position is too
            rate = h / n
            if i == len(self.rates):  # the first observation seeds the EMA, or moves the prior
                self.rates.append(rate if self.prior is None else self._prior_at(i))
                self.counts.append(0)
                if self.prior is None:
                    self.counts[i] = int(n)
                    continue
            # n single updates at once: the EMA's weight, or the running mean's where larger
            w = 1.0 - (1.0 - self.alpha) ** n
            if self.prior_weight is not None:
                w = max(w, n / (self.counts[i] + n + self.prior_weight))
            self.counts[i] += int(n)
            self.rates[i] += w * (rate - self.rates[i])
        self.num_updates += 1



class StepAgreement:
    """One exchange per engine step; the rank loop sets the control fields before each step."""

    def __init__(self, gather: Gather, rank: int, world_size: int, max_k: int,
                 grace_s: float, idle_poll_s: float, log_size: int = 100_000) -> None:
        self.gather, self.rank, self.world_size, self.max_k = gather, rank, world_size, max_k
        self.grace_s, self.idle_poll_s = grace_s, idle_poll_s
        self.shared: SharedAcceptance | None = None  # set by LockstepPolicy for goodput
        self.num_ticks = 0
        self.exchanged = False  # the tick of this engine step happened (reset by the rank loop)
        self.last: Tick | None = None
        self.longest_step_s = 0.0
        # Set by the rank loop before a step:
        self.num_unfinished = 0
        self.stopping = False
        self.join_epoch = 0
        self.step_seconds = 0.0
        self.ran_step = False  # a real step ran since the previous exchange
        self.pending_obs: tuple[float, ...] | None = (
            None  # (num_reqs, ctx, width, tgt, draft, drafted, emitted, modelled or -1)
        )
        # (tick, K agreed, global requests, ctx statistic, this rank's requests), for tests/metrics.
        self.decisions: deque[tuple[int, int, int, int, int]] = deque(maxlen=log_size)

    def timeout_s(self) -> float:
        """A peer may be busy with its own step (or idling on its command pipe) meanwhile."""
        return self.grace_s + self.idle_poll_s + 2.0 * self.longest_step_s

    def exchange(self, num_reqs: int, decoding_ctxs: list[int]) -> Tick:
        if self.exchanged:
            raise RuntimeError("two step exchanges in one engine step: ranks would fall out of "
                               "lockstep (one exchange, before schedule(), per step)")
        obs = self.pending_obs
        row = [0.0] * len(_FIELDS)
        row[_IX["num_reqs"]] = num_reqs
        row[_IX["num_decoding"]] = len(decoding_ctxs)
        row[_IX["sum_ctx"]] = sum(decoding_ctxs)
        row[_IX["max_ctx"]] = max(decoding_ctxs, default=0)
        row[_IX["num_unfinished"]] = self.num_unfinished
        row[_IX["stopping"]] = float(self.stopping)
        row[_IX["join_epoch"]] = float(self.join_epoch)
        row[_IX["step_seconds"]] = self.step_seconds
        row[_IX["obs_ran"]] = float(self.ran_step)
        if obs is not None:
            row[_IX["obs_valid"]] = 1.0
            row[_IX["obs_num_reqs"]:_IX["obs_modelled"] + 1] = list(obs)
        acc = self.shared.take_pending() if self.shared is not None else [0.0] * (2 * self.max_k)
        rows = self.gather(row + acc, self.timeout_s())
        self.pending_obs, self.ran_step, self.exchanged = None, False, True
        tick = self._tick(rows)
        self.last = tick
        self.num_ticks += 1
        return tick

    def _tick(self, rows: list[list[float]]) -> Tick:
        def total(name: str) -> int:
            return int(sum(r[_IX[name]] for r in rows))

        view = _global_view(rows)
        self.longest_step_s = max(self.longest_step_s, *(r[_IX["step_seconds"]] for r in rows))
        return Tick(self.num_ticks, view, total("num_unfinished"),
                    any(r[_IX["stopping"]] for r in rows),
                    int(min(r[_IX["join_epoch"]] for r in rows)), self.longest_step_s,
                    tuple(tuple(r) for r in rows))

    def shared_step_observation(self, tick: Tick) -> tuple | None:
        """The previous lockstep step as the cost model should see it, when every rank that
        ran a step ran a pure decode step (else the step's shape is not what the model prices):
        the busiest rank's requests, the request-weighted mean context, the widest verify, the
        slowest rank's target time (the lockstep pace), draft time / drafted / emitted summed,
        and the goodput the step's decision modelled (one decision on every rank: the largest
        reported, None where no rank had one)."""
        ran = [r for r in tick.rows if r[_IX["obs_ran"]]]
        if not ran or not all(r[_IX["obs_valid"]] for r in ran):
            return None
        reqs = [r[_IX["obs_num_reqs"]] for r in ran]
        ctx = math.ceil(sum(r[_IX["obs_ctx"]] * n for r, n in zip(ran, reqs)) / max(1.0, sum(reqs)))
        return (
            int(max(reqs)),
            max(1, ctx),
            int(max(r[_IX["obs_width"]] for r in ran)),
            max(r[_IX["obs_target_s"]] for r in ran),
            sum(r[_IX["obs_draft_s"]] for r in ran),
            int(sum(r[_IX["obs_drafted"]] for r in ran)),
            int(sum(r[_IX["obs_emitted"]] for r in ran)),
            _modelled(max(r[_IX["obs_modelled"]] for r in ran)),
        )

    def shared_acceptance(self, tick: Tick) -> tuple[list[float], list[float]]:
        base, k = len(_FIELDS), self.max_k
        reached = [sum(r[base + i] for r in tick.rows) for i in range(k)]
        hits = [sum(r[base + k + i] for r in tick.rows) for i in range(k)]
        return reached, hits


def _modelled(value: float) -> float | None:
    return value if value >= 0 else None


def _global_view(rows: list[list[float]]) -> GlobalStepView:
    """Sums over the ranks' tick rows."""
    def total(name: str) -> int:
        return int(sum(r[_IX[name]] for r in rows))

    return GlobalStepView(total("num_reqs"), total("num_decoding"), total("sum_ctx"),
                          int(max(r[_IX["max_ctx"]] for r in rows)),
                          int(max(r[_IX["num_reqs"]] for r in rows)))


class LockstepPolicy:
    """Wraps a KPolicy under data parallelism (module docstring): its step K comes from the
    global view agreed before ``schedule``, and the shared state it reads (cost model, engine-wide
    acceptance) moves only with what every rank gathered (``apply_tick``)."""

    def __init__(self, inner, agreement: StepAgreement) -> None:
        self.agreement = agreement
        self.set_inner(inner)

    def set_inner(self, inner) -> None:
        """Wrap `inner` (also when a rank switches to rank 0's policy at start-up)."""
        self.inner = inner
        self.keeps_history = getattr(inner, "keeps_history", False)
        if hasattr(inner, "engine_history"):  # goodput: the engine-wide prior must be shared
            inner.engine_history = self.agreement.shared = SharedAcceptance(
                self.agreement.max_k, prior=inner.settings.prior_rate,
                prior_weight=inner.settings.engine_prior_weight)

    @property
    def plan(self):
        return self.inner.plan

    @property
    def histories(self) -> dict:
        return self.inner.histories

    @property
    def num_reprobes(self) -> int:
        return self.inner.num_reprobes

    def apply_tick(self, tick: Tick) -> None:
        """The previous step's observations, gathered from every rank, applied on every rank."""
        a = self.agreement
        obs = a.shared_step_observation(tick)
        if obs is not None:
            self.inner.observe_step(*obs[:7], modelled_goodput=obs[7])
        if a.shared is not None:
            a.shared.apply(*a.shared_acceptance(tick))

    def decide(self, view: StepView) -> StepK:
        if view.global_view is None:
            raise RuntimeError("data parallel: schedule() needs the step view agreed before it "
                               "(StepAgreement.exchange), or ranks would choose different K")
        return self.inner.decide(view)

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
        self.agreement.pending_obs = (num_reqs, ctx, width, target_seconds, draft_seconds,
                                      num_drafted, num_emitted,
                                      -1.0 if modelled_goodput is None else modelled_goodput)

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)

    def goodput_report(self) -> tuple[float | None, float | None]:
        report = getattr(self.inner, "goodput_report", None)
        return report() if report is not None else (None, None)


def share_cost_model(policy, rank: int,
                     broadcast: Callable[[object], object] | None = None) -> None:
    """Start every rank from rank 0's step cost table (each rank profiled or loaded its own).
    ``broadcast(obj)`` returns rank 0's ``obj`` (the group's, dp/group.py; by default
    torch.distributed's default group)."""
    inner = getattr(policy, "inner", policy)
    cost = getattr(inner, "cost_model", None)
    # Every rank takes part, with or without a table: a rank whose measured table was refused
    # runs the plan's table instead (spec_decode/cost_profile), and must not leave the others
    # waiting in this broadcast.
    payload = [cost.to_json() if rank == 0 and cost is not None else None]
    if broadcast is None:
        import torch.distributed as dist

        dist.broadcast_object_list(payload, src=0)
    else:
        payload[0] = broadcast(payload[0])
    table = payload[0]
    if (table is None) != (cost is None):
        follow_rank0(policy, inner, table)
        return
    if cost is None:
        return
    assert table is not None  # both or neither (checked above)
    if tuple(table["batches"]) != cost.grid.batches or tuple(table["widths"]) != cost.grid.widths \
            or tuple(table["contexts"]) != cost.grid.contexts:
        raise RuntimeError("rank 0's step cost grid differs from this rank's: the ranks were "
                           "started with different settings")
    cost.seconds = [[list(c) for c in r] for r in table["seconds"]]
    cost.source = f"rank 0 ({table.get('source', 'measured')})"


def follow_rank0(policy, inner, table: dict | None) -> None:
    """One rank's start-up table checks disagreed with rank 0's (spec_decode/cost_profile refuses
    a table that fails them, and the policy falls back to the plan's table): every rank runs
    what rank 0 runs, so the step K stays one decision."""
    import logging

    from dynaspec.spec_decode.policy.cost_model import StepCostModel
    from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy
    from dynaspec.spec_decode.policy.k_policy import TablePolicy

    plan = inner.plan
    if table is None:  # rank 0 refused its table: the plan's table everywhere
        new = TablePolicy(plan)
    else:  # this rank refused its own: rank 0's table, at the widths this rank's plan runs
        new = GoodputPolicy(plan, StepCostModel.from_json(table),
                            allowed_widths=tuple(sorted({1, *plan.widths})))
    logging.getLogger("dynaspec").warning(
        "K policy: following rank 0 (%s) for one K decision per step",
        "table: its step cost table was refused" if table is None else "goodput, its cost table")
    policy.set_inner(new)  # re-wires the shared acceptance for goodput
