"""GoodputPolicy: K = 0 where speculation loses, the model's K where it wins, collapse and
re-probe, per-request caps, and purity."""

from __future__ import annotations

import copy
import pickle

import pytest

from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy, GoodputSettings
from dynaspec.spec_decode.policy.k_policy import RequestView, StepView
from dynaspec.spec_decode.policy.policies import make_policy

WIDTHS = tuple(range(1, 10))


def cost_model(per_width) -> StepCostModel:
    """Cost depends on width only: per_width(w) seconds at every batch and context."""
    grid = CostGrid((1, 64), (1, 4096), WIDTHS)
    return StepCostModel(grid, [[[per_width(w) for w in WIDTHS]] * 2] * 2)


LOSING = cost_model(lambda w: 0.01 * w)  # compute bound: a verified token costs a full step
FREE = cost_model(lambda w: 0.01)  # memory bound: verifying more tokens is free


def view(*reqs: RequestView, num_reqs: int | None = None) -> StepView:
    return StepView(tuple(reqs), num_reqs or len(reqs))


def rv(rid: str, ctx: int = 100, remaining: int = 1000) -> RequestView:
    return RequestView(rid, ctx, remaining, 10**6)


def feed(
    policy: GoodputPolicy, rid: str, drafted: int, accepted: int, ctx: int, times: int = 5
) -> None:
    for _ in range(times):
        policy.observe(rid, drafted, accepted, ctx)


def test_losing_cost_model_gives_k0_everywhere_even_with_perfect_acceptance():
    p = GoodputPolicy(build_spec_plan("ngram", 8, None), LOSING)
    feed(p, "a", 8, 8, ctx=100)
    for n in (1, 4, 64):
        d = p.decide(view(*(rv(f"r{i}") for i in range(n)), rv("a")))
        assert d.k == 0 and set(d.per_request.values()) == {0}
        assert set(d.reasons.values()) == {"adaptive"}


def test_free_verify_with_perfect_acceptance_takes_the_ceiling():
    p = GoodputPolicy(build_spec_plan("ngram", 6, None), FREE)
    feed(p, "a", 6, 6, ctx=100)
    d = p.decide(view(rv("a")))
    assert d.k == 6 and d.per_request == {"a": 6} and d.reasons == {}


def _brute_force_best(rates, cost) -> int:
    best_k, best = 0, 1.0 / cost(1)
    for k in range(1, len(rates) + 1):
        e, surv = 0.0, 1.0
        for i in range(k):
            surv *= rates[i]
            e += surv
        if (1 + e) / cost(1 + k) > best * (1 + 1e-9):
            best_k, best = k, (1 + e) / cost(1 + k)
    return best_k


@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_picks_the_k_the_cost_model_says(accepted):
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731 - each verified token +30%
    p = GoodputPolicy(build_spec_plan("ngram", 4, None), cost_model(per_width))
    feed(p, "a", 4, accepted, ctx=100, times=30)  # history converges to rates 1..1,0
    rates = [p.histories["a"].rate(i) for i in range(4)]
    d = p.decide(view(rv("a")))
    expect = _brute_force_best(rates, per_width)
    if expect == 0:  # drafting does not pay: the request is cut (a probe only when stale)
        assert d.per_request["a"] in (0, 1)
    else:
        assert d.k == expect and d.per_request == {"a": expect}


def test_one_poor_request_is_cut_while_the_good_one_drafts():
    p = GoodputPolicy(
        build_spec_plan("ngram", 4, None), cost_model(lambda w: 0.01 * (1 + 0.2 * (w - 1)))
    )
    feed(p, "good", 4, 4, ctx=100)
    feed(p, "poor", 4, 0, ctx=100)
    d = p.decide(view(rv("good", 101), rv("poor", 101)))
    assert d.per_request["good"] == 4 and d.per_request["poor"] == 0
    assert d.reasons == {"poor": "adaptive"} and d.k == 4


def test_hard_caps_and_the_table_ceiling_still_apply():
    plan = build_spec_plan("ngram", 8, "[[1, 1, 6], [2, null, 2]]")
    p = GoodputPolicy(plan, FREE)
    feed(p, "a", 6, 6, 100)
    feed(p, "b", 6, 6, 100)
    assert p.decide(view(rv("a"))).k == 6
    d = p.decide(view(rv("a"), rv("b", remaining=2)))
    assert d.per_request == {"a": 2, "b": 1} and d.reasons == {"b": "max_tokens"}


