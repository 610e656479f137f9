"""Speculative-decoding counters: each vLLM accounting hazard pinned, the fold property-tested."""

from __future__ import annotations

import json
import logging
import math
import pickle
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaspec.metrics.log_line import PeriodicLogger, format_log_line
from dynaspec.metrics.records import (
    ALL_INVALID,
    INVALID_REASONS,
    SKIP_REASONS,
    EngineSnapshot,
    RequestStepSpec,
    StepStats,
)
from dynaspec.metrics.stats import SpecCounters, fold_request, fold_request_history, fold_step

EMPTY = SpecCounters()


def req(rid, d=0, a=0, e=None, skip=None, invalid=None):
    e = a + 1 if e is None else e
    return RequestStepSpec(rid, d, a, e, skip, invalid or {})


def step(k, *requests, **kw):
    return StepStats(k=k, requests=tuple(requests), **kw)


def fold_all(steps, acc=EMPTY):
    for s in steps:
        acc = fold_step(acc, s)
    return acc


# -- hazards -----------------------------------------------------------------------------------


def test_length_skip_counts_a_skip_not_a_zero_accept_draft():
    c = fold_step(EMPTY, step(4, req("a", 4, 4), req("b", skip="drafter_length", e=1)))
    assert c.num_drafts == 1 and c.num_draft_tokens == 4 and c.num_accepted_tokens == 4
    assert dict(c.draft_skips) == {"drafter_length": 1}
    assert c.acceptance_rate == 1.0  # the skipped request does not drag it down (vLLM #34734)
    assert c.mean_acceptance_length == 5.0
    assert c.drafted_per_pos == (1, 1, 1, 1)
    assert c.check_identities() == []


def test_only_skips_give_no_rate_rather_than_zero():
    c = fold_step(EMPTY, step(4, req("a", skip="drafter_length"), req("b", skip="max_model_len")))
    assert c.num_drafts == 0 and c.num_draft_tokens == 0
    assert c.acceptance_rate is None and c.mean_acceptance_length is None
    d = c.to_dict()
    assert d["acceptance_rate"] is None and d["mean_acceptance_length"] is None
    assert d["draft_skips"] == {"drafter_length": 1, "max_model_len": 1}
    assert c.check_identities() == []


def test_k0_step_is_counted_and_distinct_from_speculation_off():
    k0 = fold_step(EMPTY, step(0, req("a", skip="schedule_zero")))
    off = fold_step(EMPTY, step(None, req("a")))
    assert k0.to_dict()["steps_by_k"] == {"0": 1}
    assert dict(k0.draft_skips) == {"schedule_zero": 1} and k0.num_spec_off_steps == 0
    assert off.to_dict()["steps_by_k"] == {} and off.num_spec_off_steps == 1
    assert dict(off.draft_skips) == {} and off.num_spec_request_steps == 0
    assert k0 != off
    assert k0.num_emitted_tokens == off.num_emitted_tokens == 1
    assert k0.check_identities() == [] and off.check_identities() == []


def test_speculation_off_rejects_draft_accounting():
    with pytest.raises(ValueError, match="k=0"):
        fold_step(EMPTY, step(None, req("a", skip="schedule_zero")))
    with pytest.raises(ValueError, match="speculation is off"):
        fold_request(EMPTY, req("a", 2, 1), None)


def test_invalid_drafts_excluded_from_draft_tokens_and_counted_by_reason():
    r = req("a", 2, 1, invalid={"padding": 2, "grammar": 1})
    c = fold_step(EMPTY, step(5, r))
    assert c.num_draft_tokens == 2 and c.num_drafts == 1 and c.num_accepted_tokens == 1
    assert dict(c.invalid_draft_tokens) == {"grammar": 1, "padding": 2}
    assert c.drafted_per_pos == (1, 1) and c.accepted_per_pos == (1, 0)
    assert c.acceptance_rate == 0.5
    assert c.check_identities() == []


