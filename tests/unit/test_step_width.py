"""spec_decode/plan/step_width.py: K from the step view to the padded row, one function at a
time."""

from __future__ import annotations

import pytest
import torch

from dynaspec.spec_decode.plan import step_width as width
from dynaspec.spec_decode.plan.execution_plan import ExecutionPlan
from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.plan.step_width import (
    PAD,
    RequestView,
    Reserve,
    RowShape,
    StepK,
    StepView,
)
from dynaspec.spec_decode.policy.k_policy import TablePolicy


def _view(rid: str, ctx: int = 10, remaining: int = 50, room: int = 200,
          drafter: int | None = None) -> RequestView:
    return RequestView(rid, ctx, remaining, room, drafter)


def test_reserve_and_decide_read_the_policy_once_each_way():
    plan = build_spec_plan("ngram", 4, [[1, 2, 4], [3, 64, 2]])
    policy = TablePolicy(plan)
    views = (_view("a"), _view("b", remaining=2))
    res = width.reserve(policy, StepView(views, 2))
    assert (res.k, res.of("a"), res.of("b")) == (4, (4, None), (1, None))
    assert res.of("new") == (4, None), "a request admitted from the queue reserves the step's K"
    # The formed batch is bigger (3 requests: K 2), never above what was reserved.
    d = width.decide(policy, StepView(views, 3), reserved_k=res.k)
    assert d.k == 2 and d.per_request == {"a": 2, "b": 1}
    # Formed smaller than reserved for (K would rise to 4): clamped to the reservation.
    d = width.decide(policy, StepView(views[:1], 1), reserved_k=2)
    assert d.k == 2 and d.per_request == {"a": 2}


def test_one_step_decisions_price_a_view_seen_again_once():
    """The reservation and the formed batch usually present the same view within a step: the
    scheduler's per-step memo asks the (pure) policy once; another view is priced again."""
    calls = []

    class Counting(TablePolicy):
        def decide(self, view):  # type: ignore[no-untyped-def]
            calls.append(view)
            return super().decide(view)

    memo = width.OneStepDecisions(Counting(build_spec_plan("ngram", 4, None)))
    views = (_view("a"), _view("b"))
    res = width.reserve(memo, StepView(views, 2))
    d = width.decide(memo, StepView(views, 2), reserved_k=res.k)
    assert len(calls) == 1 and d.k == res.k == 4
    width.decide(memo, StepView(views[:1], 1), reserved_k=res.k)
    assert len(calls) == 2


def test_lookahead_prefill_budget_and_padding():
    res = Reserve({"a": 1}, {}, 3)
    assert width.lookahead(res, "a", decoding=False, budget=99, padding=False) == (0, "prefill")
    assert width.lookahead(res, "a", decoding=True, budget=99, padding=False) == (1, None)
    # A plan that may pad reserves the full K for every decoding row.
    assert width.lookahead(res, "a", decoding=True, budget=99, padding=True) == (3, None)
    assert width.lookahead(res, "a", decoding=True, budget=3, padding=True) == (0, "token_budget")
    zero = Reserve({}, {}, 0)
    assert width.lookahead(zero, "a", decoding=True, budget=99, padding=True) == \
        (0, "schedule_zero")


def test_cap_lowers_the_reservation_to_the_decision():
    d = StepK(2, {"a": 2, "b": 0}, {"b": "max_tokens"}, 10)
    assert width.cap(3, None, d, "a") == (2, None)
    assert width.cap(3, None, d, "b") == (0, "max_tokens")
    assert width.cap(0, "prefill", d, "c") == (0, "prefill"), "no reservation: its own reason"
    assert width.clamp(StepK(4, {"a": 4, "b": 1}, {}, 10), 2).per_request == {"a": 2, "b": 1}


def test_describe_runs_fixed_shape_only_when_every_row_reserved_k():
    plan = build_spec_plan("ngram", 3, None)
    ep = ExecutionPlan.build(plan, 8, "compiled")
    full = [RowShape(1, True, 3, 3), RowShape(1, True, 1, 3)]
    assert width.describe(ep, full, 3) == width.BatchDescriptor("compiled", 2, 4, 8)
    short = [RowShape(1, True, 3, 3), RowShape(1, True, 1, 1)]
    assert width.describe(ep, short, 3) == width.BatchDescriptor("eager", 2, 4, 6)
    mixed = [RowShape(1, True, 3, 3), RowShape(5, False, 0, 0)]
    described = width.describe(ep, mixed, 3)
    assert described.width is None and not described.fixed_shape


def test_recap_cap_cuts_to_the_exact_cap():
    assert width.recap_cap(4, _view("a", remaining=3), 4) == (2, None, 2)
    assert width.recap_cap(4, _view("a", remaining=1), 4) == (0, "max_tokens", 4)
    assert width.recap_cap(4, _view("a", drafter=2), 4) == (0, "drafter_length", 4)
    assert width.recap_cap(4, _view("a"), 3) == (3, None, 0), "never raised above the budget"


@pytest.mark.parametrize("slots,valid,cut,padding", [(3, 3, 0, 0), (3, 1, 0, 2), (3, 1, 2, 0),
                                                      (3, 0, 1, 2), (0, 0, 2, 0)])
def test_padding_excludes_cut_slots(slots, valid, cut, padding):
    assert width.num_padding(slots, valid, cut) == padding


def test_pad_row_and_probs():
    assert width.pad_row([7, 8], 5) == [7, 8, PAD, PAD]
    assert width.pad_row([], 2) == [PAD]
    p = torch.rand(2, 6)  # [drafts, vocab]
    q = width.pad_probs(p, 4)  # [4, vocab]
    assert q.shape == (4, 6) and torch.equal(q[:2], p) and not q[2:].any()


def test_runnable_k_rounds_up_to_a_planned_width():
    assert width.runnable_k(2, frozenset({1, 4, 6})) == 3
    assert width.runnable_k(0, frozenset({4})) == 0
    assert width.runnable_k(7, frozenset({4})) == 7, "no wider width: k itself"
    assert width.runnable_k(2, None) == 2
