"""The K decision, per step (docs/design.md §3): ``KPolicy.decide(StepView) -> StepK``.

A policy is a pure function of what the scheduler knows when it forms the batch, so the K it
returns is the K of the batch that verifies the drafts (no one-step lag).

Batch axis: ``StepView.num_reqs``, every request in the step including prefill chunks, because
all of them share the verify forward whose cost the table was measured on.

Context statistic: the **mean context length of the step's decoding requests, rounded up**.
The context axis exists because long-context decode is memory-bound on KV reads, which a wider
verify amortises (MagicDec; vLLM RFC #48627). A step reads the KV of every request, so its cost
follows the *sum* of contexts; with the batch axis already giving the count, the mean is the
statistic under which a mixed batch and the homogeneous batch ``dynaspec tune`` measured at
(batch, ctx) read the same KV. The longest context would let one long request move every
request's K, and safety at the long end does not need it: the per-request caps below handle
the drafter's and the model's length limits request by request. A step without decoding
requests uses ctx 1 (nothing drafts; the K is still reported for the step census).

Per-request caps, each recorded with its reason for the metrics (``draft_skips{reason}``):
- ``schedule_zero``: the step's K is 0;
- ``max_tokens``: ``remaining_tokens - 1``, because a verify emits up to k+1 tokens;
- ``max_model_len``: ``max_model_len_room - 1``, for the same reason;
- ``adaptive``: the adaptive policy chose fewer;
- ``drafter_length``: the request cannot fit its drafts in the drafter (``drafter_room`` below
  its cap): that request alone gets 0; the others keep drafting (vLLM's gate is batch-wide).
"""

from __future__ import annotations

from typing import Protocol

from dynaspec.draft_tree import TreeWalk
from dynaspec.spec_decode.plan.plan import SpecPlan

# The step view and the per-request caps live with the rest of the width logic.
from dynaspec.spec_decode.plan.step_width import (  # noqa: F401
    GlobalStepView,
    RequestView,
    StepK,
    StepView,
    context_statistic,
    drafter_gate,
    hard_cap,
)
from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory
from dynaspec.spec_decode.policy.policy_state import PolicyState


class KPolicy(Protocol):
    """``decide`` is pure (it reads the policy's state and the view, returns the decision with
    its report, and writes nothing); the ``observe*``/``forget`` writers run after a step's
    result."""

    def decide(self, view: StepView, state: PolicyState | None = None) -> StepK:
        """`state`: the engine-wide state the decision prices from, as one value (data
        parallel: the value every rank holds); None: the policy's own. Policies without one
        (the table's) ignore it."""
        ...

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, ctx: int,
                cap: int = 0, fallback: bool = False, walk: TreeWalk | None = None,
                grammar: bool = False) -> None: ...

    def observe_step(self, num_reqs: int, ctx: int, width: int, target_seconds: float,
                     draft_seconds: float, num_drafted: int, num_emitted: int,
                     fallback_seconds: float = 0.0, fallback_drafted: int = 0,
                     modelled_goodput: float | None = None) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def num_cached(self) -> int: ...

    def goodput_report(self) -> tuple[float | None, float | None]:
        """(modelled, observed) goodput for the snapshot; (None, None) without a cost model."""
        ...

    @property
    def num_reprobes(self) -> int:
        """K>0 steps the goodput policy's divergence guard forced (0 for the others)."""
        ...


def _step_k(k: int, ctx: int, caps: dict[str, tuple[int, str | None]]) -> StepK:
    per_request = {rid: c for rid, (c, _) in caps.items()}
    # A reason is only ever set where the cap was lowered below k, so every one is kept.
    reasons = {rid: why for rid, (_, why) in caps.items() if why is not None}
    return StepK(k, per_request, reasons, ctx)


