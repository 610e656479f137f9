"""ExecutionPlan: the grid comes from the SpecPlan, the path from the mode and the admission
table."""

from __future__ import annotations

import json

import pytest

from dynaspec.spec_decode.plan.execution_plan import (
    AdmissionEntry,
    AdmissionTable,
    ExecutionPlan,
    batch_buckets,
    default_admission_path,
)
from dynaspec.spec_decode.plan.plan import SpecPlan, build_spec_plan


def test_buckets_are_powers_of_two_capped_by_max_num_seqs():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(256) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(1) == (1,)


def test_grid_per_plan_kind():
    constant = build_spec_plan("ngram", 3, "[[1, 8, 5], [9, 16, 4]]")
    assert ExecutionPlan.build(constant, 8).grid == ((1, 4), (2, 4), (4, 4), (8, 4))
    variable = build_spec_plan("ngram", 0, "[[1, 2, 4], [3, 8, 2], [9, 64, 0]]")
    assert ExecutionPlan.build(variable, 16).grid == ((1, 5), (2, 5), (4, 3), (8, 3), (16, 1))
    zero = build_spec_plan("ngram", 0, "[[1, 64, 0]]")
    assert ExecutionPlan.build(zero, 4).grid == ((1, 1), (2, 1), (4, 1)), "no extra width"
    assert ExecutionPlan.build(SpecPlan.off(), 2).grid == ((1, 1), (2, 1))


def test_a_bucket_spanning_two_rows_has_both_widths():
    plan = build_spec_plan("ngram", 0, "[[1, 2, 4], [3, 3, 2], [4, 64, 1]]")
    assert ExecutionPlan.build(plan, 4).grid == ((1, 5), (2, 5), (4, 2), (4, 3))


def _table(*entries) -> AdmissionTable:
    return AdmissionTable(
        tuple(AdmissionEntry(b, w, r, lo, hi, 1.0, r) for b, w, r, lo, hi in entries)
    )


def test_descriptor_paths_by_mode_and_admission():
    plan = SpecPlan.constant(3)
    eager = ExecutionPlan.build(plan, 8, "eager")
    assert eager.descriptor(3, 4, 12).path == "eager"
    compiled = ExecutionPlan.build(plan, 8, "compiled")
    d = compiled.descriptor(3, 4, 9)
    assert (d.path, d.num_reqs_padded, d.width, d.num_tokens_padded) == ("compiled", 4, 4, 16)
    assert compiled.descriptor(3, None, 40).path == "eager", "mixed steps run eager"
    assert compiled.descriptor(9, 4, 36).path == "eager", "above the largest bucket: eager"
    assert ExecutionPlan.build(plan, 8, "compiled", "cuda").descriptor(1, 4, 4).path == "cuda_graph"
    auto = ExecutionPlan.build(plan, 8, "auto", admission=_table((4, 4, 0.8, 0.7, 0.9),
                                                                 (2, 4, 0.95, 0.9, 1.01)))
    assert auto.descriptor(3, 4, 12).path == "compiled"
    assert auto.descriptor(2, 4, 8).path == "eager", "CI reaching 1: not admitted"
    assert auto.descriptor(1, 4, 4).path == "eager", "unmeasured: fail closed"
    assert auto.path_for(1, 4) == ("eager", "unmeasured -> eager")
    assert ExecutionPlan.build(plan, 8, "auto").descriptor(4, 4, 16).path == "eager"
    with pytest.raises(ValueError, match="width 3 is not one the plan produces"):
        compiled.descriptor(2, 3, 6)


def test_admission_table_round_trip_and_errors(tmp_path):
    t = _table((1, 4, 0.7, 0.6, 0.8))
    p = tmp_path / "a.json"
    p.write_text(json.dumps(t.to_json()))
    loaded = AdmissionTable.load(str(p))
    assert loaded.get(1, 4).compiled_wins and loaded.get(2, 4) is None
    p.write_text('{"entries": [{"width": 4}]}')
    with pytest.raises(ValueError, match="admission table .* is unreadable"):
        AdmissionTable.load(str(p))
    k = tmp_path / "tuned.json"
    k.write_text("[[1, 64, 4]]")
    assert default_admission_path(str(k)) == str(tmp_path / "tuned.admission.json")
    assert default_admission_path("[[1, 64, 4]]") is None
    assert default_admission_path([[1, 64, 4]]) is None  # LLM(k_schedule=[...]) is inline


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown execution mode 'fast'"):
        ExecutionPlan.build(SpecPlan.off(), 4, "fast")
