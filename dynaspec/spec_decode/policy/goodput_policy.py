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
they last verified a draft, so a recovery is seen (a drafter that sizes its own drafts with its
whole cap: one draft would teach neither its deeper positions nor how far it drafts). A probe is
only worth it where drafting could pay at all: if even the probe's rates would lose at these
costs, no request probes and the step stays at K = 0. A new request probes on its first decode
step. The probe's rates are
``probe_rate`` until the engine has seen ``probe_evidence`` drafting steps, then the engine's own
rates plus ``probe_headroom`` (at most ``probe_rate``): an EAGLE head accepted at ~0.3 at c16
probed every new request at the optimistic rate, and each probe fed the request's whole prompt
to the head (1.1 s of a 17.9 s run, docs/history/benchmarks-waves-1-4.md, eleventh session) for
drafts the policy then cut. Between probes, a cut request of a self-sizing drafter still verifies a
draft that runs as deep as its cap (``strict_probes``; ``StepK.min_depth``, shallower drafts are
dropped as ``short_match``): such a draft comes from a match as long, copied text, whose
acceptance the request's misses on short matches do not predict (agentic suffix drafts: a failed
2-token draft cut a request for 16 tokens, through the start of the passage it then copied at 8
of 8).

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

Token trees (docs/design.md §4c): where the drafter can give a tree under a node budget
(``drafts_trees``), each request is priced twice, as a chain of up to its cap drafts and as a
tree of up to that many nodes (``tree_pricing.py``: per-depth, per-branch acceptance), and
drafts the shape that would pay more alone; the step's K is then its node budget, a tree's
width 1 + nodes, priced from the same cost table. A tree step teaches the request's chain
history what its first path (the chain it holds) would have, and the engine-wide branch rates
what its other children did.

Grammar drafts (docs/design.md §4d): under structured output a request's grammar may force
its first drafts, which cost no drafter call and which the masked target accepts unless the
library spelled a forced text otherwise. They are priced apart (``prices_grammar``): their own
acceptance histories, from ``grammar_prior``, and a cap of their own per structured request
(``fallback_pricing.FallbackPricer`` with no drafting cost), merged into the request's K like a
fallback's; the request's drafter keeps its own cap (``StepK.grammar``), so K widens through
forced spans while free choices stay priced at the drafter's acceptance. Under DP the grammar's
caps never exceed the agreed K.

``decide`` returns its report in the decision (``StepK.modelled_goodput`` and the goodput of
every candidate K), so the policy holds no record of its decisions; the scheduler hands the
modelled value back to ``observe_step`` with the step's timing. One formula
(``step_pricing.goodput``) prices the step on one rank and under data parallelism, where the
rows priced are ones every rank builds alike from shared state.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from dynaspec.draft_tree import TreeWalk
from dynaspec.spec_decode.plan.plan import SpecPlan
from dynaspec.spec_decode.plan.step_width import runnable_k
from dynaspec.spec_decode.policy.acceptance import FULL_LENGTHS, AcceptanceHistory, DraftLengths
from dynaspec.spec_decode.policy.cost_model import StepCostModel
from dynaspec.spec_decode.policy.decision_prices import DecisionPrices
from dynaspec.spec_decode.policy.fallback_pricing import FallbackPricer
from dynaspec.spec_decode.policy.goodput_settings import (  # noqa: F401 - GoodputSettings re-exported
    Deeper,
    FixedRates,
    GoodputSettings,
    ema,
)
from dynaspec.spec_decode.policy.k_policy import (
    RequestView,
    StepK,
    StepView,
    TablePolicy,
    drafter_gate,
    hard_cap,
)
from dynaspec.spec_decode.policy.policy_state import (
    CostTable,
    EngineAcceptance,
    GuardState,
    PolicyState,
)
from dynaspec.spec_decode.policy.step_pricing import (
    PricedRow,
    StepPricing,
    goodput,
    one_row_seconds,
    price_row,
)
from dynaspec.spec_decode.policy.tree_pricing import BranchRates, TreePricer

# cost(width): the seconds of this step at that verify width.
StepCost = Callable[[int], float]