def test_a_drafter_that_labels_its_drafts_is_counted_by_its_labels():
    """--speculator hybrid: drafts and accepted tokens by source ("eagle", "suffix") in place
    of "drafter"; labels that do not add up to the row are refused."""
    hybrid = RequestStepSpec("a", 5, 3, 4, None, {}, num_tree_nodes=5,
                             drafts_by_source=(("suffix", 3, 2), ("eagle", 2, 1)))
    c = fold_all([step(5, hybrid), step(4, req("b", 2, 1))])
    assert dict(c.draft_tokens_by_source) == {"suffix": 3, "eagle": 2, "drafter": 2}
    assert dict(c.accepted_tokens_by_source) == {"suffix": 2, "eagle": 1, "drafter": 1}
    assert c.check_identities() == []
    with pytest.raises(ValueError, match="drafts by source"):
        RequestStepSpec("a", 5, 3, 4, None, {}, drafts_by_source=(("suffix", 3, 2),))
    with pytest.raises(ValueError, match="drafts by source"):
        RequestStepSpec("a", 2, 1, 2, None, {}, drafts_by_source=(("eagle", 1, 0), ("x", 1, 2)))


def test_all_invalid_drafts_do_not_increment_drafts():
    c = fold_step(EMPTY, step(3, req("a", 0, 0, e=1, invalid={"async_placeholder": 3})))
    assert c.num_drafts == 0 and c.num_draft_tokens == 0
    assert dict(c.invalid_draft_tokens) == {"async_placeholder": 3}
    assert dict(c.draft_skips) == {ALL_INVALID: 1}
    assert c.mean_acceptance_length is None
    c2 = fold_step(c, step(3, req("a", 3, 3)))
    assert c2.mean_acceptance_length == 4.0  # the all-invalid step does not lower it (vLLM 4.5.3)
    assert c2.check_identities() == []


def test_eos_inside_accepted_run_counts_accepted_and_emitted_apart():
    # K=5: the verifier accepted 4 drafts, but EOS was the 2nd accepted token: 2 emitted.
    c = fold_step(EMPTY, step(5, req("a", 5, 4, e=2)))
    assert c.num_accepted_tokens == 4 and c.num_emitted_tokens == 2
    assert c.accepted_per_pos == (1, 1, 1, 1, 0)
    assert c.mean_acceptance_length == 5.0  # verifier semantics, as vLLM's Prometheus
    assert c.to_dict()["num_emitted_tokens"] == 2
    assert c.check_identities() == []


def test_per_position_rates_are_conditional_when_k_varies():
    c = fold_all([step(4, req("a", 4, 4)), step(1, req("a", 1, 0)), step(1, req("a", 1, 1))])
    assert c.drafted_per_pos == (3, 1, 1, 1) and c.accepted_per_pos == (2, 1, 1, 1)
    rates = c.acceptance_rate_per_pos
    assert rates[0] == pytest.approx(2 / 3) and rates[1:] == (1.0, 1.0, 1.0)
    assert dict(c.steps_by_k) == {1: 2, 4: 1}


def test_fold_is_pure_and_returns_a_new_accumulator():
    acc = fold_step(EMPTY, step(2, req("a", 2, 1)))
    frozen = pickle.dumps(acc)
    out = fold_step(acc, step(2, req("b", skip="no_match", e=1)))
    assert out is not acc and pickle.dumps(acc) == frozen
    assert out.num_drafts == 1 and dict(out.draft_skips) == {"no_match": 1}
    with pytest.raises(TypeError):
        out.steps_by_k[2] = 5  # type: ignore[index]


