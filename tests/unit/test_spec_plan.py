"""SpecPlan: clamping, classification, lookups at every boundary, `schedule explain`, and the
property that explain's table agrees with the policy's lookup for any valid schedule."""

from __future__ import annotations

import argparse
import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynaspec.cli import schedule_cmd
from dynaspec.config import SpecConfig
from dynaspec.spec_decode.plan.plan import (
    ScheduleError,
    SpecPlan,
    build_spec_plan,
    plan_from_config,
)
from dynaspec.spec_decode.policy.k_policy import RequestView, StepView, TablePolicy


def test_no_schedule_is_constant_num_spec_tokens():
    plan = build_spec_plan("ngram", 4, None)
    assert (plan.kind, plan.max_k, plan.widths, plan.uniform_width) == ("constant", 4, (5,), 5)
    assert plan.table == ((1, None, 1, None, 4),)
    assert plan.speculating and not plan.clamped


def test_no_schedule_and_zero_tokens_is_always_zero():
    plan = build_spec_plan("ngram", 0, None)
    assert (plan.kind, plan.max_k, plan.widths, plan.uniform_width) == ("always_zero", 0, (1,), 1)
    assert not plan.speculating


def test_speculator_none_is_off():
    plan = build_spec_plan("none", 0, None)
    assert (plan.kind, plan.max_k, plan.widths, plan.uniform_width) == ("off", 0, (1,), 1)
    assert not plan.speculating and plan.k_for(64, 10_000) == 0
    assert plan == SpecPlan.off()


@pytest.mark.parametrize(
    "tokens,schedule,flag", [(0, "[[1, 8, 4]]", "--k-schedule"), (3, None, "--num-spec-tokens 3")]
)
def test_speculator_none_with_speculation_settings_is_an_error(tokens, schedule, flag):
    with pytest.raises(ScheduleError, match=flag):
        build_spec_plan("none", tokens, schedule)


def test_one_entry():
    plan = build_spec_plan("ngram", 4, "[[1, 16, 3]]")
    assert (plan.kind, plan.max_k, plan.widths) == ("constant", 3, (4,))
    assert plan.table == ((1, None, 1, None, 3),)
    assert plan.k_for(1, 1) == plan.k_for(1000, 10**6) == 3


def test_same_k_entries_are_constant():
    plan = build_spec_plan("ngram", 4, "[[1, 8, 2], [9, 16, 2], [17, 32, 2]]")
    assert (plan.kind, plan.max_k, plan.uniform_width) == ("constant", 2, 3)
    assert not plan.clamped  # nothing lowered, and the raw table was already uniform


def test_entries_clamped_to_one_k_normalise_to_constant():
    # The example: --num-spec-tokens 3 with [[1,8,5],[9,16,4]] -> constant(3).
    plan = build_spec_plan("ngram", 3, "[[1, 8, 5], [9, 16, 4]]")
    assert (plan.kind, plan.max_k, plan.widths, plan.uniform_width) == ("constant", 3, (4,), 4)
    assert [r.k for r in plan.table] == [3, 3]
    text = "\n".join(plan.clamped)
    assert "entry 0 [1, 8, 5]: K 5 -> 3" in text and "entry 1 [9, 16, 4]: K 4 -> 3" in text
    assert "constant(3)" in text


def test_variable():
    plan = build_spec_plan("ngram", 8, "[[1, 4, 6], [5, 16, 3], [17, 64, 1]]")
    assert (plan.kind, plan.max_k, plan.widths, plan.uniform_width) == (
        "variable",
        6,
        (2, 4, 7),
        None,
    )
    assert plan.speculating


def test_all_zero_is_always_zero():
    plan = build_spec_plan("ngram", 4, "[[1, 8, 0], [9, 16, 0]]")
    assert (plan.kind, plan.max_k, plan.widths, plan.uniform_width) == ("always_zero", 0, (1,), 1)
    assert not plan.speculating


def test_zero_entries_mixed_with_positive_are_variable():
    plan = build_spec_plan("ngram", 4, "[[1, 8, 4], [9, 32, 0]]")
    assert (plan.kind, plan.max_k, plan.widths) == ("variable", 4, (1, 5))
    assert plan.k_for(8, 1) == 4 and plan.k_for(9, 1) == 0


def test_zero_num_spec_tokens_lets_the_schedule_set_the_maximum():
    plan = build_spec_plan("ngram", 0, "[[1, 8, 7], [9, 16, 2]]")
    assert (plan.kind, plan.max_k) == ("variable", 7)
    assert not plan.clamped


def test_drafter_limit_clamps_below_num_spec_tokens():
    plan = build_spec_plan("draft", 8, "[[1, 8, 6], [9, 16, 2]]", drafter_max_k=3)
    assert (plan.kind, plan.max_k, plan.widths) == ("variable", 3, (3, 4))
    assert any("drafter limit 3" in c for c in plan.clamped)
    assert build_spec_plan("draft", 4, None, drafter_max_k=0).kind == "always_zero"


