"""GoodputPolicy's probes: a request that stopped drafting is re-probed once it is stale, at the
engine's rates once those are known, and a drafter that sizes its own drafts is probed as it
drafts."""

from __future__ import annotations

import pytest

from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy, GoodputSettings
from tests.unit.test_goodput_policy import _engine_at, cost_model, feed, rv, view


def test_collapsed_request_stops_drafting_and_is_reprobed():
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    p = GoodputPolicy(build_spec_plan("ngram", 4, None), cost_model(per_width))
    ctx = 50
    assert p.decide(view(rv("a", ctx))).per_request["a"] > 0  # new: probes on the first decode
    cut_at = None
    for step in range(20):  # acceptance collapses to 0
        d = p.decide(view(rv("a", ctx)))
        if d.per_request["a"] == 0:
            cut_at = step
            break
        p.observe("a", d.per_request["a"], 0, ctx)
        ctx += 1
    assert cut_at is not None and cut_at <= 3, (
        "a request with 0 acceptance must stop within a few steps"
    )
    last = p.last_draft_ctx["a"]  # the context at which it last verified a draft
    interval = p.settings.probe_interval
    for c in range(ctx, last + interval):  # no draft until the probe interval has passed
        assert p.decide(view(rv("a", c))).per_request["a"] == 0
    probe = p.decide(view(rv("a", last + interval)))
    assert probe.per_request["a"] == 1 and probe.k == 1
    feed(p, "a", 1, 1, last + interval, times=6)  # the probe shows recovery: drafting resumes
    assert p.decide(view(rv("a", last + interval + 1))).per_request["a"] >= 1


def test_a_self_sizing_drafter_is_probed_with_its_whole_cap():
    """Suffix drafts end where their evidence does, so a one-draft probe taught only the first
    position and no draft length: on the agentic workload the policy then held K=0 on 98% of
    steps although 0.84 of the drafts it did verify were accepted
    (docs/history/benchmarks-waves-1-4.md)."""
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    p = GoodputPolicy(build_spec_plan("suffix", 8, None), cost_model(per_width),
                      GoodputSettings(whole_cap=True))
    feed(p, "a", 8, 0, ctx=100, times=6)  # cut
    last = p.last_draft_ctx["a"]
    between = p.decide(view(rv("a", last + 1)))  # cut: only a full-depth draft may run
    assert between.per_request["a"] == 8 and between.min_depth == {"a": 8}
    probe = p.decide(view(rv("a", last + p.settings.probe_interval)))
    assert probe.per_request["a"] == 8 and probe.k == 8 and probe.min_depth == {}
    p.observe("a", 3, 3, last + p.settings.probe_interval, cap=8)  # the probe's draft stops at 3
    assert p.lengths["a"].num_updates == 1  # and teaches how far its drafts go


@pytest.mark.parametrize("fallback", [False, True])
def test_a_probe_is_priced_at_the_engines_rates_once_they_are_known(fallback):
    """A new request probes at the optimistic rate while the engine knows little, and not where
    the engine has seen the drafter accepted far below what would pay (an EAGLE head at ~0.3:
    each probe fed the request's prompt to the head for drafts then cut)."""
    settings = GoodputSettings(prices_fallback=fallback)
    costs = cost_model(lambda w: 0.01 * (1 + 0.6 * (w - 1)))  # 0.8 pays at K=1, 0.55 does not

    def probes(times: int, rate_tenths: int) -> int:
        p = GoodputPolicy(build_spec_plan("ngram", 3, None), costs, settings)
        _engine_at(p, rate_tenths, times, fallback)
        engine = p.fallback.engine_history if fallback else p.engine_history
        assert engine.num_updates == times
        d = p.decide(view(rv("new", ctx=101)))
        return d.fallback.get("new", 0) if fallback else d.per_request["new"]

    n = settings.probe_evidence
    assert probes(n - 1, 3) == 1  # too little evidence yet: the optimistic probe
    assert probes(4 * n, 3) == 0  # a drafter at ~0.3: 0.3 + headroom does not pay, no probe
    assert probes(4 * n, 9) >= 1  # a drafter at ~0.9: drafts (its prior pays, or a probe)


def test_probe_settings_are_checked():
    with pytest.raises(ValueError, match="probe_headroom"):
        GoodputSettings(probe_headroom=1.5)
    with pytest.raises(ValueError, match="probe_evidence"):
        GoodputSettings(probe_evidence=-1)


def test_a_new_request_starts_from_what_the_engine_has_seen_once_it_has_seen_enough():
    """From the fixed prior (0.6), a request whose first whole-cap draft was all accepted was
    priced at 0.73 a position and cut, while the engine accepted 0.87-0.99 a position."""
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    settings = GoodputSettings(whole_cap=True)
    p = GoodputPolicy(build_spec_plan("suffix", 8, None), cost_model(per_width), settings)
    early = p.new_history()
    assert early.prior == settings.prior_rate  # too little evidence: the fixed prior
    for i in range(settings.probe_evidence):
        p.observe(f"old{i}", 8, 8 if i % 8 else 6, 100, cap=8)
    h = p.new_history()
    assert h.prior == tuple(p.engine_history.rates) and min(h.prior) > 0.8
    p.observe("new", 8, 8, 100, cap=8)  # one perfect draft at the engine's rates: keep drafting
    assert p.decide(view(rv("new", 109))).per_request["new"] == 8


def test_a_cut_self_sizing_request_verifies_only_full_depth_drafts_between_probes():
    """A suffix draft is as deep as its match: a request cut after misses on short matches
    still verifies a draft whose match runs as deep as its cap (copied text; on agentic suffix
    drafts a failed 2-token draft cut a request through the start of the passage it then
    copied at 8 of 8), and nothing shallower; not where even a probe would not pay, and not
    for a drafter whose drafts are as long as the policy says (a chain drafter's)."""
    per_width = lambda w: 0.01 * (1 + 0.3 * (w - 1))  # noqa: E731
    p = GoodputPolicy(build_spec_plan("suffix", 8, None), cost_model(per_width),
                      GoodputSettings(whole_cap=True))
    feed(p, "a", 8, 0, ctx=100, times=6)
    assert p.decide(view(rv("a", 101))).min_depth == {"a": 8}
    off = GoodputPolicy(build_spec_plan("suffix", 8, None), cost_model(per_width),
                        GoodputSettings(whole_cap=True, strict_probes=False))
    feed(off, "a", 8, 0, ctx=100, times=6)
    d = off.decide(view(rv("a", 101)))
    assert d.per_request["a"] == 0 and d.min_depth == {}
    dear = GoodputPolicy(build_spec_plan("suffix", 8, None),
                         cost_model(lambda w: 0.01 * (1 + 2.0 * (w - 1))),  # width never pays
                         GoodputSettings(whole_cap=True))
    feed(dear, "a", 8, 0, ctx=100, times=6)
    d = dear.decide(view(rv("a", 101)))
    assert d.per_request["a"] == 0 and d.min_depth == {}
    chain = GoodputPolicy(build_spec_plan("ngram", 8, None), cost_model(per_width))
    feed(chain, "a", 8, 0, ctx=100, times=6)
    d = chain.decide(view(rv("a", 101)))
    assert d.per_request["a"] == 0 and d.min_depth == {}
