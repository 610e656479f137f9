"""Lockstep K agreement across data-parallel ranks (docs/design.md §7).

Every engine step each rank forms its batch, then all ranks exchange one small row of numbers
(``all_gather`` of float64, so every rank holds the same rows and computes the same sums bit for
bit) and each rank applies the same pure K decision to the summed view. What a rank sends is
one ``RankState`` (dp/rank_state.py, which also holds the row layout):

- the step view: requests in the step, decoding requests, sum and max of their contexts;
- lockstep control: requests unfinished on the rank (all zero = every rank idles), a stop flag
  (the ranks leave together, on the same tick, so no collective is left waiting), the group
  the rank was told to move to (all members move after the tick where every row names it: a
  replacement joins at one step boundary, dp/group.py), the rank's last step time (the timeout
  grows with the longest step any rank has run);
- the previous step's observations for the K policy's shared state: its shape and time (the
  goodput cost model and draft cost) and per-position acceptance counts (the engine-wide prior).
  Each rank applies the *gathered* observations, the same ones in the same order, so the state
  a decision reads (one value, ``LockstepPolicy.state``, dp/lockstep_policy.py) is identical
  on every rank and the K stays a pure function of the global view plus that state. The
  policy's per-request histories stay local: they only lower that request's own cap, never
  the step's K.

The exchange is explicit: the rank loop (dp/rank.py) calls ``exchange`` with its RankState,
built from the scheduler's step view (``Scheduler.step_view``: the batch it expects) and its
policy's report of the last step, *before* ``schedule``, applies the
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

from dynaspec.dp.rank_state import RankState, StepObservation
from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory
from dynaspec.spec_decode.policy.k_policy import GlobalStepView

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
    ranks: tuple[RankState, ...]

    def step_observation(self) -> StepObservation | None:
        """The previous lockstep step as the cost model should see it, when every rank that
        ran a step ran a pure decode step (else the step's shape is not what the model prices):
        the busiest rank's requests, the request-weighted mean context, the widest verify, the
        slowest rank's target time (the lockstep pace), draft time / drafted / emitted summed,
        and the goodput the step's decision modelled (one decision on every rank: the largest
        reported, None where no rank had one)."""
        ran = [r for r in self.ranks if r.ran_step]
        obs = [r.observation for r in ran]
        if not ran or any(o is None for o in obs):
            return None
        seen = [o for o in obs if o is not None]
        reqs = [o.num_reqs for o in seen]
        ctx = math.ceil(sum(o.ctx * n for o, n in zip(seen, reqs)) / max(1, sum(reqs)))
        modelled = [o.modelled_goodput for o in seen if o.modelled_goodput is not None]
        return StepObservation(
            max(reqs), max(1, ctx), max(o.width for o in seen),
            max(o.target_seconds for o in seen), sum(o.draft_seconds for o in seen),
            sum(o.num_drafted for o in seen), sum(o.num_emitted for o in seen),
            max(modelled, default=None))

    def acceptance(self, max_k: int) -> tuple[list[float], list[float]]:
        """Per-position (reached, hits) summed over every rank."""
        reached = [sum(r.acceptance[i] for r in self.ranks) for i in range(max_k)]
        hits = [sum(r.acceptance[max_k + i] for r in self.ranks) for i in range(max_k)]
        return reached, hits


@dataclass(frozen=True)
class AgreedK:
    """One step's agreed K, in a rank's decision log (tests, metrics)."""

    tick: int
    k: int
    num_reqs: int  # in the step on every rank
    ctx_stat: int
    rank_reqs: int  # this rank's (expected) requests


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
    """One exchange per engine step: a rank's ``RankState`` out, the ``Tick`` every rank
    computes alike back."""

    def __init__(self, gather: Gather, rank: int, world_size: int, max_k: int,
                 grace_s: float, idle_poll_s: float, log_size: int = 100_000) -> None:
        self.gather, self.rank, self.world_size, self.max_k = gather, rank, world_size, max_k
        self.grace_s, self.idle_poll_s = grace_s, idle_poll_s
        self.num_ticks = 0
        self.exchanged = False  # the tick of this engine step happened (begin_step resets it)
        self.last: Tick | None = None
        self.longest_step_s = 0.0
        self.decisions: deque[AgreedK] = deque(maxlen=log_size)

    def timeout_s(self) -> float:
        """A peer may be busy with its own step (or idling on its command pipe) meanwhile."""
        return self.grace_s + self.idle_poll_s + 2.0 * self.longest_step_s

    def begin_step(self) -> None:
        self.exchanged = False

    def exchange(self, state: RankState) -> Tick:
        if self.exchanged:
            raise RuntimeError("two step exchanges in one engine step: ranks would fall out of "
                               "lockstep (one exchange, before schedule(), per step)")
        rows = self.gather(state.row(self.max_k), self.timeout_s())
        self.exchanged = True
        tick = self._tick(tuple(RankState.of_row(r) for r in rows))
        self.last = tick
        self.num_ticks += 1
        return tick

    def _tick(self, ranks: tuple[RankState, ...]) -> Tick:
        self.longest_step_s = max(self.longest_step_s, *(r.step_seconds for r in ranks))
        view = GlobalStepView(sum(r.num_reqs for r in ranks), sum(r.num_decoding for r in ranks),
                              sum(r.sum_ctx for r in ranks), max(r.max_ctx for r in ranks),
                              max(r.num_reqs for r in ranks))
        return Tick(self.num_ticks, view, sum(r.num_unfinished for r in ranks),
                    any(r.stopping for r in ranks), min(r.join_epoch for r in ranks),
                    self.longest_step_s, ranks)