def test_variable_max_k_below_num_spec_tokens():
    # KV lookahead follows the plan's max, not the raw flag.
    plan = build_spec_plan("ngram", 8, "[[1, 4, 4], [5, null, 2]]")
    assert plan.max_k == 4 and plan.max_width == 5


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_bad_num_spec_tokens(bad):
    with pytest.raises(ValueError, match="num_spec_tokens"):
        build_spec_plan("ngram", bad, None)


def test_lookups_at_every_batch_boundary():
    plan = build_spec_plan("ngram", 8, "[[1, 1, 6], [2, 4, 5], [5, 16, 3], [17, 64, 1]]")
    expect = {1: 6, 2: 5, 4: 5, 5: 3, 16: 3, 17: 1, 64: 1, 65: 1, 10_000: 1}
    assert {b: plan.k_for(b, 1) for b in expect} == expect
    assert plan.k_for(0, 0) == 6  # below range: looked up as 1


def test_lookups_at_every_grid_boundary():
    rows = [[1, 4, 1, 512, 4], [1, 4, 513, 4096, 6], [1, 4, 4097, 8192, 2],
            [5, 8, 1, 512, 2], [5, 8, 513, 4096, 3], [5, 8, 4097, 8192, 0]]
    plan = build_spec_plan("ngram", 0, json.dumps(rows))
    assert plan.kind == "variable" and plan.max_k == 6
    cases = {
        (1, 1): 4,
        (4, 512): 4,
        (1, 513): 6,
        (4, 4096): 6,
        (4, 4097): 2,
        (1, 10**6): 2,
        (5, 1): 2,
        (8, 512): 2,
        (5, 513): 3,
        (8, 4096): 3,
        (5, 4097): 0,
        (100, 8192): 0,
        (9, 100): 2,
    }
    assert {bc: plan.k_for(*bc) for bc in cases} == cases


def test_tuned_table_plan():
    tuned = {
        "grid": [
            [1, 4, 1, 1024, 4],
            [1, 4, 1025, None, 6],
            [5, None, 1, 1024, 2],
            [5, None, 1025, None, 3],
        ],
        "measurements": {"goodput": [1.0, 2.0]},
    }
    plan = build_spec_plan("ngram", 5, json.dumps(tuned))
    assert (plan.kind, plan.max_k, plan.widths) == ("variable", 5, (3, 4, 5, 6))
    assert any("grid entry 1" in c and "K 6 -> 5" in c for c in plan.clamped)
    assert plan.k_for(2, 2000) == 5 and plan.k_for(6, 2000) == 3


def test_plan_is_immutable_and_hashable():
    plan = build_spec_plan("ngram", 3, None)
    with pytest.raises(AttributeError):
        plan.max_k = 5  # type: ignore[misc]
    assert hash(plan) == hash(build_spec_plan("ngram", 3, None))
    assert SpecPlan.constant(3) == plan


def test_hand_built_plan_is_checked():
    with pytest.raises(ValueError, match="disagrees"):
        SpecPlan("constant", 3, (4,), ((1, None, 1, None, 2),))
    with pytest.raises(ValueError, match="ordered"):
        SpecPlan("variable", 2, (2, 3), ((5, None, 1, None, 1), (1, 4, 1, None, 2)))
    with pytest.raises(ValueError, match="kind"):
        SpecPlan("dynamic", 0, (1,), ((1, None, 1, None, 0),))


def test_plan_from_config():
    plan = plan_from_config(
        SpecConfig(speculator="ngram", num_spec_tokens=3, k_schedule="[[1, 8, 5], [9, 16, 4]]")
    )
    assert plan.kind == "constant" and plan.max_k == 3
    assert plan_from_config(SpecConfig()).kind == "off"


def test_to_json_fields():
    data = build_spec_plan("ngram", 4, "[[1, 8, 4], [9, 16, 0]]").to_json()
    assert data["kind"] == "variable" and data["max_k"] == 4 and data["widths"] == [1, 5]
    assert data["table"] == [[1, 8, 1, None, 4], [9, None, 1, None, 0]]
    assert json.loads(json.dumps(data)) == data


# ---- schedule explain -------------------------------------------------------------------------