class TablePolicy:
    """The plan's table, keyed on (requests in the step, mean decoding context)."""

    # Policies that learn from acceptance keep per-request histories; the table ignores them.
    keeps_history = False
    num_reprobes = 0  # goodput: K>0 steps its divergence guard forced

    def __init__(self, plan: SpecPlan) -> None:
        self.plan = plan
        self.histories: dict[str, AcceptanceHistory] = {}  # the policy owns per-request state

    def history(self, r: RequestView) -> AcceptanceHistory | None:
        """The view's history when it carries one (tests, a rank's forwarded view), else ours."""
        return r.history if r.history is not None else self.histories.get(r.request_id)

    def new_history(self) -> AcceptanceHistory:
        return AcceptanceHistory()

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, ctx: int,
                cap: int = 0, fallback: bool = False, walk: TreeWalk | None = None,
                grammar: bool = False) -> None:
        """A verified step's outcome for one request; `cap` is the drafts it was allowed
        (0: unknown), so a drafter's own stops can be told from the cap's; `fallback`: the
        drafter's fallback drafted them (kept apart only by a policy that prices it);
        `grammar`: the request's grammar forced them (likewise); `walk`:
        its drafts were a tree verified as one (learned apart only by a policy that prices
        trees; here the tree counts as its nodes)."""
        if self.keeps_history and num_drafted:
            if request_id not in self.histories:
                self.histories[request_id] = self.new_history()
            self.histories[request_id].update(num_drafted, num_accepted)

    def observe_step(self, num_reqs: int, ctx: int, width: int, target_seconds: float,
                     draft_seconds: float, num_drafted: int, num_emitted: int,
                     fallback_seconds: float = 0.0, fallback_drafted: int = 0,
                     modelled_goodput: float | None = None) -> None:
        """Step timings, for policies with a cost model; the table has none."""

    def goodput_report(self) -> tuple[float | None, float | None]:
        """(modelled, observed) tokens per second of decode steps; None where not modelled."""
        return None, None

    def forget(self, request_id: str) -> None:
        self.histories.pop(request_id, None)

    def num_cached(self) -> int:
        """Requests it holds state for (0 once every request is forgotten: leak checks)."""
        return len(self.histories)

    def decide(self, view: StepView, state: PolicyState | None = None) -> StepK:
        ctx = view.ctx_stat
        k = self.plan.k_for(view.batch_size, ctx)
        caps = {}
        for r in view.requests:
            cap, reason = self._refine(*hard_cap(k, r), r)
            caps[r.request_id] = drafter_gate(cap, reason, r)
        return _step_k(k, ctx, caps)

    def _refine(self, cap: int, reason: str | None, r: RequestView) -> tuple[int, str | None]:
        """Hook for policies that lower a request's cap further (the table keeps it)."""
        return cap, reason


def _interpolated_cost(costs: dict[int, float], width: int) -> float:
    """Linear interpolation between measured widths, extrapolated along the outermost slope."""
    if width in costs:
        return costs[width]
    ws = sorted(costs)
    if len(ws) == 1:
        return costs[ws[0]] * width / ws[0]  # one point: assume cost proportional to width
    lo, hi = (ws[0], ws[1]) if width < ws[0] else (ws[-2], ws[-1])
    for a, b in zip(ws, ws[1:]):
        if a < width < b:
            lo, hi = a, b
    slope = (costs[hi] - costs[lo]) / (hi - lo)
    return max(1e-9, costs[lo] + slope * (width - lo))


class AdaptivePolicy(TablePolicy):
    """Per-request K under the table's ceiling, from each request's acceptance history.

    For a request with history it picks the k in [min_k, cap] that maximises expected tokens
    per unit of verify cost, ``(1 + E[accepted | k]) / cost(1 + k)``; ties go to the smaller k.
    ``cost_per_width`` maps a verify width to its relative cost (measured by ``dynaspec tune``);
    without it a width costs ``1 + 0.1 * (width - 1)``, a memory-bound decode's shape.
    ``min_k`` (1) keeps a request drafting at least one token so its history keeps updating:
    at 0 it could never show that acceptance recovered. A request with no history yet gets the
    table's cap, so adaptive starts exactly where the table policy would.
    """

    DEFAULT_MARGINAL_COST = 0.1
    keeps_history = True

    def __init__(self, plan: SpecPlan, cost_per_width: dict[int, float] | None = None,
                 min_k: int = 1) -> None:
        if cost_per_width is not None:
            bad = {w: c for w, c in cost_per_width.items() if w < 1 or not c > 0}
            if not cost_per_width or bad:
                raise ValueError(
                    f"cost_per_width needs widths >= 1 with costs > 0, got {cost_per_width}"
                )
        super().__init__(plan)
        self.costs = dict(cost_per_width) if cost_per_width else None
        self.min_k = min_k

    def cost(self, width: int) -> float:
        if self.costs is None:
            return 1.0 + self.DEFAULT_MARGINAL_COST * (width - 1)
        return _interpolated_cost(self.costs, width)

    def choose(self, cap: int, history: AcceptanceHistory | None) -> int:
        if cap == 0 or history is None or history.num_updates == 0:
            return cap
        best_k, best = cap, -1.0
        for k in range(min(self.min_k, cap), cap + 1):
            value = (1.0 + history.expected_accepted(k)) / self.cost(1 + k)
            if value > best + 1e-12:
                best_k, best = k, value
        return best_k

    def _refine(self, cap: int, reason: str | None, r: RequestView) -> tuple[int, str | None]:
        chosen = self.choose(cap, self.history(r))
        return (chosen, "adaptive") if chosen < cap else (cap, reason)