def test_allowed_widths_restrict_the_choice():
    p = GoodputPolicy(build_spec_plan("ngram", 6, None), FREE, allowed_widths=(1, 3))
    feed(p, "a", 6, 6, 100)
    assert p.decide(view(rv("a"))).k == 2


def test_new_requests_use_the_engine_prior():
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    p = GoodputPolicy(build_spec_plan("ngram", 4, None), cost_model(per_width))
    feed(p, "old", 4, 4, 100, times=40)  # the engine has seen high acceptance
    p.last_draft_ctx["new"] = 100  # not due a probe: its K comes from the prior alone
    assert p.decide(view(rv("new", 101))).per_request["new"] == 4
    q = GoodputPolicy(build_spec_plan("ngram", 4, None), cost_model(per_width))
    feed(q, "old", 4, 0, 100, times=40)  # ... or has seen none accepted
    q.last_draft_ctx["new"] = 100
    assert q.decide(view(rv("new", 101))).per_request["new"] == 0


@pytest.mark.parametrize("settings", [
    GoodputSettings(), GoodputSettings(drafts_trees=True), GoodputSettings(prices_fallback=True),
    GoodputSettings(whole_cap=True, drafts_trees=True)])
def test_decide_is_pure(settings):
    p = GoodputPolicy(build_spec_plan("ngram", 4, None), cost_model(lambda w: 0.01 * (1 + 0.1 * w)),
                      settings)
    feed(p, "a", 4, 2, 100)
    v = view(rv("a", 120), rv("b", 40), num_reqs=3)
    def state():
        hist = {rid: (h.rates, h.num_updates) for rid, h in p.histories.items()}
        return copy.deepcopy((hist, p.engine_history.rates, p.last_draft_ctx, p.cost_model.seconds))

    before = state()
    every = pickle.dumps(vars(p))
    first = p.decide(v)
    assert all(p.decide(v) == first for _ in range(5))
    assert state() == before
    # Nothing at all is written: no memo, no record of the decision (it is in the StepK).
    assert pickle.dumps(vars(p)) == every


def test_make_policy_auto_is_goodput_and_needs_a_cost_model():
    plan = build_spec_plan("ngram", 4, None)
    assert isinstance(make_policy(plan, "auto", cost_model=FREE), GoodputPolicy)
    # An explicit schedule is an instruction: auto runs it as the table.
    assert (
        type(make_policy(plan, "auto", cost_model=FREE, has_schedule=True)).__name__
        == "TablePolicy"
    )
    with pytest.raises(ValueError, match="cost model"):
        make_policy(plan, "goodput")
    with pytest.raises(ValueError, match="unknown k_policy"):
        make_policy(plan, "fastest")


def test_modelled_and_observed_goodput_are_paired_per_decode_step():
    p = GoodputPolicy(build_spec_plan("ngram", 4, None), FREE)
    assert p.goodput_report() == (None, None)
    d = p.decide(view(rv("a")))
    assert d.modelled_goodput == d.goodput_by_k[d.k]  # the decision carries its report
    p.observe_step(1, 100, 5, 0.02, 0.0, 4, 3, modelled_goodput=d.modelled_goodput)
    modelled, observed = p.goodput_report()
    assert modelled == pytest.approx(d.modelled_goodput) and observed == pytest.approx(150.0)


SEED_SCHEDULE = ["--num-spec-tokens", "3", "--k-schedule", "[[1,8,5],[9,16,4]]"]


