"""The step's width, from the step view to the forward, in one place (docs/design.md §1b, §3, §6).

Follow K through one step:
1. **view**: `StepView` (the step's decoding requests as `RequestView`s, its request count and,
   under data parallelism, the `GlobalStepView` agreed before `schedule()`).
2. **reserve**: before the batch forms, the policy decides for the batch the scheduler expects
   (`reserve`); its caps are the draft slots (KV lookahead and token budget) each decoding
   request reserves (`lookahead`). A plan that may pad reserves the full K for everyone.
3. **decide**: for the batch formed, the policy decides again (`decide`), never above the K
   reserved (`clamp`), and each request's draft cap is the lower of its reservation and the
   decision (`cap`).
4. **describe**: the step's `BatchDescriptor` from the execution plan's grid
   (`spec_decode/plan/execution_plan.py`): a decode-only step has width 1+K and may take a
   fixed-shape path only if every request reserved K slots (`describe`).
5. **recap** (async scheduling only): a plan formed while the previous step was in flight is
   capped for one token of that step; once its tokens land, caps drop to the exact ones
   (`recap_cap`); the slots cut are `async_placeholder` invalids.
6. **pad**: on a fixed-shape step every sampling row verifies exactly `width` tokens; real
   drafts (after the grammar's cut) are padded with -1 (`pad_row`, `pad_probs`), and the pads
   that are not grammar or async cuts count `invalid{padding}` (`num_padding`).
The runner reads the plan and never changes a width; nothing re-measures it after the forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from dynaspec.step_plan import BatchDescriptor

if TYPE_CHECKING:
    from dynaspec.spec_decode.plan.execution_plan import ExecutionPlan
    from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory

PAD = -1  # never a real token id: rejected by the verifier, counted as invalid "padding"


# ---- 1. the step view -----------------------------------------------------------------------
@dataclass(frozen=True)
class RequestView:
    request_id: str
    context_len: int  # tokens already in context (prompt + output)
    remaining_tokens: int  # max_tokens - num_output_tokens
    max_model_len_room: int  # max_model_len - context_len
    drafter_room: int | None = None  # positions the drafter can still take; None = unlimited
    history: AcceptanceHistory | None = None
    structured: bool = False  # it has a grammar, which may force drafts (docs/design.md §4d)


@dataclass(frozen=True)
class GlobalStepView:
    """The step summed over every data-parallel rank (docs/design.md §7), exchanged before
    `schedule()`.

    Under data parallelism the step's K is a function of this view (and of state every rank
    holds identically), so all ranks choose one K; per-request caps still come from each rank's
    own ``StepView.requests``.
    """

    num_reqs: int  # requests in the step on all ranks, prefill included
    num_decoding: int  # decoding requests on all ranks
    sum_ctx: int  # sum of their contexts
    max_ctx: int  # the longest of them (reported; the K lookup uses the mean, as single-rank)
    max_rank_reqs: int  # requests on the busiest rank: the lockstep step runs at its pace

    @property
    def ctx_stat(self) -> int:
        """The same statistic as ``context_statistic``, over every rank's decoding requests."""
        return max(1, -(-self.sum_ctx // self.num_decoding)) if self.num_decoding else 1


@dataclass(frozen=True)
class StepView:
    requests: tuple[RequestView, ...]  # decoding requests of this step (prefill chunks excluded)
    num_reqs: int  # requests in the step, prefill included
    global_view: GlobalStepView | None = None  # set under data parallelism (dynaspec/dp)

    @property
    def batch_size(self) -> int:
        """The batch axis of the K lookup: this step's requests, on every rank under DP."""
        return self.num_reqs if self.global_view is None else self.global_view.num_reqs

    @property
    def ctx_stat(self) -> int:
        """The context axis of the K lookup (k_policy's docstring), on every rank under DP."""
        if self.global_view is None:
            return context_statistic(self.requests)
        return self.global_view.ctx_stat

    def __post_init__(self) -> None:
        if self.num_reqs < len(self.requests):
            raise ValueError(f"num_reqs {self.num_reqs} < {len(self.requests)} decoding requests")
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            dup = sorted(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"duplicate request ids in a step: {dup}")


@dataclass(frozen=True)
class StepK:
    k: int  # the step's K from the plan
    per_request: dict[str, int]  # request_id -> drafts allowed this step (<= k)
    reasons: dict[str, str]  # request_id -> why its cap is below k (metrics.records.SKIP_REASONS)
    ctx_stat: int  # the context statistic used for the lookup
    # request_id -> the fallback drafter's cap (<= per_request), where the policy prices a
    # drafter's fallback apart (goodput with lookup-first drafting); absent: per_request's.
    fallback: dict[str, int] = field(default_factory=dict)
    # The policy's report, for metrics and the cost model's pairing (goodput; None elsewhere):
    # the tokens/s it expected of the K chosen, and of every candidate K it priced.
    modelled_goodput: float | None = None
    goodput_by_k: Mapping[int, float] = field(default_factory=dict)
    # Requests that draft a tree (the policy chose each request's shape); None: the policy does
    # not choose shapes, a tree-drafting drafter drafts trees (docs/design.md §4c).
    trees: frozenset[str] | None = None
    # request_id -> the shallowest draft worth verifying: a request the policy cut verifies its
    # self-sizing drafter's draft only where the match runs as deep as its cap (copied text).
    min_depth: Mapping[str, int] = field(default_factory=dict)
    # request_id -> (the grammar's cap, the request's drafter's cap), both <= per_request, for
    # structured-output requests where the policy prices forced drafts apart (docs/design.md
    # §4d); absent: per_request's for both.
    grammar: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def drafts_tree(self, request_id: str) -> bool:
        return self.trees is None or request_id in self.trees


class Decider(Protocol):
    def decide(self, view: StepView) -> StepK: ...


def context_statistic(requests: tuple[RequestView, ...]) -> int:
    """Mean context of the decoding requests, rounded up (k_policy's docstring says why)."""
    if not requests:
        return 1
    return max(1, math.ceil(sum(r.context_len for r in requests) / len(requests)))


# ---- per-request caps (every policy applies them) ------------------------------------------
def hard_cap(k: int, r: RequestView) -> tuple[int, str | None]:
    """The request's cap from the step's K and its length limits, with the binding reason."""
    if k == 0:
        return 0, "schedule_zero"
    cap, reason = k, None
    for limit, why in ((r.remaining_tokens - 1, "max_tokens"),
                       (r.max_model_len_room - 1, "max_model_len")):
        if limit < cap:
            cap, reason = max(0, limit), why
    return cap, reason


def drafter_gate(cap: int, reason: str | None, r: RequestView) -> tuple[int, str | None]:
    """A request whose drafts would overflow the drafter gets 0 this step, and only it."""
    if cap > 0 and r.drafter_room is not None and r.drafter_room < cap:
        return 0, "drafter_length"
    return cap, reason


def runnable_k(k: int, allowed_widths: frozenset[int] | None) -> int:
    """`k` rounded up to a K whose width 1+K the execution plan runs (k itself if none does)."""
    if k == 0 or allowed_widths is None:
        return k
    return min((w - 1 for w in allowed_widths if w - 1 >= k), default=k)


# ---- 2. reserve ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reserve:
    """Draft slots each request may reserve this step, from the K decided for the prospective
    batch; requests it does not name (admitted from the queue) get `k`."""

    per_request: Mapping[str, int] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=dict)
    k: int = 0

    def of(self, request_id: str) -> tuple[int, str | None]:
        n = self.per_request.get(request_id, self.k)
        return n, (self.reasons.get(request_id, "schedule_zero") if n == 0 else None)


NO_RESERVE = Reserve()


class OneStepDecisions:
    """A policy's decisions within one `schedule()`: the reservation and the formed batch
    usually present the same view, and nothing is observed in between (observations land in
    `update`), so the view is priced once (~130 us a goodput decision at batch 1, 2-4% of a c1
    step). Made afresh for every step; the policy itself keeps no memo (its decide is pure)."""

    def __init__(self, policy: Decider) -> None:
        self.policy = policy
        self._last: tuple[StepView, StepK] | None = None

    def decide(self, view: StepView) -> StepK:
        if self._last is not None and self._last[0] == view:
            return self._last[1]
        d = self.policy.decide(view)
        self._last = (view, d)
        return d


def reserve(policy: Decider, view: StepView) -> Reserve:
    """The K decision for the batch this step will most likely form (the view before the batch
    forms; `decide` prices the batch that did)."""
    d = policy.decide(view)
    return Reserve(dict(d.per_request), dict(d.reasons), d.k)


def may_pad(exec_plan: ExecutionPlan) -> bool:
    """Some grid shape runs fixed-shape: every decoding row may be padded to 1+K."""
    return bool(exec_plan.fixed_shapes)


def lookahead(res: Reserve, request_id: str, *, decoding: bool, budget: int,
              padding: bool) -> tuple[int, str | None]:
    """Draft slots to reserve, and why there are none: only a request decoding one token drafts
    (not a prefill step), as many as its reserve, if the token budget fits them. `padding`: a
    fixed-shape step pads every decoding row to 1+K, so reserve the full K for each."""
    if not decoding:
        return 0, "prefill"
    want, reason = res.of(request_id)
    if padding:
        want, reason = max(want, res.k), (reason if res.k == 0 else None)
    if want == 0:
        return 0, reason
    return (want, None) if budget >= 1 + want else (0, "token_budget")


# ---- 3. decide, clamp, cap -------------------------------------------------------------------
def decide(policy: Decider, view: StepView, reserved_k: int) -> StepK:
    """The policy's decision for the batch formed (the verifying batch), its K never above the K
    whose slots were reserved (the batch can differ from the expected one)."""
    d = policy.decide(view)
    return clamp(d, reserved_k) if d.k > reserved_k else d


def clamp(d: StepK, k: int) -> StepK:
    """The decision with its K lowered to `k` (a K the plan produced for the reservation)."""
    per = {rid: min(c, k) for rid, c in d.per_request.items()}
    return replace(d, k=k, per_request=per, fallback={}, grammar={})


def cap(reserved: int, reason: str | None, d: StepK, request_id: str) -> tuple[int, str | None]:
    """A request's draft cap: its reservation lowered to the decision, with the reason for 0."""
    if reserved == 0:
        return 0, reason
    n = min(reserved, d.per_request.get(request_id, d.k))
    return n, (d.reasons.get(request_id, "schedule_zero") if n == 0 else None)


# ---- 4. describe -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RowShape:
    """What `describe` needs of one scheduled request."""

    num_new_tokens: int
    sampling: bool
    draft_budget: int
    num_lookahead: int


def describe(exec_plan: ExecutionPlan, rows: list[RowShape], k: int) -> BatchDescriptor:
    """The step's BatchDescriptor: a decode-only step verifies width 1+K (K from the plan, so
    the width is one of plan.widths); it may take a fixed-shape path only if every request has
    KV slots reserved for K drafts, because there every request is padded to the full width."""
    decode_only = bool(rows) and all(r.sampling and r.num_new_tokens == 1 for r in rows)
    planned = sum(r.num_new_tokens + r.draft_budget for r in rows)
    batch = exec_plan.descriptor(len(rows), 1 + k if decode_only else None, planned)
    if batch.fixed_shape and any(r.num_lookahead < k for r in rows):
        # A request reserved fewer slots than K (its cap, or the batch changed since the
        # reservation): padding it to the full width would write past them, so run eager.
        batch = BatchDescriptor("eager", len(rows), batch.width, planned)
    return batch


# ---- 5. recap (async scheduling) -------------------------------------------------------------
def recap_cap(step_k: int, view: RequestView, budget: int) -> tuple[int, str | None, int]:
    """(cap, reason when 0, slots cut) for a budget set before the previous step's tokens were
    known, now that `view` has them: the exact cap by max_tokens, max_model_len, drafter room."""
    c, why = drafter_gate(*hard_cap(step_k, view), view)
    if c >= budget:
        return budget, None, 0
    return c, (why if c == 0 else None), budget - c


# ---- 6. pad ----------------------------------------------------------------------------------
def pad_row(drafts: list[int], width: int) -> list[int]:
    """A fixed-shape row's drafts: the real ones, then -1 up to width-1 slots."""
    return drafts + [PAD] * (width - 1 - len(drafts))


def pad_probs(p: torch.Tensor, n: int) -> torch.Tensor:
    """Draft probs [d, vocab] -> [n, vocab]. Pad rows are zero: a pad is never accepted, and if
    every real draft was accepted the token sampled at the first pad must come from
    max(p - 0, 0) = p, the target itself, exactly as the bonus token would without padding."""
    if p.shape[0] >= n:
        return p[:n]
    return torch.cat([p, p.new_zeros(n - p.shape[0], p.shape[1])])  # [n, vocab]


def num_padding(num_slots: int, num_valid: int, num_cut: int) -> int:
    """Pads of a row that are plain padding: the slots past the valid drafts, less those that
    stand for drafts cut (by the grammar, or found invalid under async scheduling), which are
    counted under their own reason. On an eager row the cut slots are not in the row at all."""
    pads = num_slots - num_valid
    return pads - min(pads, num_cut)
