"""KPolicy: table lookups, the context statistic, per-request caps and their reasons, the
acceptance history and the adaptive policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory
from dynaspec.spec_decode.policy.k_policy import (
    AdaptivePolicy,
    RequestView,
    StepView,
    TablePolicy,
    context_statistic,
)
from dynaspec.spec_decode.policy.policies import make_policy

GRID = ("[[1,4,1,512,4],[1,4,513,null,6],[5,16,1,512,2],[5,16,513,null,3],[17,null,1,512,0],"
        "[17,null,513,null,1]]")


def req(
    rid: str,
    ctx: int = 100,
    remaining: int = 1000,
    room: int = 10**6,
    drafter_room: int | None = None,
    history: AcceptanceHistory | None = None,
) -> RequestView:
    return RequestView(rid, ctx, remaining, room, drafter_room, history)


def test_table_policy_constant():
    decision = TablePolicy(build_spec_plan("ngram", 3, None)).decide(
        StepView((req("a"), req("b")), num_reqs=2)
    )
    assert decision.k == 3
    assert decision.per_request == {"a": 3, "b": 3}
    assert decision.reasons == {}


def test_batch_axis_counts_prefill_requests():
    plan = build_spec_plan("ngram", 8, "[[1, 2, 5], [3, null, 1]]")
    policy = TablePolicy(plan)
    # Two decoding requests plus one prefill chunk: the step has 3 requests.
    assert policy.decide(StepView((req("a"), req("b")), num_reqs=3)).k == 1
    assert policy.decide(StepView((req("a"), req("b")), num_reqs=2)).k == 5


def test_context_statistic_is_the_rounded_up_mean_of_decoding_requests():
    assert context_statistic(()) == 1
    assert context_statistic((req("a", ctx=100), req("b", ctx=201))) == 151
    policy = TablePolicy(build_spec_plan("ngram", 0, GRID))
    # Mean 512 -> first ctx column; mean 512.5 -> rounded up to 513 -> second column.
    d = policy.decide(StepView((req("a", ctx=24), req("b", ctx=1000)), num_reqs=2))
    assert (d.ctx_stat, d.k) == (512, 4)
    d = policy.decide(StepView((req("a", ctx=25), req("b", ctx=1000)), num_reqs=2))
    assert (d.ctx_stat, d.k) == (513, 6)


def test_grid_lookup_by_batch_and_context():
    policy = TablePolicy(build_spec_plan("ngram", 0, GRID))
    cases = {(1, 512): 4, (4, 513): 6, (5, 512): 2, (16, 10_000): 3, (17, 1): 0, (200, 600): 1}
    for (b, c), k in cases.items():
        assert policy.decide(StepView((req("a", ctx=c),), num_reqs=b)).k == k, (b, c)


def test_schedule_zero_reason():
    plan = build_spec_plan("ngram", 4, "[[1, 8, 4], [9, null, 0]]")
    d = TablePolicy(plan).decide(StepView((req("a"), req("b")), num_reqs=9))
    assert d.k == 0
    assert d.per_request == {"a": 0, "b": 0}
    assert d.reasons == {"a": "schedule_zero", "b": "schedule_zero"}


def test_drafter_length_skips_only_the_long_request():
    # A mixed batch: one request would overflow the drafter, the short ones keep drafting.
    plan = build_spec_plan("draft", 4, None)
    view = StepView((req("short1", drafter_room=500), req("long", ctx=2040, drafter_room=2),
                     req("short2"), req("edge", drafter_room=4)), num_reqs=4)
    d = TablePolicy(plan).decide(view)
    assert d.k == 4
    assert d.per_request == {"short1": 4, "long": 0, "short2": 4, "edge": 4}
    assert d.reasons == {"long": "drafter_length"}


def test_max_tokens_cap():
    plan = build_spec_plan("ngram", 4, None)
    view = StepView(
        (req("a", remaining=3), req("b", remaining=1), req("c", remaining=5), req("d")), num_reqs=4
    )
    d = TablePolicy(plan).decide(view)
    # A verify emits up to k+1 tokens: remaining 3 -> 2 drafts, remaining 1 -> none, remaining 5 ->
    # all 4.
    assert d.per_request == {"a": 2, "b": 0, "c": 4, "d": 4}
    assert d.reasons == {"a": "max_tokens", "b": "max_tokens"}


def test_max_model_len_cap():
    plan = build_spec_plan("ngram", 4, None)
    view = StepView((req("a", room=3), req("b", room=1), req("c", room=2, remaining=2)), num_reqs=3)
    d = TablePolicy(plan).decide(view)
    assert d.per_request == {"a": 2, "b": 0, "c": 1}
    # Equal caps: the first binding limit (max_tokens) is the one reported.
    assert d.reasons == {"a": "max_model_len", "b": "max_model_len", "c": "max_tokens"}


def test_length_cap_keeps_drafting_when_it_fits_the_drafter():
    # Cap 2 (max_tokens) fits a drafter with room for 3, although room < k.
    d = TablePolicy(build_spec_plan("draft", 4, None)).decide(
        StepView((req("a", remaining=3, drafter_room=3),), num_reqs=1))
    assert d.per_request == {"a": 2} and d.reasons == {"a": "max_tokens"}


def test_step_view_validation():
    with pytest.raises(ValueError, match="num_reqs"):
        StepView((req("a"), req("b")), num_reqs=1)
    with pytest.raises(ValueError, match="duplicate"):
        StepView((req("a"), req("a")), num_reqs=2)


def test_empty_step():
    d = TablePolicy(build_spec_plan("ngram", 2, None)).decide(StepView((), num_reqs=3))
    assert (d.k, d.per_request, d.ctx_stat) == (2, {}, 1)


# ---- acceptance history -------------------------------------------------------------------------

def test_history_conditional_rates():
    h = AcceptanceHistory(alpha=0.5)
    h.update(4, 2)  # positions 0, 1 accepted; 2 rejected; 3 never reached
    assert h.rates == [1.0, 1.0, 0.0]
    h.update(2, 0)  # position 0 rejected; 1 not reached
    assert h.rates == [0.5, 1.0, 0.0]
    h.update(0, 0)  # nothing verified: no information
    assert h.num_updates == 2
    assert h.rate(10) == 0.0  # unreached positions reuse the deepest observed rate
    assert h.expected_accepted(2) == pytest.approx(0.5 + 0.5 * 1.0)


def test_history_rejects_impossible_updates():
    with pytest.raises(ValueError):
        AcceptanceHistory().update(2, 3)
    with pytest.raises(ValueError):
        AcceptanceHistory(alpha=0.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=30))
def test_history_expected_accepted_is_bounded_and_monotone(updates):
    h = AcceptanceHistory()
    for drafted, accepted in updates:
        h.update(drafted, min(accepted, drafted))
    values = [h.expected_accepted(k) for k in range(8)]
    assert all(0.0 <= r <= 1.0 for r in h.rates)
    assert all(0.0 <= v <= k for k, v in enumerate(values))
    assert values == sorted(values)


# ---- adaptive -----------------------------------------------------------------------------------

def _history(drafted: int, accepted: int, times: int = 5) -> AcceptanceHistory:
    h = AcceptanceHistory()
    for _ in range(times):
        h.update(drafted, accepted)
    return h


def test_adaptive_without_history_uses_the_table_cap():
    plan = build_spec_plan("ngram", 4, None)
    d = AdaptivePolicy(plan).decide(
        StepView((req("a"), req("b", history=AcceptanceHistory())), num_reqs=2)
    )
    assert d.per_request == {"a": 4, "b": 4} and d.reasons == {}


def test_adaptive_lowers_k_for_poor_acceptance_and_keeps_it_for_good():
    plan = build_spec_plan("ngram", 4, None)
    view = StepView(
        (req("good", history=_history(4, 4)), req("poor", history=_history(4, 0))), num_reqs=2
    )
    d = AdaptivePolicy(plan).decide(view)
    assert d.k == 4
    assert d.per_request == {"good": 4, "poor": 1}  # min_k keeps the history learning
    assert d.reasons == {"poor": "adaptive"}


def test_adaptive_uses_measured_costs():
    plan = build_spec_plan("ngram", 4, None)
    h = _history(4, 2)  # rates [1, 1, 0]: two drafts are worth it, more are not
    cheap = AdaptivePolicy(plan, cost_per_width={1: 1.0, 5: 1.0}).decide(
        StepView((req("a", history=h),), 1)
    )
    assert cheap.per_request == {"a": 2}  # ties (3, 4 equal value) go to the smaller k
    costly = AdaptivePolicy(plan, cost_per_width={1: 1.0, 2: 3.0}).decide(
        StepView((req("a", history=h),), 1)
    )
    assert costly.per_request == {"a": 1}


def test_adaptive_never_exceeds_the_hard_caps():
    plan = build_spec_plan("draft", 6, None)
    view = StepView((req("a", remaining=3, history=_history(6, 6)),
                     req("b", drafter_room=1, history=_history(6, 6))), num_reqs=2)
    d = AdaptivePolicy(plan).decide(view)
    assert d.per_request == {"a": 2, "b": 0}
    assert d.reasons == {"a": "max_tokens", "b": "drafter_length"}


def test_adaptive_cost_validation():
    plan = build_spec_plan("ngram", 4, None)
    with pytest.raises(ValueError):
        AdaptivePolicy(plan, cost_per_width={1: 0.0})
    with pytest.raises(ValueError):
        AdaptivePolicy(plan, cost_per_width={})
    policy = AdaptivePolicy(plan, cost_per_width={2: 2.0, 4: 3.0})
    assert policy.cost(3) == pytest.approx(2.5) and policy.cost(6) == pytest.approx(4.0)
    assert AdaptivePolicy(plan, cost_per_width={2: 2.0}).cost(4) == pytest.approx(4.0)


def test_make_policy():
    plan = build_spec_plan("ngram", 2, None)
    assert isinstance(make_policy(plan, "table"), TablePolicy)
    assert isinstance(make_policy(plan, "adaptive"), AdaptivePolicy)
    with pytest.raises(ValueError, match="unknown k_policy"):
        make_policy(plan, "tuned-ish")


def test_every_reason_a_policy_gives_is_a_known_skip_reason():
    # One list (metrics.records.SKIP_REASONS): a reason the policy sets must fold without error.
    from dynaspec.metrics.records import SKIP_REASONS, RequestStepSpec, StepStats
    from dynaspec.metrics.stats import SpecCounters, fold_step

    views = (req("zero_left", remaining=1), req("room", room=1), req("drafter", drafter_room=0),
             req("poor", history=_history(4, 0)), req("fine"))
    reasons = set()
    for plan in (
        build_spec_plan("ngram", 4, None),
        build_spec_plan("ngram", 0, "[[1, 8, 0], [9, 64, 2]]"),
    ):
        for policy in (TablePolicy(plan), AdaptivePolicy(plan, min_k=0)):
            reasons |= set(policy.decide(StepView(views, num_reqs=len(views))).reasons.values())
    assert reasons == {"max_tokens", "max_model_len", "drafter_length", "adaptive", "schedule_zero"}
    assert reasons <= SKIP_REASONS
    specs = tuple(RequestStepSpec(f"r{i}", 0, 0, 1, why) for i, why in enumerate(sorted(reasons)))
    counters = fold_step(
        SpecCounters(),
        StepStats(
            k=0,
            requests=specs,
            draft_seconds=0.0,
            verify_seconds=0.0,
            schedule_seconds=0.0,
            num_prompt_tokens=0,
            num_generation_tokens=len(specs),
            num_preemptions=0,
        ),
    )
    assert dict(counters.draft_skips) == {why: 1 for why in reasons}