log = logging.getLogger("dynaspec")
_MARGIN = 1 + 1e-9  # a K, a shape or drafting at all must beat the alternative by this factor


class GoodputPolicy(TablePolicy):
    keeps_history = True

    def __init__(self, plan: SpecPlan, cost_model: StepCostModel,
                 settings: GoodputSettings | None = None,
                 allowed_widths: tuple[int, ...] | None = None) -> None:
        super().__init__(plan)
        settings = settings or GoodputSettings()
        self.cost_model, self.settings = cost_model, settings
        self.allowed_widths = None if allowed_widths is None else frozenset(allowed_widths)
        # The K each K runs as, precomputed: a decision asks thousands of times.
        self._runnable_ks = tuple(runnable_k(k, self.allowed_widths)
                                  for k in range(plan.max_k + 1))
        # Slow: a prior, not a tracker. It starts at the prior, worth two observations: seeded
        # by its first observation, one early rejection at a deep position priced that position
        # at ~0 for every request for hundreds of steps (agentic suffix drafts); with the prior
        # at full weight, deep positions stayed near it for a whole run (n-gram code edits).
        self.engine_history = AcceptanceHistory(alpha=0.05, prior=settings.prior_rate,
                                                prior_weight=settings.engine_prior_weight)
        # How far drafts go under their caps, per request and engine-wide (acceptance.py); how
        # far trees fill their node budgets, engine-wide, and how their branches do.
        self.lengths: dict[str, DraftLengths] = {}
        self.engine_lengths = DraftLengths(alpha=0.05)
        self.tree_lengths = DraftLengths(alpha=0.05)
        self.branch_rates = BranchRates(settings.branch_prior, settings.branch_prior_weight)
        self.last_draft_ctx: dict[str, int] = {}
        fixed = cost_model.draft_seconds_per_token  # an injected table's (0.0 included)
        self.draft_seconds_per_token = settings.draft_cost_prior if fixed is None else fixed
        self.draft_costs: deque[float] = deque(maxlen=settings.draft_cost_window)
        # EMAs over decode steps of the goodput the decisions expected and the steps gave,
        # paired step by step (observe_step).
        self.modelled_goodput: float | None = None
        self.observed_goodput: float | None = None
        # The divergence guard's state (module docstring); only observe_step writes it.
        self.num_decode_steps = 0
        self.diverged_steps = 0
        self.last_reprobe_step: int | None = None
        self.reprobe_pending = False
        self.num_reprobes = 0
        self.synthetic = (
            FixedRates(*settings.synthetic_rates) if settings.synthetic_rates else None
        )
        self.fallback = FallbackPricer(settings) if settings.prices_fallback else None
        # Forced drafts (docs/design.md §4d): their own acceptance, near 1, and a free drafter.
        self.grammar = FallbackPricer(replace(settings, prior_rate=settings.grammar_prior)) \
            if settings.prices_grammar else None

    # ---- writers: called with a step's results --------------------------------------------
    def new_history(self) -> AcceptanceHistory:
        # Start each request at a prior, not at its first draft's outcome: measured on code
        # edits, one early rejection set a request's rate to 0 and the policy ran K=0 on 95% of
        # steps (1.05x over plain) where always drafting gave 1.37x. The prior is what the engine
        # has seen per position once it has seen enough: from the fixed 0.6, a request whose
        # first whole-cap draft was all accepted was priced at 0.73 a position (2.5 of 8 drafts)
        # and cut, on agentic suffix drafts the engine accepted at 0.87-0.99 a position.
        engine = self.engine_history
        known = self.synthetic is None and engine.num_updates >= self.settings.probe_evidence
        prior = tuple(engine.rates) if known and engine.rates else self.settings.prior_rate
        return AcceptanceHistory(alpha=self.settings.request_alpha, prior=prior,
                                 prior_weight=self.settings.request_prior_weight)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, ctx: int,
                cap: int = 0, fallback: bool = False, walk: TreeWalk | None = None,
                grammar: bool = False) -> None:
        """`walk`: the drafts were a tree, verified as one (tree_pricing.py); `grammar`: the
        request's grammar forced them."""
        if grammar and self.grammar is not None:
            self.grammar.observe(request_id, num_drafted, num_accepted, ctx)
            return
        if fallback and self.fallback is not None:
            self.fallback.observe(request_id, num_drafted, num_accepted, ctx)
            return
        if walk is not None:
            self.branch_rates.update(walk)
            if 0 < num_drafted <= cap:
                self.tree_lengths.update(cap, num_drafted)
            # the chain history learns what the tree's first path would have given as a chain;
            # how long that path was says nothing of how far a chain draft goes (cap 0)
            num_drafted, num_accepted, cap = walk.first_path, walk.first_path_accepted, 0
        super().observe(request_id, num_drafted, num_accepted, ctx, cap)
        if num_drafted:
            self.engine_history.update(num_drafted, num_accepted)
            self.last_draft_ctx[request_id] = ctx
        if cap > 0 and num_drafted <= cap:
            self.lengths.setdefault(request_id, DraftLengths()).update(cap, num_drafted)
            self.engine_lengths.update(cap, num_drafted)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.last_draft_ctx.pop(request_id, None)
        self.lengths.pop(request_id, None)
        for source in (self.fallback, self.grammar):
            if source is not None:
                source.forget(request_id)

    def num_cached(self) -> int:
        own = len(self.histories.keys() | self.last_draft_ctx.keys() | self.lengths.keys())
        return own + sum(s.num_cached() for s in (self.fallback, self.grammar) if s is not None)

    def observe_step(self, num_reqs: int, ctx: int, width: int, target_seconds: float,
                     draft_seconds: float, num_drafted: int, num_emitted: int,
                     fallback_seconds: float = 0.0, fallback_drafted: int = 0,
                     modelled_goodput: float | None = None) -> None:
        """`modelled_goodput`: what the step's decision expected (StepK.modelled_goodput)."""
        if self.fallback is not None:  # the lookup's cost per drafted token without the head's
            self.fallback.observe_cost(fallback_seconds, fallback_drafted)
            draft_seconds -= fallback_seconds
            num_drafted -= fallback_drafted
        self.cost_model.observe(num_reqs, ctx, width, target_seconds)
        seconds = target_seconds + draft_seconds
        if modelled_goodput is not None and seconds > 0:
            self.modelled_goodput = ema(self.modelled_goodput, modelled_goodput)
            self.observed_goodput = ema(self.observed_goodput, num_emitted / seconds)
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

    # ---- the engine-wide state as a value (policy_state.py) -------------------------------------
    def state(self) -> PolicyState:
        h, cost = self.engine_history, self.cost_model
        return PolicyState(
            CostTable.of(cost), self.draft_seconds_per_token, tuple(self.draft_costs),
            EngineAcceptance(tuple(h.rates), tuple(h.counts), h.num_updates),
            GuardState(self.modelled_goodput, self.observed_goodput, self.num_decode_steps,
                       self.diverged_steps, self.last_reprobe_step, self.reprobe_pending,
                       self.num_reprobes))

    def load(self, state: PolicyState) -> None:
        """Decide from now on as a policy holding `state` would (its per-request state kept)."""
        cost, table = self.cost_model, state.cost
        if table.grid != cost.grid:
            raise RuntimeError(f"a policy state's cost grid {table.grid} differs from this "
                               f"policy's {cost.grid}: the ranks were started with different "
                               "settings")
        cost.seconds = [[list(c) for c in r] for r in table.seconds]
        cost.source, cost.learn = table.source, table.learn
        self.draft_seconds_per_token = state.draft_seconds_per_token
        self.draft_costs = deque(state.draft_costs, maxlen=self.settings.draft_cost_window)
        h, a = self.engine_history, state.acceptance
        h.rates, h.counts, h.num_updates = list(a.rates), list(a.counts), a.num_updates
        g = state.guard
        self.modelled_goodput, self.observed_goodput = g.modelled_goodput, g.observed_goodput
        self.num_decode_steps, self.diverged_steps = g.num_decode_steps, g.diverged_steps
        self.last_reprobe_step, self.reprobe_pending = g.last_reprobe_step, g.reprobe_pending
        self.num_reprobes = g.num_reprobes

    # ---- the decision: reads the state above (a given state loaded first), nothing else --------
    def decide(self, view: StepView, state: PolicyState | None = None) -> StepK:
        """`state`: the engine-wide state to price from (data parallel: the value every rank
        holds, dynaspec/dp), loaded first; None: this policy's own."""
        if state is not None:
            self.load(state)
        ctx, g = view.ctx_stat, view.global_view
        ceiling = self.plan.k_for(view.batch_size, ctx)
        caps = {r.request_id: drafter_gate(*hard_cap(ceiling, r), r) for r in view.requests}
        if ceiling == 0 or not (view.requests if g is None else g.num_decoding):
            return self._step_k(0, ctx, caps, {}, g is not None)
        # Under DP the lockstep step runs at the busiest rank's pace, so its size prices a width.
        num_reqs = view.num_reqs if g is None else g.max_rank_reqs
        cost = self.cost_model.widths_priced(num_reqs, ctx)
        if self._none_can_pay(view, ceiling, cost):
            return self._plain_step(view, ctx, caps, ceiling, cost)
        rows, fixed, trees, strict = self._request_rows(view, caps, ceiling, cost)
        # One rank prices its own requests; under DP every rank prices the same shared rows.
        pricing = self._pricing(rows if g is None else self._shared_rows(num_reqs, ceiling), cost)
        by_k = {k: goodput(pricing, k, self.draft_seconds_per_token)
                for k in self._candidates(ceiling)}
        best_k, best = 0, -1.0
        for k, value in by_k.items():
            if value > best * _MARGIN:
                best_k, best = k, value
        if best_k == 0 and self.reprobe_pending:
            # the guard's re-probe: one narrow K>0 step
            best_k, fixed = runnable_k(1, self.allowed_widths), {}
        fallback = {} if self.fallback is None or g is not None else {
            r.request_id: self.fallback.cap(r, caps[r.request_id][0], cost)
            for r in view.requests}
        grammar = {} if self.grammar is None else {
            r.request_id: self.grammar.cap(r, caps[r.request_id][0], cost)
            for r in view.requests if r.structured}
        d = self._step_k(best_k, ctx, caps, fixed, g is not None, fallback, grammar)
        # A tree only where the request drafts at all (one cut to 0 drafts nothing).
        trees = frozenset(t for t in trees if d.per_request[t] > 0)
        return replace(d, modelled_goodput=best, goodput_by_k=by_k,
                       trees=trees if self.settings.drafts_trees else None,
                       min_depth={rid: caps[rid][0] for rid in strict if d.per_request[rid] > 0})

    def _none_can_pay(self, view: StepView, ceiling: int, cost: StepCost) -> bool:
        """No draft could pay at these costs even if every one were accepted: a step whose
        widest row verifies m drafts emits at most 1 + m tokens a request for cost(1 + m), so
        where (1 + m) / cost(1 + m) <= 1 / cost(1) for every m up to the ceiling no K, shape
        or probe can beat plain decode, and pricing every request would only say so (at c64 on
        the Zen 4, with K = 0 on every step, that pricing was most of what a drafter added to a
        plain step). One rank only (DP prices shared rows), not while the divergence guard
        wants its re-probe, and not where forced (grammar) or fallback drafts are priced apart
        (their caps have their own pricing)."""
        if view.global_view is not None or self.reprobe_pending or self.fallback is not None:
            return False
        if any(r.structured for r in view.requests):
            return False
        plain = 1.0 / cost(1)
        return all((1.0 + m) / cost(1 + self._runnable(m)) <= plain
                   for m in range(1, ceiling + 1))

    def _plain_step(self, view: StepView, ctx: int, caps: dict, ceiling: int,
                    cost: StepCost) -> StepK:
        """The decision _request_rows and the candidates would reach when no draft can pay
        (_none_can_pay): every request cut to 0 (no probe can pay either), so every candidate
        K prices the plain step, the same floats as the long way."""
        value = (float(len(view.requests)) if view.requests else 0.0) / cost(1)
        by_k = {k: value for k in self._candidates(ceiling)}
        fixed = {r.request_id: 0 for r in view.requests if caps[r.request_id][0] > 0}
        d = self._step_k(0, ctx, caps, fixed)
        return replace(d, modelled_goodput=value, goodput_by_k=by_k,
                       trees=frozenset() if self.settings.drafts_trees else None)

    def _request_rows(self, view: StepView, caps: dict, ceiling: int, cost: StepCost
                      ) -> tuple[list[PricedRow], dict[str, int], frozenset[str], set[str]]:
        """Each request priced once, in the shape it would draft (chain or tree), for its own
        check and the step's: its row, the requests whose K does not follow the step's (0, or a
        probe), the requests that draft a tree, and the cut requests that may still verify a
        full-depth draft (`strict_probes`)."""
        fixed: dict[str, int] = {}
        strict: set[str] = set()
        rows, trees = [], set()
        probe_pays = None  # the same for every request: priced once, when first needed
        plain = 1.0 / cost(1)
        prices = self._prices(cost, ceiling)
        pricer = None
        if self.settings.drafts_trees and view.global_view is None:
            lengths = self.tree_lengths if self.tree_lengths.num_updates else FULL_LENGTHS
            pricer = TreePricer(self.branch_rates, lengths.survival, ceiling)
        for r in view.requests:
            rid, cap = r.request_id, caps[r.request_id][0]
            row, value, tree = self._shape(r, cap, cost, pricer, prices)
            if tree:
                trees.add(rid)
            if cap > 0 and not value > plain * _MARGIN:
                stale = self._stale(r)
                # not stale: a self-sizing drafter may still draft, but only a long match
                deep_only = not stale and self.settings.strict_probes and self.settings.whole_cap
                if (stale or deep_only) and probe_pays is None:
                    probe_pays = self._alone(self._probe_row(ceiling), cost,
                                             prices) > plain * _MARGIN
                probing = (stale or deep_only) and bool(probe_pays)
                if probing and deep_only:
                    strict.add(rid)
                fixed[rid] = self._probe_k(cap) if probing else 0
                row = prices.fixed(row, min(fixed[rid], cap))
            rows.append(row)
        return rows, fixed, frozenset(trees), strict

    def _shape(self, r: RequestView, cap: int, cost: StepCost, trees: TreePricer | None,
               prices: DecisionPrices) -> tuple[PricedRow, float, bool]:
        """The request's row as a chain or, where the drafter gives trees (`trees`) and it
        pays more alone, as a tree of as many nodes; with its goodput alone and whether it is
        a tree. Its rates: its own where observed, the engine's deeper (DecisionPrices.rates).
        """
        hist = self.history(r)
        h = hist.rates if hist is not None and hist.num_updates and prices.own_rates else None
        own = self.lengths.get(r.request_id)
        own = own.deeper(self.engine_lengths) if own is not None and own.num_updates else None
        if h is None and own is None:  # priced from the engine's state alone: as every such
            got = prices.shared.get(cap)
            if got is None:
                got = prices.shared[cap] = self._priced(None, None, cap, cost, trees, prices)
            return got
        return self._priced(h, own, cap, cost, trees, prices)

    def _priced(self, own_rates: list[float] | None, own_lengths: DraftLengths | None,
                cap: int, cost: StepCost, trees: TreePricer | None, prices: DecisionPrices
                ) -> tuple[PricedRow, float, bool]:
        rates = prices.rates(own_rates, cap)
        chain = prices.row(rates, prices.survival(own_lengths, cap), cap)
        value = self._alone(chain, cost, prices) if cap > 0 else 0.0
        if trees is None or cap < 2:
            return chain, value, False
        tree = trees.row_of(tuple(rates))
        tree_value = self._alone(tree, cost, prices)
        if tree_value > value * _MARGIN:
            return tree, tree_value, True
        return chain, value, False

    def _shared_rows(self, num_reqs: int, ceiling: int) -> list[PricedRow]:
        """Data parallel: rows from state every rank holds identically (the engine-wide
        acceptance, kept equal by dynaspec/dp), never from this rank's own requests, so every
        rank prices the same step and picks the same K."""
        rates = self.synthetic or (self.engine_history if self.engine_history.num_updates
                                   else FixedRates(self.settings.prior_rate))
        return [price_row(rates.rate, FULL_LENGTHS.survival(ceiling), ceiling, True)] * num_reqs

    def _pricing(self, rows: list[PricedRow], cost: StepCost) -> StepPricing:
        return StepPricing(rows, cost, self._runnable, self.settings.widths_follow_drafts)

    def _candidates(self, ceiling: int) -> list[int]:
        if self.settings.whole_cap:
            return [0, ceiling]
        return [k for k in range(ceiling + 1)
                if k == 0 or self.allowed_widths is None or 1 + k in self.allowed_widths]

    def _runnable(self, k: int) -> int:
        ks = self._runnable_ks
        return ks[k] if k < len(ks) else runnable_k(k, self.allowed_widths)

    def _prices(self, cost: StepCost, ceiling: int) -> DecisionPrices:
        prior = self.engine_history if self.engine_history.num_updates \
            else FixedRates(self.settings.prior_rate)
        lengths = self.engine_lengths if self.engine_lengths.num_updates else FULL_LENGTHS
        return DecisionPrices(cost, self._runnable, self.settings.widths_follow_drafts,
                              (self.synthetic or prior).rate, self.synthetic is None, lengths,
                              ceiling)

    def _alone(self, row: PricedRow, cost: StepCost, prices: DecisionPrices | None = None) -> float:
        """The row's best goodput over its caps 1..limit (its limit alone where the drafter
        sizes its own drafts) if every request drafted like it; compared with plain decode's
        1 / cost(1) by the same margin decide() needs to prefer a K over plain, so a row that
        ties is cut (and re-probed) rather than left following a step that runs K=0 anyway."""
        follow = self.settings.widths_follow_drafts
        if row.limit == 0:
            return 0.0
        if self.settings.whole_cap:
            k = row.limit
            return (1.0 + row.accepted[k]) / one_row_seconds(row, k, cost, self._runnable, follow)
        prices = prices or self._prices(cost, row.limit)
        return prices.best_alone(row)

    def _stale(self, r: RequestView) -> bool:
        last = self.last_draft_ctx.get(r.request_id)
        return last is None or r.context_len - last >= self.settings.probe_interval

    def _probe_k(self, cap: int) -> int:
        # A drafter that sizes its own drafts is probed as it drafts (up to its cap): a one-draft
        # probe teaches only the first position and nothing of how far its drafts go.
        return cap if self.settings.whole_cap else 1

    def _probe_row(self, ceiling: int) -> PricedRow:
        rates = self.settings.probe_rates(self.engine_history)
        return price_row(rates, FULL_LENGTHS.survival(ceiling), ceiling, True)

    def _step_k(self, k: int, ctx: int, caps: dict, fixed: dict[str, int],
                agreed: bool = False, fallback: dict[str, int] | None = None,
                grammar: dict[str, int] | None = None) -> StepK:
        per = {rid: min(fixed.get(rid, k), cap) for rid, (cap, _) in caps.items()}
        if agreed:  # a probe cannot widen the step the ranks agreed on (K=0: no forward width)
            per = {rid: min(n, k) for rid, n in per.items()}
        # A request may verify as many drafts as either drafter is allowed (its fallback's cap
        # is its own, no wider than its hard cap).
        fallback = fallback or {}
        per = {rid: max(n, fallback.get(rid, 0)) for rid, n in per.items()}
        # Forced drafts have a cap of their own too; under DP never past the agreed K.
        both = {rid: (min(g, k) if agreed else g, per[rid]) for rid, g in (grammar or {}).items()}
        per = {rid: max(n, both[rid][0]) if rid in both else n for rid, n in per.items()}
        reasons = {}
        for rid, (cap, why) in caps.items():
            if per[rid] < cap:
                reasons[rid] = "adaptive"  # the policy, not the table, lowered it
            elif why is not None:
                reasons[rid] = why
        # The step's K: the widest any request verifies, rounded up to a width the plan runs;
        # under DP it is the K every rank agreed on (this rank's requests may all verify less).
        k = k if agreed else runnable_k(max(per.values(), default=0), self.allowed_widths)
        return StepK(k, per, reasons, ctx, fallback, grammar=both)