@pytest.mark.parametrize("flags, policy, kind, widths", [
    (["--num-spec-tokens", "4"], "goodput", "variable", [1, 2, 3, 4, 5]),
    (["--num-spec-tokens", "4", "--k-policy", "table"], "table", "constant", [5]),
    (["--speculator", "none"], None, "off", [1]),
    (SEED_SCHEDULE, "table", "constant", [4]),  # auto + a schedule: width 4 on every step
    (SEED_SCHEDULE + ["--k-policy", "goodput"], "goodput", "variable", [1, 2, 3, 4]),
])
def test_schedule_explain_json_names_the_policy_and_the_widths_that_run(
    flags, policy, kind, widths
):
    import io
    import json

    from dynaspec.cli.main import build_parser
    from dynaspec.cli.schedule_cmd import explain

    args = build_parser().parse_args(["schedule", "explain", "--json", *flags])
    out, err = io.StringIO(), io.StringIO()
    assert explain(args, out, err) == 0
    got = json.loads(out.getvalue())
    assert got["policy"] == policy and got["kind"] == kind and got["widths"] == widths
    # The execution grid is built from the same plan: it covers exactly those widths.
    if got["execution"] is not None:
        assert got["execution"]["widths"] == widths


def test_synthetic_mode_prices_requests_at_the_simulated_acceptance():
    per_width = lambda w: 0.01 * (1 + 0.1 * (w - 1))  # noqa: E731 - a memory-bound machine
    plan = build_spec_plan("ngram", 4, None)
    strict = GoodputPolicy(plan, cost_model(per_width))
    feed(strict, "a", 4, 0, ctx=100, times=10)  # an n-gram that never matches the target
    strict.last_draft_ctx["a"] = 100
    assert strict.decide(view(rv("a", 101))).per_request["a"] == 0
    synthetic = GoodputPolicy(plan, cost_model(per_width),
                              GoodputSettings(synthetic_rates=(0.7,)))
    feed(synthetic, "a", 4, 0, ctx=100, times=10)  # its own history is ignored: 0.7 is known
    synthetic.last_draft_ctx["a"] = 100
    assert synthetic.decide(view(rv("a", 101))).k == 4


def _guarded(learn: bool = True) -> GoodputPolicy:
    """A table that says wide steps cost 10x (so K=0), on a machine where they do not."""
    m = cost_model(lambda w: 0.01 if w == 1 else 0.1)
    m.learn = learn
    s = GoodputSettings(divergence_steps=4, reprobe_interval=10)
    return GoodputPolicy(build_spec_plan("ngram", 4, None), m, s)


def test_divergence_guard_reprobes_a_wide_step_at_a_bounded_rate():
    p = _guarded()
    feed(p, "a", 4, 4, ctx=100)
    p.last_draft_ctx["a"] = 100  # no per-request probe due: only the guard can draft
    ks = []
    for _ in range(40):
        d = p.decide(view(rv("a", 101)))
        ks.append(d.k)
        # The machine: every step takes 10 ms whatever its width. The EMAs are then pinned 4x
        # apart (> the bound 2), as a poisoned table's would stay while nothing refreshes it.
        p.observe_step(1, 101, 1 + d.k, 0.01, 0.0, d.k, 1 + d.k,
                       modelled_goodput=d.modelled_goodput)
        p.modelled_goodput, p.observed_goodput = 100.0, 400.0
    reprobes = [i for i, k in enumerate(ks) if k > 0]
    assert reprobes, "the guard must run a K>0 step when the model keeps choosing K=0"
    assert all(b - a >= 10 for a, b in zip(reprobes, reprobes[1:]))  # at a bounded rate
    assert p.num_reprobes == len(reprobes)


def test_divergence_guard_is_off_for_a_fixed_table():
    p = _guarded(learn=False)
    for _ in range(40):
        d = p.decide(view(rv("a", 101)))
        assert d.k == 0
        p.observe_step(1, 101, 1, 0.01, 0.0, 0, 1, modelled_goodput=d.modelled_goodput)
        p.modelled_goodput, p.observed_goodput = 100.0, 400.0
    assert p.num_reprobes == 0


def test_prometheus_exports_goodput_gauges():
    pytest.importorskip("prometheus_client")
    from dynaspec.metrics.prometheus import PrometheusMetrics
    from dynaspec.metrics.records import EngineSnapshot

    m = PrometheusMetrics()
    m.observe_snapshot(
        EngineSnapshot(
            num_running=0,
            num_waiting=0,
            kv_usage=0.0,
            kv_pool_tokens_target=16,
            kv_pool_tokens_drafter=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions_total=0,
            modelled_goodput=120.5,
            observed_goodput=98.25,
            k_policy="goodput",
            k_policy_reprobes=3,
        )
    )
    text = m.render().decode()
    assert 'dynaspec:k_policy_info{policy="goodput"} 1.0' in text
    assert "dynaspec:k_policy_reprobes 3.0" in text
    assert 'dynaspec:k_policy_goodput_tokens_per_second{kind="modelled"} 120.5' in text
    assert 'dynaspec:k_policy_goodput_tokens_per_second{kind="observed"} 98.25' in text