def _run_cli(argv):
    parser = argparse.ArgumentParser(prog="dynaspec")
    schedule_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_explain_json(capsys):
    rc = _run_cli(
        [
            "schedule",
            "explain",
            "--num-spec-tokens",
            "3",
            "--k-schedule",
            "[[1,8,5],[9,16,4]]",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert data["kind"] == "constant" and data["max_k"] == 3 and data["widths"] == [4]
    assert data["table"] == [[1, 8, 1, None, 3], [9, None, 1, None, 3]]
    assert any("K 5 -> 3" in c for c in data["clamped"])


def test_explain_text(capsys):
    rc = _run_cli(
        [
            "schedule",
            "explain",
            "--num-spec-tokens",
            "4",
            "--k-schedule",
            "[[1,8,1,512,6],[1,8,513,null,2],[9,16,1,512,3],[9,16,513,null,0]]",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "plan: variable" in out and "verify widths (1+k): 1, 3, 4, 5" in out
    assert "entry 0 [1, 8, 1, 512, 6]: K 6 -> 4" in out
    assert "513+" in out and "9+" in out


def test_explain_invalid_schedule_exits_2(capsys):
    rc = _run_cli(
        [
            "schedule",
            "explain",
            "--num-spec-tokens",
            "4",
            "--k-schedule",
            "[[1,8,4],[10,16,2]]",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""
    assert "entry 1 [10, 16, 2]" in captured.err and "gap" in captured.err


def test_explain_speculator_none_conflict_exits_2(capsys):
    rc = _run_cli(["schedule", "explain", "--speculator", "none", "--k-schedule", "[[1,8,4]]"])
    assert rc == 2 and "--speculator" in capsys.readouterr().err


def test_explain_without_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        _run_cli(["schedule"])
    assert info.value.code == 2


# ---- property: explain's table == policy lookup == an independent oracle ------------------------

@st.composite
def _axis(draw, max_width):
    widths = draw(st.lists(st.integers(1, max_width), min_size=1, max_size=4))
    ranges, lo = [], 1
    for w in widths:
        ranges.append((lo, lo + w - 1))
        lo += w
    last_hi = draw(st.sampled_from(["stated", "null", "beyond"]))
    lo_last, hi_last = ranges[-1]
    ranges[-1] = (lo_last, {"stated": hi_last, "null": None, "beyond": hi_last + 7}[last_hi])
    return ranges


@st.composite
def schedules(draw):
    """A valid schedule (JSON value) and an oracle raw_k(batch, ctx)."""
    form = draw(st.sampled_from(["constant", "batch", "grid", "tuned"]))
    if form == "constant":
        k = draw(st.integers(0, 9))
        return k, (lambda b, c: k), 3, 3
    batch = draw(_axis(6))
    ctx = draw(_axis(8)) if form != "batch" else [(1, None)]
    ks = [[draw(st.integers(0, 9)) for _ in ctx] for _ in batch]
    if form == "batch":
        rows = [[b[0], b[1], ks[i][0]] for i, b in enumerate(batch)]
    else:
        rows = [
            [b[0], b[1], c[0], c[1], ks[i][j]]
            for i, b in enumerate(batch)
            for j, c in enumerate(ctx)
        ]
    rows = draw(st.permutations(rows))
    value = {"grid": rows, "measurements": {}} if form == "tuned" else rows

    def index(ranges, x):
        return max(i for i, r in enumerate(ranges) if r[0] <= x)

    oracle = lambda b, c: ks[index(batch, b)][index(ctx, c)]  # noqa: E731
    top_b = max(r[0] if r[1] is None else r[1] for r in batch) + 2
    top_c = max(r[0] if r[1] is None else r[1] for r in ctx) + 2
    return value, oracle, top_b, top_c


def _json_lookup(table, b, c):
    hits = [
        r[4]
        for r in table
        if r[0] <= b and (r[1] is None or b <= r[1]) and r[2] <= c and (r[3] is None or c <= r[3])
    ]
    assert len(hits) == 1, f"table covers ({b}, {c}) {len(hits)} times"
    return hits[0]


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(0, 10), st.none() | st.integers(0, 10))
def test_explain_table_agrees_with_policy_lookup(sched, num_spec_tokens, drafter_max_k):
    value, oracle, top_b, top_c = sched
    args = argparse.Namespace(speculator="ngram", num_spec_tokens=num_spec_tokens,
                              k_schedule=json.dumps(value), drafter_max_k=drafter_max_k, json=True)
    out, err = io.StringIO(), io.StringIO()
    assert schedule_cmd.explain(args, out, err) == 0, err.getvalue()
    data = json.loads(out.getvalue())
    policy = TablePolicy(
        build_spec_plan("ngram", num_spec_tokens, json.dumps(value), drafter_max_k)
    )
    ceiling = min(
        [x for x in (num_spec_tokens or None, drafter_max_k) if x is not None], default=None
    )
    seen = set()
    for b in range(1, top_b + 1):
        for c in range(1, top_c + 1):
            k = _json_lookup(data["table"], b, c)
            view = StepView((RequestView("r", c, 1000, 10**6),), num_reqs=b)
            assert policy.decide(view).k == k, (b, c)
            raw = oracle(b, c)
            assert k == (raw if ceiling is None else min(raw, ceiling)), (b, c)
            seen.add(k)
    all_ks = {r[4] for r in data["table"]}
    assert seen == all_ks
    assert data["max_k"] == max(all_ks)
    assert data["widths"] == sorted({1 + k for k in all_ks})
    expected_kind = (
        "always_zero" if all_ks == {0} else "constant" if len(all_ks) == 1 else "variable"
    )
    assert data["kind"] == expected_kind
