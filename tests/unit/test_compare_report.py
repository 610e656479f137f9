"""Gain capture in `bench compare` (bench/compare_report.py, compare_cmd.add_oracle_arms): the
math, the report's column, and an oracle arm that stands in for a speculative arm."""

from __future__ import annotations

import pytest

from dynaspec.bench.compare import EngineArm, RunRecord, run_pairs
from dynaspec.bench.compare_cmd import add_oracle_arms
from dynaspec.bench.compare_report import build_report, gain_capture, markdown_report
from dynaspec.bench.workloads import WorkItem
from dynaspec.sampling_params import SamplingParams
from tests.cost_tables import FREE_VERIFY
from tests.e2e.conftest import random_prompts


@pytest.mark.parametrize(("speedup", "oracle", "want"), [
    (1.3, 4.0, 0.1), (4.0, 4.0, 1.0), (1.0, 2.0, 0.0), (0.9, 2.0, -0.1),  # losing is negative
    (1.2, 1.0, None), (1.2, 0.8, None),  # the oracle gains nothing: undefined
    (None, 2.0, None), (1.2, None, None),
])
def test_gain_capture_is_the_share_of_the_oracles_gain(speedup, oracle, want):
    got = gain_capture(speedup, oracle)
    assert got == (None if want is None else pytest.approx(want))


class _Arm:
    def __init__(self, label, seconds):
        self.label, self.seconds = label, seconds

    def run(self, items, params, concurrency, tag):
        rec = RunRecord(self.label, -1, 100, self.seconds)
        rec.outputs = [[1] for _ in items]
        return rec

    def describe(self):
        return {"kind": "mock", "label": self.label}


def test_the_ratio_table_gives_each_arm_its_gain_capture_against_its_oracle():
    arms = {"a": _Arm("plain", 1.0), "b": _Arm("ngram", 0.8), "oracle_b": _Arm("oracle", 0.25)}
    items = [WorkItem([1, 2], 4, "w")]
    recs = run_pairs(arms, items, [SamplingParams()], 1, 3)
    settings = {"workload": "chat", "num_prompts": 1, "max_tokens": 4, "concurrency": 1,
                "pairs": 3, "order": "alternate", "temperature": 0.0,
                "oracles": {"b": "oracle_b"}}
    report = build_report(arms, recs, settings, bandwidth=None)
    assert report["ratios"]["b"]["gain_capture"] == pytest.approx(0.25 / 3)
    assert "gain_capture" not in report["ratios"]["oracle_b"]
    md = markdown_report(report, list(arms))
    assert "| b/a | 1.250x | [1.250, 1.250] | 3/3 | 8.3% (oracle_b) |" in md
    assert "| oracle_b/a | 4.000x | [4.000, 4.000] | 3/3 | - |" in md


def test_oracle_arms_replay_the_plain_arms_outputs_for_each_speculative_arm(tiny_llama_dir):
    base = {"model": tiny_llama_dir, "dtype": "float32", "num_kv_blocks": 256, "num_threads": 1,
            "cost_table": FREE_VERIFY, "enable_prefix_caching": False}
    arms = {"a": EngineArm("plain", base),
            "b": EngineArm("ngram", {**base, "speculator": "ngram", "num_spec_tokens": 3})}
    items = [WorkItem(p, 10, f"p{i}") for i, p in
             enumerate(random_prompts(3, 280, seed=4, lo=8, hi=24))]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 3
    assert add_oracle_arms(arms, items, params, 2) == {"b": "oracle_b"}
    oracle = arms["oracle_b"]
    assert oracle.engine.config.spec.speculator == "oracle"
    assert oracle.engine.config.spec.num_spec_tokens == 3, "the speculative arm's K"
    recs = run_pairs(arms, items, params, 2, 1)
    by = {r.arm: r for r in recs}
    assert by["oracle_b"].outputs == by["a"].outputs == by["b"].outputs
    spec = by["oracle_b"].spec
    assert spec["num_draft_tokens"] > 0
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"], "a perfect drafter"
    with pytest.raises(ValueError, match="arm A to be a plain engine arm"):
        add_oracle_arms({"a": arms["b"], "b": arms["a"]}, items, params, 2)
    with pytest.raises(ValueError, match="no speculative engine arm"):
        add_oracle_arms({"a": arms["a"]}, items, params, 2)