def test_step_k_is_always_a_width_the_plan_runs():
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    p = GoodputPolicy(
        build_spec_plan("ngram", 4, None), cost_model(per_width), allowed_widths=(1, 5)
    )
    feed(p, "poor", 4, 0, ctx=10)  # cut, and due a one-draft probe at ctx 26
    d = p.decide(view(rv("poor", 26)))
    assert d.per_request == {"poor": 1} and d.k == 4  # the probe rides a width-5 step


def _short_drafter(p: GoodputPolicy, rid: str = "a") -> None:
    """A suffix-like drafter under a cap of 8: usually one draft (accepted 2 times in 3), every
    fourth step a long one mostly accepted."""
    for i in range(40):
        if i % 4 == 0:
            p.observe(rid, 8, 6, 100, 8)
        else:
            p.observe(rid, 1, 0 if i % 3 == 0 else 1, 100, 8)


@pytest.mark.parametrize("follow, expect", [(True, 6), (False, 1)])
def test_a_drafter_that_stops_short_is_priced_at_the_widths_it_runs(follow, expect):
    """On the eager path a cap the drafter does not fill costs nothing, so a drafter that is
    usually short but right when long gets a wide cap; a padded path pays the cap's width."""
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    p = GoodputPolicy(build_spec_plan("suffix", 8, None), cost_model(per_width),
                      GoodputSettings(widths_follow_drafts=follow))
    _short_drafter(p)
    assert p.lengths["a"].rates[0] < 0.2  # it learned the drafter usually stops after one
    d = p.decide(view(rv("a")))
    assert d.k == expect and d.per_request == {"a": expect}
    p.forget("a")
    assert p.num_cached() == 0


def test_draft_lengths_without_a_cap_are_not_learned():
    p = GoodputPolicy(build_spec_plan("suffix", 8, None), FREE)
    p.observe("a", 2, 2, 100)  # cap unknown (0): acceptance only
    assert "a" not in p.lengths and p.histories["a"].num_updates == 1


def test_a_self_sizing_drafter_gets_its_whole_cap_or_none():
    """Suffix drafts end where their evidence does: the policy chooses between no drafts and
    the ceiling, never a cut in between (which would only cut the drafts it was sure of)."""
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    settings = GoodputSettings(whole_cap=True)
    p = GoodputPolicy(build_spec_plan("suffix", 8, None), cost_model(per_width), settings)
    feed(p, "a", 8, 2, ctx=100, times=30)  # the rates alone would pick a small K
    free = GoodputPolicy(build_spec_plan("suffix", 8, None), cost_model(per_width))
    feed(free, "a", 8, 2, ctx=100, times=30)
    assert 0 < free.decide(view(rv("a"))).k < 8
    assert p.decide(view(rv("a"))).k in (0, 8)
    feed(p, "b", 8, 8, ctx=100, times=30)
    assert p.decide(view(rv("b"))).per_request == {"b": 8}
    assert GoodputPolicy(
        build_spec_plan("suffix", 8, None), LOSING, settings).decide(view(rv("b"))).k == 0


def test_a_cold_first_draft_does_not_price_the_drafter_out_for_good():
    """The draft cost is the median of recent drafting steps, 0 until three exist: an EAGLE
    head's first draft (which also feeds it the whole prompt) cost ~5x its steady cost, and an
    EMA seeded by it held K at 0, so no later draft could correct it."""
    cheap = cost_model(lambda w: 0.01 * (1 + 0.05 * (w - 1)))
    p = GoodputPolicy(build_spec_plan("ngram", 4, None), cheap)
    feed(p, "a", 4, 3, ctx=100)
    p.observe_step(1, 100, 5, 0.01, 0.5, 4, 4)  # 0.125 s a drafted token: 12x a step
    assert p.draft_seconds_per_token == 0.0 and p.decide(view(rv("a"))).k > 0
    for _ in range(2):
        p.observe_step(1, 100, 5, 0.01, 0.0004, 4, 4)
    assert p.draft_seconds_per_token == pytest.approx(0.0001)
    assert p.decide(view(rv("a"))).k > 0
    for _ in range(3):  # a drafter that really is that slow is priced out once it is measured
        p.observe_step(1, 100, 5, 0.01, 0.5, 4, 4)
    assert p.draft_seconds_per_token == pytest.approx(0.125) and p.decide(view(rv("a"))).k == 0