def test_to_dict_names_and_json():
    c = fold_all([step(3, req("a", 3, 2, e=1), req("b", skip="prefill", e=0),
                      draft_seconds=0.5, verify_seconds=1.0, schedule_seconds=0.25)])  # fmt: skip
    d = json.loads(json.dumps(c.to_dict()))
    required = {
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
        "accepted_per_pos", "drafted_per_pos", "steps_by_k", "draft_skips",
        "invalid_draft_tokens", "acceptance_rate", "mean_acceptance_length", "draft_seconds",
        "verify_seconds", "scheduler_seconds",
    }  # fmt: skip
    assert required <= set(d)
    assert d["steps_by_k"] == {"3": 1} and d["draft_skips"] == {"prefill": 1}
    assert d["acceptance_rate"] == pytest.approx(2 / 3)
    assert d["mean_acceptance_length"] == 3.0
    assert (d["draft_seconds"], d["verify_seconds"], d["scheduler_seconds"]) == (0.5, 1.0, 0.25)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(request_id="a", num_draft_tokens=2, num_accepted_tokens=3, num_emitted_tokens=1,
              skip_reason=None), "accepted 3 > valid draft tokens 2"),
        (dict(request_id="a", num_draft_tokens=2, num_accepted_tokens=1, num_emitted_tokens=3,
              skip_reason=None), "emitted"),
        (dict(request_id="a", num_draft_tokens=2, num_accepted_tokens=1, num_emitted_tokens=1,
              skip_reason="no_match"), "skip_reason"),
        (dict(request_id="a", num_draft_tokens=0, num_accepted_tokens=0, num_emitted_tokens=1,
              skip_reason="too_long"), "unknown skip_reason"),
        (dict(request_id="a", num_draft_tokens=1, num_accepted_tokens=0, num_emitted_tokens=1,
              skip_reason=None, invalid_draft_tokens={"stale": 1}), "unknown invalid-draft"),
        (dict(request_id="a", num_draft_tokens=-1, num_accepted_tokens=0, num_emitted_tokens=1,
              skip_reason=None), ">= 0"),
        (dict(request_id="a", num_draft_tokens=0, num_accepted_tokens=0, num_emitted_tokens=1,
              skip_reason=ALL_INVALID), "all_invalid"),
    ],
)  # fmt: skip
def test_impossible_request_records_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RequestStepSpec(**kwargs)


def test_step_level_contract_violations_are_rejected():
    with pytest.raises(ValueError, match="no skip_reason"):
        fold_step(EMPTY, step(4, req("a")))
    with pytest.raises(ValueError, match="K=2"):
        fold_step(EMPTY, step(2, req("a", 3, 0)))
    with pytest.raises(ValueError, match="more than once"):
        step(2, req("a", 1, 1), req("a", 1, 0))
    with pytest.raises(ValueError, match="seconds"):
        step(2, draft_seconds=-1.0)


def test_check_identities_reports_violations():
    bad = SpecCounters(num_steps=2, num_request_steps=1, num_spec_request_steps=1, num_drafts=1,
                       num_draft_tokens=2, num_accepted_tokens=3, accepted_per_pos=(1, 1),
                       drafted_per_pos=(1, 1), steps_by_k={2: 1}, num_emitted_tokens=9)  # fmt: skip
    found = " | ".join(bad.check_identities())
    for needle in ("num_accepted_tokens 3 > num_draft_tokens 2", "sum(accepted_per_pos)",
                   "sum(steps_by_k)", "emitted", "accepted_per_pos"):  # fmt: skip
        assert needle in found


def test_counters_pickle_hash_add_sub():
    a = fold_all([step(2, req("a", 2, 1)), step(0, req("a", skip="schedule_zero"))])
    b = fold_all([step(4, req("b", 4, 2, invalid={"grammar": 1}))])
    assert pickle.loads(pickle.dumps(a)) == a and hash(a) == hash(pickle.loads(pickle.dumps(a)))
    assert (a + b) - b == a and (a + b) - a == b
    assert (a + b).drafted_per_pos == (2, 2, 1, 1)


