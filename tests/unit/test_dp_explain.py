"""`dynaspec schedule explain --data-parallel-size N` says how the plan applies across ranks."""

from __future__ import annotations

import io
import json

from dynaspec.cli.main import build_parser


def _explain(*argv: str) -> tuple[int, str, str]:
    args = build_parser().parse_args(["schedule", "explain", *argv])
    out, err = io.StringIO(), io.StringIO()
    from dynaspec.cli.schedule_cmd import explain

    return explain(args, out, err), out.getvalue(), err.getvalue()


def test_seed_case_keeps_k2_under_dp():
    rc, out, _ = _explain("--num-spec-tokens", "3", "--k-schedule", "[[1,8,2],[9,64,2]]",
                          "--k-policy", "table", "--data-parallel-size", "2")
    assert rc == 0 and "plan: constant(2)" in out
    assert "no fallback to the raw maximum" in out and "runs K=2 on every rank" in out


def test_seed_case_under_default_flags_is_the_table():
    # The seed: raw maximum 3, every entry resolving to 2. auto + an explicit schedule runs the
    # table, so K=2 on every rank and every step (goodput would also run K=0 steps).
    rc, out, _ = _explain("--num-spec-tokens", "3", "--k-schedule", "[[1,8,2],[9,64,2]]",
                          "--data-parallel-size", "2")
    assert rc == 0 and "plan: constant(2)" in out and "runs K=2 on every rank" in out


def test_variable_plan_under_dp_names_the_global_view():
    rc, out, _ = _explain("--num-spec-tokens", "3", "--k-schedule", "[[1,4,3],[5,64,1]]",
                          "--k-policy", "goodput", "--data-parallel-size", "3", "--json")
    dp = json.loads(out)["data_parallel"]
    assert dp["size"] == 3 and "all ranks together" in dp["text"] and "goodput" in dp["text"]


def test_no_dp_and_bad_size():
    assert "data parallel: off" in _explain("--num-spec-tokens", "2")[1]
    rc, _, err = _explain("--num-spec-tokens", "2", "--data-parallel-size", "0")
    assert rc == 2 and "--data-parallel-size" in err