def test_a_measured_start_up_draft_cost_prices_drafts_until_served_steps_replace_it():
    """draft_cost_prior (an EAGLE head's start-up measurement) is the price before three
    drafting steps exist: a drafter as dear as a step is not drafted with from the first step,
    and served steps' median replaces the prior once measured."""
    cheap = cost_model(lambda w: 0.01 * (1 + 0.05 * (w - 1)))
    plan = build_spec_plan("ngram", 4, None)
    p = GoodputPolicy(plan, cheap, GoodputSettings(draft_cost_prior=0.01))
    feed(p, "a", 4, 3, ctx=100)
    assert p.draft_seconds_per_token == 0.01 and p.decide(view(rv("a"))).k == 0
    q = GoodputPolicy(plan, cheap, GoodputSettings(draft_cost_prior=0.0001))
    feed(q, "a", 4, 3, ctx=100)
    assert q.decide(view(rv("a"))).k > 0  # a cheap prior drafts
    for _ in range(3):
        p.observe_step(1, 100, 5, 0.01, 0.0004, 4, 4)
    assert p.draft_seconds_per_token == pytest.approx(0.0001) and p.decide(view(rv("a"))).k > 0


def test_draft_cost_settings_are_checked():
    with pytest.raises(ValueError, match="draft_cost"):
        GoodputSettings(draft_cost_window=2, draft_cost_min_samples=3)
    with pytest.raises(ValueError, match="draft_cost_prior"):
        GoodputSettings(draft_cost_prior=-1.0)


def test_a_fallback_is_priced_apart_from_the_lookup():
    """Lookup-first drafting: the head's rejected drafts cut the head's own cap, not the
    lookup's, whose matches keep the request's K (one history for both cut the request to 0)."""
    settings = GoodputSettings(prices_fallback=True)
    costs = cost_model(lambda w: 0.01 * (1 + 0.05 * (w - 1)))  # a wider verify costs 5% a row
    p = GoodputPolicy(build_spec_plan("ngram", 3, None), costs, settings)
    shared = GoodputPolicy(build_spec_plan("ngram", 3, None), costs)
    for pol in (p, shared):
        for _ in range(4):  # the lookup matches one step in five (chat), every draft accepted
            pol.observe("a", 3, 3, ctx=100)
            pol.observe_step(1, 100, 4, 0.0115, 0.0, 3, 4)
            for _ in range(4):  # the head drafts the others, rejected, at 2 ms a token
                pol.observe("a", 1, 0, ctx=100, fallback=True)
                pol.observe_step(1, 100, 2, 0.0105, 0.002, 1, 1, fallback_seconds=0.002,
                                 fallback_drafted=1)
    d = p.decide(view(rv("a", ctx=101)))
    assert d.per_request == {"a": 3} and d.fallback == {"a": 0}
    assert shared.decide(view(rv("a", ctx=101))).per_request == {"a": 0}  # the mixed history
    # A head accepted at its first position gets a cap of its own; a probe once it is stale.
    for _ in range(8):
        p.observe("b", 1, 1, ctx=100, fallback=True)
    assert p.decide(view(rv("b", ctx=101))).fallback["b"] >= 1
    assert p.decide(view(rv("a", ctx=100 + settings.probe_interval))).fallback == {"a": 1}
    p.forget("a")
    p.forget("b")
    assert p.num_cached() == 0


def _engine_at(p: GoodputPolicy, rate_tenths: int, times: int, fallback: bool = False) -> None:
    """`times` one-draft steps from other requests, accepted `rate_tenths` in ten."""
    for i in range(times):
        p.observe(f"old{i}", 1, int(i % 10 < rate_tenths), ctx=100, fallback=fallback)
        p.forget(f"old{i}")
