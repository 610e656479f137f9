"""The default K policy when a drafter is configured: maximise expected goodput per step.

For the batch being formed it picks the step's K (and each request's K under it) that maximises
expected tokens emitted per second of step time,

    goodput(k) = sum_r (1 + E_r[accepted | k_r]) / (cost(num_reqs, ctx, 1 + max_r k_r) + draft(k)),

with K = 0 always a candidate, so where speculation does not pay on this machine, at this batch
size and context, the step runs the plain decode path (no drafter call, no verify width). The
inputs are the step view, the step cost model measured on this machine (``cost_model.py``),
the per-request acceptance histories the policy owns, and an engine-wide acceptance history that
is the prior for requests that have none yet. ``decide`` is pure: it reads that state and
changes nothing; ``observe*`` calls, made after a step's result, are the only writers.

Requests that stop paying (their own acceptance makes drafting a loss at this batch's costs)
get 0 drafts, and are re-probed with one draft once ``probe_interval`` tokens have passed since
they last verified a draft, so a recovery is seen. A probe is only worth it where drafting could
pay at all: if even the probe's rates would lose at these costs, no request probes and the step
stays at K = 0. A new request probes on its first decode step. The probe's rates are
``probe_rate`` until the engine has seen ``probe_evidence`` drafting steps, then the engine's own
rates plus ``probe_headroom`` (at most ``probe_rate``): an EAGLE head accepted at ~0.3 at c16
probed every new request at the optimistic rate, and each probe fed the request's whole prompt
to the head (1.1 s of a 17.9 s run, docs/benchmarks.md, eleventh session) for drafts the policy
then cut.

Divergence guard: when the decisions' modelled goodput and the goodput the same steps gave
stay apart by more than ``divergence_bound`` (a factor) for ``divergence_steps`` decode steps
while the policy keeps choosing K = 0, the cells it would need to change its mind (the wider
widths) are the ones no served step refreshes. The guard then re-probes: the next decode step
runs the smallest K > 0, at most once per ``reprobe_interval`` decode steps, so the measured
wide step corrects its cell (and the log says so). An injected (fixed) table has no guard: it
cannot learn, and its decisions must not depend on this machine's timing.

Synthetic rejection mode (``--rejection-mode synthetic``) accepts drafts at known per-position
rates; the policy then prices every request at those rates (``synthetic_rates``), so it drafts
wherever the costs say that acceptance pays, which is what the mode is for.

The plan's table stays the ceiling (``--num-spec-tokens`` is the maximum, a ``--k-schedule``
still bounds each bucket); ``allowed_widths`` restricts the choice to widths the execution plan
can run (None: any width up to the ceiling).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from dynaspec.spec_decode.acceptance import (
    FULL_LENGTHS,
    AcceptanceHistory,
    DraftLengths,
    expected_accepted,
)
from dynaspec.spec_decode.cost_model import StepCostModel
from dynaspec.spec_decode.fallback_pricing import FallbackPricer
from dynaspec.spec_decode.k_policy import (
    RequestView,
    StepK,
    StepView,
    TablePolicy,
    drafter_gate,
    hard_cap,
)
from dynaspec.spec_decode.plan import SpecPlan
from dynaspec.spec_decode.step_pricing import (
    PricedRow,
    StepPricing,
    one_row_seconds,
    one_row_seconds_by_cap,
    price_row,
)
from dynaspec.spec_decode.step_width import runnable_k

log = logging.getLogger("dynaspec")


@dataclass(frozen=True)
class GoodputSettings:
    prior_rate: float = 0.6  # per-position acceptance assumed before anything is observed
    probe_rate: float = 0.8  # acceptance at which a probe is judged worth its cost
    # Once the engine has this much evidence, probes are priced at its rates + the headroom
    # (a request may do better than the engine's mean; lookups vary far more than that).
    probe_evidence: int = 32  # the rate's standard error is then <= 0.09, well inside the headroom
    probe_headroom: float = 0.25
    probe_interval: int = 16  # tokens without a verified draft before a request is re-probed
    # The drafter's seconds per drafted token: the median of its last `draft_cost_window`
    # drafting steps, taken as 0 until `draft_cost_min_samples` exist. An EMA seeded by the first
    # draft kept its cold outlier for good: an EAGLE head's first draft also feeds it the whole
    # prompt (4.8 ms a token against ~0.9 steady), after which K stayed 0 and no later draft
    # could correct it.
    draft_cost_window: int = 15
    draft_cost_min_samples: int = 3
    # Synthetic rejection mode's per-position acceptance (the last repeats); () = strict mode.
    synthetic_rates: tuple[float, ...] = ()
    divergence_bound: float = 2.0  # modelled vs observed goodput factor the guard tolerates
    divergence_steps: int = 32  # ... for this many decode steps in a row before it re-probes
    reprobe_interval: int = 64  # decode steps between two guard re-probes, at least
    # A step verifies only the drafts its requests produced (the eager path), so a cap the
    # drafter does not fill costs less than its full width. False where a fixed-shape path pads
    # every row to the planned width.
    widths_follow_drafts: bool = True
    # The drafter sizes its own drafts (Proposer.sizes_own_drafts): K is 0 or the ceiling.
    # Measured on agentic suffix drafts at c1: cutting caps to the K the rates favoured ran
    # 0.81x [0.68, 0.97] of always drafting up to 8, because the long drafts are the sure ones.
    whole_cap: bool = False
    # The engine-wide prior counts as this many observations (AcceptanceHistory.prior_weight).
    engine_prior_weight: float = 2.0
    # A request's own rates: a running mean from the prior (worth request_prior_weight
    # observations) that turns into an EMA at request_alpha. A fixed EMA at 0.3 swung with each
    # draft, and the policy's choices followed the swings: on c1 code edits it ran 0.918x and
    # 0.924x of always drafting 4 (docs/benchmarks.md, sixth session).
    request_alpha: float = 0.1
    request_prior_weight: float = 2.0
    # The drafter has a fallback (Proposer.has_fallback: lookup first, a head second): its
    # acceptance, cost and cap are priced apart (fallback_pricing.py).
    prices_fallback: bool = False

    def __post_init__(self) -> None:
        for name in ("prior_rate", "probe_rate", "probe_headroom"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if any(not 0.0 <= r <= 1.0 for r in self.synthetic_rates):
            raise ValueError(f"synthetic_rates must be in [0, 1], got {self.synthetic_rates}")
        if not 1 <= self.draft_cost_min_samples <= self.draft_cost_window:
            raise ValueError("need 1 <= draft_cost_min_samples <= draft_cost_window, got "
                             f"{self.draft_cost_min_samples} and {self.draft_cost_window}")
        if self.probe_interval < 1 or self.probe_evidence < 0:
            raise ValueError("need probe_interval >= 1 and probe_evidence >= 0, got "
                             f"{self.probe_interval} and {self.probe_evidence}")
        if (
            not self.divergence_bound > 1.0
            or self.divergence_steps < 1
            or self.reprobe_interval < 1
        ):
            raise ValueError(
                "need divergence_bound > 1, divergence_steps >= 1, reprobe_interval >= 1"
            )

    def probe_rates(self, engine: AcceptanceHistory) -> Callable[[int], float]:
        """rate(position) a probe is priced at: ``probe_rate`` until ``engine`` has
        ``probe_evidence`` updates, then the engine's own rates plus ``probe_headroom``, never
        above ``probe_rate``. A request may do better than the engine's mean, so a probe keeps
        some optimism; none at all where the engine has shown the drafter far below it."""
        if engine.num_updates < self.probe_evidence:
            return lambda _i: self.probe_rate
        return lambda i: min(self.probe_rate, engine.rate(i) + self.probe_headroom)


def _ema(old: float | None, new: float, alpha: float = 0.1) -> float:
    return new if old is None else old + alpha * (new - old)


class _FixedRates:
    """A history-shaped set of fixed per-position conditional rates, the last repeating (the
    prior before anything is observed; synthetic mode's simulated acceptance)."""

    def __init__(self, *rates: float) -> None:
        self._rates = rates

    def rate(self, position: int) -> float:
        return self._rates[min(position, len(self._rates) - 1)]

    def expected_accepted(self, k: int) -> float:
        return expected_accepted(self.rate, k)


class _Deeper:
    """Rates observed at the first positions, another estimate's below them."""

    def __init__(self, rates: list[float], below) -> None:
        self._rates, self._below = rates, below

    def rate(self, position: int) -> float:
        return self._rates[position] if position < len(self._rates) else self._below.rate(position)


class GoodputPolicy(TablePolicy):
    keeps_history = True

    def __init__(self, plan: SpecPlan, cost_model: StepCostModel,
                 settings: GoodputSettings = GoodputSettings(),
                 allowed_widths: tuple[int, ...] | None = None) -> None:
        super().__init__(plan)
        self.cost_model, self.settings = cost_model, settings
        self.allowed_widths = None if allowed_widths is None else frozenset(allowed_widths)
        self._runnable_memo: dict[int, int] = {}
        # Slow: a prior, not a tracker. It starts at the prior, worth two observations: seeded
        # by its first observation, one early rejection at a deep position priced that position
        # at ~0 for every request for hundreds of steps (agentic suffix drafts); with the prior
        # at full weight, deep positions stayed near it for a whole run (n-gram code edits).
        self.engine_history = AcceptanceHistory(alpha=0.05, prior=settings.prior_rate,
                                                prior_weight=settings.engine_prior_weight)
        # How far drafts go under their caps, per request and engine-wide (acceptance.py).
        self.lengths: dict[str, DraftLengths] = {}
        self.engine_lengths = DraftLengths(alpha=0.05)
        self.last_draft_ctx: dict[str, int] = {}
        self.draft_seconds_per_token = cost_model.draft_seconds_per_token or 0.0
        self.draft_costs: deque[float] = deque(maxlen=settings.draft_cost_window)
        self._version = 0  # bumped by every observe*/forget: decide() reads nothing else
        self._memo: tuple | None = None  # (version and view, decision) of the last decide()
        # Records for metrics, written by decide() and observe_step(), never read by decide().
        self.last_modelled_goodput: float | None = None  # tokens/s the last decision expected
        self.modelled_goodput: float | None = None  # EMAs over decode steps, paired step by step
        self.observed_goodput: float | None = None
        # The divergence guard's state (module docstring); only observe_step writes it.
        self.num_decode_steps = 0
        self.diverged_steps = 0
        self.last_reprobe_step: int | None = None
        self.reprobe_pending = False
        self.num_reprobes = 0
        self.synthetic = (
            _FixedRates(*settings.synthetic_rates) if settings.synthetic_rates else None
        )
        self.fallback = FallbackPricer(settings) if settings.prices_fallback else None

    # ---- writers: called with a step's results --------------------------------------------
    def new_history(self) -> AcceptanceHistory:
        # Start each request at the prior, not at its first draft's outcome: measured on code
        # edits, one early rejection set a request's rate to 0 and the policy ran K=0 on 95% of
        # steps (1.05x over plain) where always drafting gave 1.37x.
        return AcceptanceHistory(alpha=self.settings.request_alpha, prior=self.settings.prior_rate,
                                 prior_weight=self.settings.request_prior_weight)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, ctx: int,
                cap: int = 0, fallback: bool = False) -> None:
        self._version += 1
        if fallback and self.fallback is not None:
            self.fallback.observe(request_id, num_drafted, num_accepted, ctx)
            return
        super().observe(request_id, num_drafted, num_accepted, ctx, cap)
        if num_drafted:
            self.engine_history.update(num_drafted, num_accepted)
            self.last_draft_ctx[request_id] = ctx
        if cap > 0 and num_drafted <= cap:
            self.lengths.setdefault(request_id, DraftLengths()).update(cap, num_drafted)
            self.engine_lengths.update(cap, num_drafted)

    def forget(self, request_id: str) -> None:
        self._version += 1
        super().forget(request_id)
        self.last_draft_ctx.pop(request_id, None)
        self.lengths.pop(request_id, None)
        if self.fallback is not None:
            self.fallback.forget(request_id)

    def num_cached(self) -> int:
        own = len(self.histories.keys() | self.last_draft_ctx.keys() | self.lengths.keys())
        return own + (self.fallback.num_cached() if self.fallback is not None else 0)

    def observe_step(self, num_reqs: int, ctx: int, width: int, target_seconds: float,
                     draft_seconds: float, num_drafted: int, num_emitted: int,
                     fallback_seconds: float = 0.0, fallback_drafted: int = 0) -> None:
        self._version += 1
        if self.fallback is not None:  # the lookup's cost per drafted token without the head's
            self.fallback.observe_cost(fallback_seconds, fallback_drafted)
            draft_seconds -= fallback_seconds
            num_drafted -= fallback_drafted
        self.cost_model.observe(num_reqs, ctx, width, target_seconds)
        seconds = target_seconds + draft_seconds
        if self.last_modelled_goodput is not None and seconds > 0:
            self.modelled_goodput = _ema(self.modelled_goodput, self.last_modelled_goodput)
            self.observed_goodput = _ema(self.observed_goodput, num_emitted / seconds)
            self._guard(width)
        if num_drafted and self.cost_model.draft_seconds_per_token is None:
            self.draft_costs.append(draft_seconds / num_drafted)
            if len(self.draft_costs) >= self.settings.draft_cost_min_samples:
                self.draft_seconds_per_token = statistics.median(self.draft_costs)

    def goodput_report(self) -> tuple[float | None, float | None]:
        return self.modelled_goodput, self.observed_goodput

    def _guard(self, width: int) -> None:
        """The divergence guard's bookkeeping after a decode step (module docstring)."""
        self.num_decode_steps += 1
        if width > 1:
            self.reprobe_pending = False  # a wide step ran: its cell was just refreshed
            self.diverged_steps = 0
            return
        if not self.cost_model.learn:
            return
        m, o = self.modelled_goodput, self.observed_goodput
        apart = m and o and max(m / o, o / m) > self.settings.divergence_bound
        self.diverged_steps = self.diverged_steps + 1 if apart else 0
        last = self.last_reprobe_step
        due = last is None or self.num_decode_steps - last >= self.settings.reprobe_interval
        if (
            self.diverged_steps >= self.settings.divergence_steps
            and due
            and not self.reprobe_pending
        ):
            self.reprobe_pending, self.last_reprobe_step = True, self.num_decode_steps
            self.num_reprobes += 1
            log.info("goodput policy: modelled %.1f vs observed %.1f tokens/s for %d decode steps "
                     "at K=0: re-probing a K>0 step to refresh the wider cells", m, o,
                     self.diverged_steps)

    # ---- the pure decision -------------------------------------------------------------------
    def decide(self, view: StepView) -> StepK:
        # The reservation and the formed batch usually present the same view within a step, and
        # nothing was observed in between: price it once (~130 us a decision at batch 1, 2-4% of
        # a c1 step). Not under DP, where the shared state is also written from outside.
        key = (self._version, replace(view, planned=False))
        if view.global_view is None and self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        d = self._decide(view)
        self._memo = (key, d)
        return d

    def _decide(self, view: StepView) -> StepK:
        ctx, g = view.ctx_stat, view.global_view
        ceiling = self.plan.k_for(view.batch_size, ctx)
        caps = {r.request_id: drafter_gate(*hard_cap(ceiling, r), r) for r in view.requests}
        if ceiling == 0 or not (view.requests if g is None else g.num_decoding):
            self.last_modelled_goodput = None
            return self._step_k(0, ctx, caps, {}, g is not None)
        # Under DP the lockstep step runs at the busiest rank's pace, so its size prices a width.
        num_reqs = view.num_reqs if g is None else g.max_rank_reqs
        cost = self.cost_model.widths_priced(num_reqs, ctx)
        fixed: dict[str, int] = {}  # requests whose K does not follow the step's (0 or a probe)
        rows = []  # each request priced once, for its own check and the step's
        probe_pays = None  # the same for every request: priced once, when first needed
        for r in view.requests:
            rid, cap = r.request_id, caps[r.request_id][0]
            row = self._row(r, cap)
            if cap > 0 and not self._pays(row, cost):
                stale = self._stale(r)
                if stale and probe_pays is None:
                    probe_pays = self._pays(self._probe_row(ceiling), cost)
                fixed[rid] = 1 if stale and probe_pays else 0
                row = replace(row, follows=False, limit=min(fixed[rid], cap))
            rows.append(row)
        pricing = None if g is not None else self._pricing(rows, cost)
        best_k, best = 0, -1.0
        for k in self._candidates(ceiling):
            value = (self._shared_goodput(num_reqs, k, cost) if pricing is None
                     else self._goodput(pricing, k))
            if value > best * (1 + 1e-9):
                best_k, best = k, value
        if best_k == 0 and self.reprobe_pending:
            # the guard's re-probe: one narrow K>0 step
            best_k, fixed = runnable_k(1, self.allowed_widths), {}
        self.last_modelled_goodput = best
        fallback = {} if self.fallback is None or g is not None else {
            r.request_id: self.fallback.cap(r, caps[r.request_id][0], cost)
            for r in view.requests}
        return self._step_k(best_k, ctx, caps, fixed, g is not None, fallback)

    def _shared_goodput(self, num_reqs: int, k: int, cost) -> float:
        """Data parallel: the step's K from state every rank holds identically (the global view,
        the shared cost table, draft cost and engine-wide acceptance, kept equal by dynaspec/dp),
        never from this rank's own requests, so every rank picks the same K."""
        rates = self.synthetic or (self.engine_history if self.engine_history.num_updates
                                   else _FixedRates(self.settings.prior_rate))
        tokens = num_reqs * (1.0 + rates.expected_accepted(k))
        return tokens / (cost(1 + k) + self.draft_seconds_per_token * k * num_reqs)

    def _rates(self, r: RequestView):
        """The request's own conditional rates where it has observed them, the engine's deeper
        down: a request whose caps stayed low has seen only its first positions, and repeating
        its deepest rate would price positions that other requests reach (suffix drafts that
        get that far are usually right) from one that says nothing about them."""
        if self.synthetic is not None:
            return self.synthetic
        prior = (self.engine_history if self.engine_history.num_updates
                 else _FixedRates(self.settings.prior_rate))
        h = self.history(r)
        if h is not None and h.num_updates:
            return _Deeper(h.rates, prior)
        return prior

    def _lengths(self, r: RequestView) -> DraftLengths:
        own = self.lengths.get(r.request_id)
        if own is not None and own.num_updates:
            return own.deeper(self.engine_lengths)
        return self.engine_lengths if self.engine_lengths.num_updates else FULL_LENGTHS

    def _row(self, r: RequestView, limit: int, rates=None,
             lengths: DraftLengths | None = None) -> PricedRow:
        rates, lengths = rates or self._rates(r), lengths or self._lengths(r)
        return price_row(rates.rate, lengths.survival(limit), limit, True)

    def _pricing(self, rows: list[PricedRow], cost) -> StepPricing:
        return StepPricing(rows, cost, self._runnable, self.settings.widths_follow_drafts)

    def _candidates(self, ceiling: int) -> list[int]:
        if self.settings.whole_cap:
            return [0, ceiling]
        return [k for k in range(ceiling + 1)
                if k == 0 or self.allowed_widths is None or 1 + k in self.allowed_widths]

    def _runnable(self, k: int) -> int:
        if self.allowed_widths is None:
            return k
        got = self._runnable_memo.get(k)
        if got is None:  # a scan of the allowed widths, asked thousands of times a decision
            got = self._runnable_memo[k] = runnable_k(k, self.allowed_widths)
        return got

    def _pays(self, row: PricedRow, cost) -> bool:
        """Would any k <= the row's cap beat plain decode if every request drafted like it?"""
        plain = 1.0 / cost(1)
        follow = self.settings.widths_follow_drafts
        # the same margin decide() needs to prefer a K over plain, so a row that ties is cut
        # (and re-probed) rather than left following a step that runs K=0 anyway
        if self.settings.whole_cap:
            k = row.limit
            return (1.0 + row.accepted[k]) / one_row_seconds(row, k, cost, self._runnable,
                                                             follow) > plain * (1 + 1e-9)
        secs = one_row_seconds_by_cap(row, cost, self._runnable, follow)
        return any((1.0 + row.accepted[k]) / secs[k] > plain * (1 + 1e-9)
                   for k in range(1, row.limit + 1))

    def _stale(self, r: RequestView) -> bool:
        last = self.last_draft_ctx.get(r.request_id)
        return last is None or r.context_len - last >= self.settings.probe_interval

    def _probe_row(self, ceiling: int) -> PricedRow:
        rates = self.settings.probe_rates(self.engine_history)
        return price_row(rates, FULL_LENGTHS.survival(ceiling), ceiling, True)

    def _per_request(self, caps: dict, fixed: dict[str, int], k: int) -> dict[str, int]:
        return {rid: min(fixed.get(rid, k), cap) for rid, (cap, _) in caps.items()}

    def _goodput(self, pricing: StepPricing, k: int) -> float:
        seconds = pricing.seconds(k) + self.draft_seconds_per_token * pricing.drafted(k)
        return pricing.tokens(k) / seconds

    def _step_k(self, k: int, ctx: int, caps: dict, fixed: dict[str, int],
                agreed: bool = False, fallback: dict[str, int] | None = None) -> StepK:
        per = self._per_request(caps, fixed, k)
        if agreed:  # a probe cannot widen the step the ranks agreed on (K=0: no forward width)
            per = {rid: min(n, k) for rid, n in per.items()}
        # A request may verify as many drafts as either drafter is allowed (its fallback's cap
        # is its own, no wider than its hard cap).
        fallback = fallback or {}
        per = {rid: max(n, fallback.get(rid, 0)) for rid, n in per.items()}
        reasons = {}
        for rid, (cap, why) in caps.items():
            if per[rid] < cap:
                reasons[rid] = "adaptive"  # the policy, not the table, lowered it
            elif why is not None:
                reasons[rid] = why
        # The step's K: the widest any request verifies, rounded up to a width the plan runs;
        # under DP it is the K every rank agreed on (this rank's requests may all verify less).
        k = k if agreed else runnable_k(max(per.values(), default=0), self.allowed_widths)
        return StepK(k, per, reasons, ctx, fallback)