def test_stats_and_log_line_do_not_import_prometheus_client():
    code = (
        "import sys, dynaspec.metrics.stats, dynaspec.metrics.log_line;"
        "assert 'prometheus_client' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- property: the fold never loses a request's counts ------------------------------------------

K_VALUES = st.one_of(st.none(), st.integers(0, 6))
INVALID = st.dictionaries(st.sampled_from(sorted(INVALID_REASONS)), st.integers(0, 3), max_size=3)


@st.composite
def request_for(draw, rid, k):
    if k is None:
        return RequestStepSpec(rid, 0, 0, draw(st.integers(0, 1)), None)
    kinds = ["skip"] + (["draft", "all_invalid"] if k >= 1 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "draft":
        d = draw(st.integers(1, k))
        a = draw(st.integers(0, d))
        return RequestStepSpec(rid, d, a, draw(st.integers(0, a + 1)), None, draw(INVALID))
    if kind == "all_invalid":
        invalid = draw(INVALID.filter(lambda m: sum(m.values()) > 0))
        return RequestStepSpec(rid, 0, 0, draw(st.integers(0, 1)), None, invalid)
    reason = draw(st.sampled_from(sorted(SKIP_REASONS)))
    return RequestStepSpec(rid, 0, 0, draw(st.integers(0, 1)), reason, draw(INVALID))


@st.composite
def steps(draw, ids=("r0", "r1", "r2", "r3", "r4", "r5")):
    k = draw(K_VALUES)
    chosen = draw(st.lists(st.sampled_from(ids), unique=True, max_size=len(ids)))
    requests = tuple(draw(request_for(rid, k)) for rid in chosen)
    secs, toks = st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.integers(0, 50)
    return StepStats(k=k, requests=requests, draft_seconds=draw(secs), verify_seconds=draw(secs),
                     schedule_seconds=draw(secs), num_prompt_tokens=draw(toks),
                     num_generation_tokens=draw(toks), num_preemptions=draw(st.integers(0, 2)))


REQUEST_LEVEL = ("num_request_steps", "num_spec_request_steps", "num_drafts", "num_draft_tokens",
                 "num_accepted_tokens", "num_emitted_tokens", "accepted_per_pos",
                 "drafted_per_pos", "draft_skips", "invalid_draft_tokens")  # fmt: skip


def request_level(c):
    return {name: getattr(c, name) for name in REQUEST_LEVEL}


@settings(max_examples=150, deadline=None)
@given(prefix=st.lists(steps(), max_size=3), s=steps())
def test_fold_of_step_equals_sum_of_per_request_folds(prefix, s):
    acc = fold_all(prefix)
    whole = fold_step(acc, s)
    parts = acc
    for r in s.requests:  # each request folded on its own, then summed
        parts = parts + fold_request(EMPTY, r, s.k)
    assert request_level(whole) == request_level(parts)
    # the step-level census: one step, under its K (or off)
    assert whole.num_steps == acc.num_steps + 1
    if s.k is None:
        assert whole.steps_by_k == acc.steps_by_k
        assert whole.num_spec_off_steps == acc.num_spec_off_steps + 1
    else:
        assert whole.steps_by_k.get(s.k, 0) == acc.steps_by_k.get(s.k, 0) + 1
    assert math.isclose(whole.draft_seconds, acc.draft_seconds + s.draft_seconds)
    assert whole.check_identities() == []


@settings(max_examples=100, deadline=None)
@given(run=st.lists(steps(), max_size=8))
def test_per_request_totals_sum_to_engine_totals(run):
    engine, per_request, history = EMPTY, {}, {}
    for s in run:
        engine = fold_step(engine, s)
        for r in s.requests:
            per_request[r.request_id] = fold_request(per_request.get(r.request_id, EMPTY), r, s.k)
            history.setdefault(r.request_id, []).append((r, s.k))
    total = EMPTY
    for rid, c in per_request.items():
        assert fold_request_history(EMPTY, history[rid]) == c  # fold at finish == every step
        assert c.check_identities() == [], rid
        assert c.num_steps == c.num_request_steps  # per request, a step is a request-step
        total = total + c
    assert request_level(total) == request_level(engine)
    assert engine.check_identities() == []
    assert sum(engine.steps_by_k.values()) + engine.num_spec_off_steps == len(run)
    if engine.num_drafts:
        assert engine.mean_acceptance_length == pytest.approx(
            1 + engine.num_accepted_tokens / engine.num_drafts
        )


# -- log line -----------------------------------------------------------------------------------

SNAP = EngineSnapshot(num_running=3, num_waiting=1, kv_usage=0.5, kv_pool_tokens_target=4096,
                      kv_pool_tokens_drafter=512, prefix_cache_queries=200,
                      prefix_cache_hits=50, num_preemptions_total=0)  # fmt: skip


def test_log_line_reports_interval_values():
    prev = fold_all([step(4, req("a", 4, 0), num_generation_tokens=1)])
    cur = fold_all(
        [step(4, req("a", 4, 4), req("b", skip="drafter_length", e=1), num_generation_tokens=6),
         step(0, req("a", skip="schedule_zero"), req("b", skip="schedule_zero"),
              num_prompt_tokens=20, num_generation_tokens=2)],
        prev,
    )  # fmt: skip
    line = format_log_line(cur, prev, 2.0, SNAP)
    assert "acceptance rate 100.0% (4/4 tokens)" in line  # the interval, not since start
    assert "mean acceptance length 5.00 over 1 drafts" in line
    assert "per-position (conditional) [1.00 1.00 1.00 1.00]" in line
    assert "generation 4.0 tok/s" in line and "prompt 10.0 tok/s" in line
    assert "steps by K {0: 1, 4: 1}" in line
    assert "skips {drafter_length: 1, schedule_zero: 2}" in line
    assert "running 3" in line and "KV 50.0%" in line and "prefix-cache hit rate 25.0%" in line
    assert "drafter 512" in line


def test_log_line_without_drafts_or_speculation():
    skips = fold_all([step(3, req("a", skip="max_tokens"))])
    assert "acceptance rate n/a (no drafts)" in format_log_line(skips, None, 1.0, None)
    off = fold_all([step(None, req("a"), num_generation_tokens=1)])
    line = format_log_line(off, None, 1.0, None)
    assert "Spec:" not in line and "generation 1.0 tok/s" in line


def test_periodic_logger_interval_and_off(caplog):
    clock = iter([0.0, 0.5, 1.5])
    log = PeriodicLogger(1.0, clock=lambda: next(clock))
    c1 = fold_all([step(2, req("a", 2, 2))])
    with caplog.at_level(logging.INFO, logger="dynaspec.metrics"):
        assert log.maybe_log(EMPTY) is None  # starts the clock
        assert log.maybe_log(c1) is None  # 0.5 s < 1 s
        line = log.maybe_log(c1, SNAP)
    assert line is not None and "over 1 drafts" in line
    assert any("over 1 drafts" in rec.getMessage() for rec in caplog.records)
    off = PeriodicLogger(0)
    assert not off.enabled and off.maybe_log(c1, now=100.0) is None
    with pytest.raises(ValueError):
        PeriodicLogger(-1)


def test_request_spec_holds_only_per_request_facts_and_counts_its_k0_steps():
    from dynaspec.metrics.stats import RequestSpecSummary

    history = [
        (RequestStepSpec("r", 0, 0, 1, "schedule_zero"), 0),  # the step's K was 0
        (RequestStepSpec("r", 0, 0, 1, "adaptive"), 4),  # the policy gave this request 0
        (RequestStepSpec("r", 0, 0, 1, "no_match"), 4),  # K=4 for it; the drafter had nothing
        (RequestStepSpec("r", 3, 2, 3, None), 4),
    ]
    d = RequestSpecSummary.of(history, lossless=True).to_json()
    assert d["num_spec_off_steps"] == 2 and d["num_steps"] == 4
    assert not {"draft_seconds", "verify_seconds", "scheduler_seconds"} & set(d)
    assert d["num_drafts"] == 1 and d["steps_by_k"] == {"0": 1, "4": 3}
