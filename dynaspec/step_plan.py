"""The step plan: what `Scheduler.schedule()` hands the runner, immutable once it leaves.

One `StepPlan` per engine step (docs/design.md §1b): the requests, the tokens each computes, each
one's
draft cap and skip reason, the step's K and the `BatchDescriptor` (path, padded rows, width)
planned before the forward. Nothing downstream changes it; under async scheduling the scheduler
may issue a revised plan (`Scheduler.revise`) once the previous step's tokens are known, as a
new object. The width logic behind these numbers lives in `spec_decode/plan/step_width.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynaspec.request import Request


@dataclass(frozen=True)
class BatchDescriptor:
    """Shape and path of one step's target forward, planned by `schedule()` before it runs
    (docs/design.md §6). On a fixed-shape path ("compiled", "cuda_graph") every request verifies
    exactly
    `width` tokens and rows are padded to `num_reqs_padded`; on "eager" the step is ragged and
    `width` is the planned verify width (1+K) of a decode-only step (None: mixed prefill+decode),
    `num_tokens_padded` an upper bound on its tokens."""

    path: str  # "eager" | "compiled" | "cuda_graph"
    num_reqs_padded: int
    width: int | None
    num_tokens_padded: int

    @property
    def fixed_shape(self) -> bool:
        return self.path != "eager"

    @property
    def width_label(self) -> str:
        return "mixed" if self.width is None else str(self.width)


@dataclass(frozen=True, kw_only=True)
class ScheduledRequest:
    """One request's row of the plan. `request` is the live request (the runner reads its
    tokens); every number here is fixed at schedule time."""

    request: Request
    num_new_tokens: int  # prompt/output tokens computed this step (drafts not included)
    draft_budget: int  # drafts this request may verify this step (0 = none)
    skip_reason: str | None  # why draft_budget is 0 on a sampling step (None when it may draft)
    block_table: list[int]
    sampling: bool  # the chunk reaches the request's last token: this step emits a token
    num_lookahead: int = 0  # KV slots reserved past the new tokens (an upper bound on drafts)
    # Async scheduling: budgeted draft slots found invalid once the previous step's tokens were
    # known (its caps dropped); they go down the invalid-draft channel ("async_placeholder").
    num_async_invalid: int = 0
    # A drafter with a fallback (lookup first, then a head): the fallback's own cap, <=
    # draft_budget; None, the same cap (a policy that does not price the fallback apart).
    fallback_budget: int | None = None
    # Structured output with grammar drafts (docs/design.md §4d), where the policy prices them
    # apart: the cap of the grammar's forced drafts and that of the request's own drafter, each
    # <= draft_budget; None, draft_budget for both.
    grammar_budget: int | None = None
    drafter_budget: int | None = None
    # Draft a tree of up to draft_budget nodes where the drafter can (docs/design.md §4c); False:
    # the K policy chose a chain for this request this step.
    draft_tree: bool = True
    # A draft shallower than this is dropped ("short_match"; StepK.min_depth).
    min_draft_depth: int = 0


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    scheduled: tuple[ScheduledRequest, ...]
    step_k: int | None  # the step's K; None when speculation is off
    num_batched_tokens: int  # without drafts
    batch: BatchDescriptor
    preempted_ids: tuple[str, ...] = ()
    schedule_seconds: float = 0.0
    modelled_goodput: float | None = None  # tokens/s the K decision expected (goodput)

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)
