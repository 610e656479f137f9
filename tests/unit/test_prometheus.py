"""Prometheus export: the exposition parses and says exactly what the counters say."""

from __future__ import annotations

import re
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import dynaspec
from dynaspec.metrics.prometheus import CONTENT_TYPE, PrometheusMetrics
from dynaspec.metrics.records import (
    EngineSnapshot,
    FinishedRequestTimes,
    RequestStepSpec,
    StepStats,
)
from dynaspec.metrics.stats import SpecCounters, fold_step

P = "dynaspec:"


def req(rid, d=0, a=0, e=None, skip=None, invalid=None):
    return RequestStepSpec(rid, d, a, a + 1 if e is None else e, skip, invalid or {})


STEPS = [
    StepStats(k=4, requests=(req("a", 4, 3), req("b", skip="drafter_length", e=1),
                  req("c", 2, 0, invalid={"padding": 2})),
              draft_seconds=0.25, verify_seconds=0.5, schedule_seconds=0.125,
              num_prompt_tokens=7, num_generation_tokens=6),
    StepStats(k=0, requests=(req("a", skip="schedule_zero"), req("b", skip="schedule_zero")),
              verify_seconds=0.25, num_generation_tokens=2, num_preemptions=1),
    StepStats(k=2, requests=(req("a", 2, 2, e=1), req("c", 0, 0, e=1, invalid={"grammar": 2})),
              draft_seconds=0.125, num_generation_tokens=2),
    StepStats(k=None, requests=(req("a"),), num_prompt_tokens=3, num_generation_tokens=1),
]  # fmt: skip


def parse(metrics):
    """(sample name, sorted labels) -> value, without the `_created` timestamps."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _by_pos(vec):
    return dict(enumerate(vec))


def observed(steps, **kw):
    m = PrometheusMetrics(**kw)
    for s in steps:
        m.observe_step(s)
    return m


def test_exposition_parses_and_equals_the_counters():
    counters = SpecCounters()
    for s in STEPS:
        counters = fold_step(counters, s)
    got = parse(observed(STEPS))
    scalars = {
        "spec_decode_num_drafts": counters.num_drafts,
        "spec_decode_num_draft_tokens": counters.num_draft_tokens,
        "spec_decode_num_accepted_tokens": counters.num_accepted_tokens,
        "spec_decode_num_emitted_tokens": counters.num_emitted_tokens,
        "spec_decode_draft_seconds": counters.draft_seconds,
        "spec_decode_verify_seconds": counters.verify_seconds,
        "spec_decode_scheduler_seconds": counters.scheduler_seconds,
        "prompt_tokens": counters.num_prompt_tokens,
        "generation_tokens": counters.num_generation_tokens,
        "num_preemptions": counters.num_preemptions,
    }
    for name, value in scalars.items():
        assert got[(f"{P}{name}_total", ())] == value, name
    labelled = {
        "spec_decode_num_accepted_tokens_per_pos": ("position", _by_pos(counters.accepted_per_pos)),
        "spec_decode_num_drafted_tokens_per_pos": ("position", _by_pos(counters.drafted_per_pos)),
        "spec_decode_steps": ("k", counters.steps_by_k),
        "spec_decode_draft_skips": ("reason", counters.draft_skips),
        "spec_decode_invalid_draft_tokens": ("reason", counters.invalid_draft_tokens),
    }
    for name, (label, expected) in labelled.items():
        series = {
            dict(labels)[label]: v for (n, labels), v in got.items() if n == f"{P}{name}_total"
        }
        assert series == {str(key): float(v) for key, v in expected.items()}, name
    # the values themselves, so the check above cannot pass vacuously
    assert counters.num_drafts == 3 and counters.num_draft_tokens == 8
    assert got[(f"{P}spec_decode_steps_total", (("k", "0"),))] == 1.0
    assert got[(f"{P}spec_decode_draft_skips_total", (("reason", "all_invalid"),))] == 1.0
    assert counters.drafted_per_pos == (3, 3, 1, 1)


def test_vllm_compatible_names_and_types():
    m = observed(STEPS)
    m.observe_snapshot(
        EngineSnapshot(
            num_running=1,
            num_waiting=0,
            kv_usage=0.1,
            kv_pool_tokens_target=100,
            kv_pool_tokens_drafter=10,
            prefix_cache_queries=5,
            prefix_cache_hits=2,
            num_preemptions_total=0,
        )
    )
    m.observe_finished(
        FinishedRequestTimes(
            ttft_s=0.1,
            inter_token_s=(0.01,),
            e2e_s=1.0,
            num_prompt_tokens=3,
            num_generation_tokens=2,
        )
    )
    types = {f.name: f.type for f in text_string_to_metric_families(m.render().decode())}
    counters = [
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_drafted_tokens_per_pos",
        "spec_decode_steps", "spec_decode_draft_skips", "spec_decode_invalid_draft_tokens",
        "spec_decode_draft_seconds", "spec_decode_verify_seconds", "prompt_tokens",
        "generation_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
    ]  # fmt: skip
    for name in counters:
        assert types[P + name] == "counter", name
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "kv_pool_size_tokens"]:  # fmt: skip
        assert types[P + name] == "gauge", name
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"]:  # fmt: skip
        assert types[P + name] == "histogram", name
    assert CONTENT_TYPE.startswith("text/plain")


def test_speculation_off_step_is_not_a_k0_step():
    got = parse(observed([StepStats(k=None, requests=(req("a"),), num_generation_tokens=1)]))
    assert not any(n == f"{P}spec_decode_steps_total" for n, _ in got)
    assert got[(f"{P}spec_decode_num_drafts_total", ())] == 0.0
    assert got[(f"{P}generation_tokens_total", ())] == 1.0


def test_snapshot_gauges_and_prefix_cache_totals():
    m = PrometheusMetrics()
    m.observe_snapshot(
        EngineSnapshot(
            num_running=3,
            num_waiting=2,
            kv_usage=0.75,
            kv_pool_tokens_target=8192,
            kv_pool_tokens_drafter=1024,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            num_preemptions_total=0,
        )
    )
    m.observe_snapshot(
        EngineSnapshot(
            num_running=1,
            num_waiting=0,
            kv_usage=0.5,
            kv_pool_tokens_target=8192,
            kv_pool_tokens_drafter=1024,
            prefix_cache_queries=150,
            prefix_cache_hits=70,
            num_preemptions_total=0,
        )
    )
    got = parse(m)
    assert got[(f"{P}num_requests_running", ())] == 1.0
    assert got[(f"{P}num_requests_waiting", ())] == 0.0
    assert got[(f"{P}kv_cache_usage_perc", ())] == 0.5
    assert got[(f"{P}kv_pool_size_tokens", (("pool", "target"),))] == 8192.0
    assert got[(f"{P}kv_pool_size_tokens", (("pool", "drafter"),))] == 1024.0
    assert got[(f"{P}prefix_cache_queries_total", ())] == 150.0
    assert got[(f"{P}prefix_cache_hits_total", ())] == 70.0
    m.observe_snapshot(
        EngineSnapshot(
            num_running=0,
            num_waiting=0,
            kv_usage=0.0,
            kv_pool_tokens_target=8192,
            kv_pool_tokens_drafter=0,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_preemptions_total=0,
        )
    )  # totals restarted
    got = parse(m)
    assert got[(f"{P}prefix_cache_queries_total", ())] == 160.0
    assert got[(f"{P}prefix_cache_hits_total", ())] == 74.0


def test_finished_request_histograms():
    m = PrometheusMetrics()
    m.observe_finished(
        FinishedRequestTimes(
            ttft_s=0.05,
            inter_token_s=(0.02, 0.03, 0.2),
            e2e_s=0.4,
            num_prompt_tokens=12,
            num_generation_tokens=4,
        )
    )
    m.observe_finished(
        FinishedRequestTimes(
            ttft_s=None, inter_token_s=(), e2e_s=0.01, num_prompt_tokens=5, num_generation_tokens=0
        )
    )  # aborted before a token
    got = parse(m)
    assert got[(f"{P}time_to_first_token_seconds_count", ())] == 1.0
    assert got[(f"{P}time_to_first_token_seconds_sum", ())] == pytest.approx(0.05)
    assert got[(f"{P}inter_token_latency_seconds_count", ())] == 3.0
    assert got[(f"{P}inter_token_latency_seconds_bucket", (("le", "0.025"),))] == 1.0
    assert got[(f"{P}e2e_request_latency_seconds_count", ())] == 2.0
    assert got[(f"{P}request_prompt_tokens_sum", ())] == 17.0
    assert got[(f"{P}request_generation_tokens_count", ())] == 2.0


def test_constant_labels_and_private_registry():
    reg = CollectorRegistry()
    m = observed(STEPS[:1], registry=reg, labels={"model_name": "tiny", "engine": "0"})
    assert m.registry is reg
    got = parse(m)
    base = (("engine", "0"), ("model_name", "tiny"))
    assert got[(f"{P}spec_decode_num_drafts_total", base)] == 2.0
    assert got[(f"{P}spec_decode_steps_total", (*base[:1], ("k", "4"), *base[1:]))] == 1.0
    observed(STEPS[:1])  # a second instance: no clash, because neither uses the global registry
    assert prometheus_client.REGISTRY.get_sample_value(f"{P}spec_decode_num_drafts_total") is None


def test_invalid_step_is_rejected_before_any_series_moves():
    m = observed(STEPS[:1])
    before = parse(m)
    bad = StepStats(k=None, requests=(req("a", 2, 1),))  # drafts with speculation off
    with pytest.raises(ValueError):
        m.observe_step(bad)
    assert parse(m) == before


def test_prometheus_client_is_imported_only_by_the_edge_module():
    root = Path(dynaspec.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+prometheus_client\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == ["metrics/prometheus.py"]


def test_execution_steps_by_path_and_width():
    steps = [
        StepStats(k=3, requests=(req("a", 3, 1),), path="compiled", width="4"),
        StepStats(k=3, requests=(req("a", 3, 0),), path="compiled", width="4"),
        StepStats(
            k=3, requests=(req("a", 2, 2), req("b", skip="prefill")), path="eager", width="mixed"
        ),
        StepStats(k=None, requests=(req("a"),), num_generation_tokens=1),
    ]  # hand-built: no path
    got = parse(observed(steps))
    series = {labels: v for (n, labels), v in got.items() if n == f"{P}execution_steps_total"}
    assert series == {(("path", "compiled"), ("width", "4")): 2.0,
                      (("path", "eager"), ("width", "mixed")): 1.0}


def test_tree_steps_fold_and_export():
    """A request-step whose drafts were a tree: tree counters and the acceptance-length
    histogram move with it, chains leave them alone, and the identities hold."""
    tree = RequestStepSpec("t", 6, 2, 3, None, num_tree_nodes=6)
    steps = [StepStats(k=6, requests=(tree, req("a", 4, 1))),
             StepStats(k=2, requests=(req("a", 2, 2),))]
    c = fold_step(fold_step(SpecCounters(), steps[0]), steps[1])
    assert (c.num_tree_steps, c.num_tree_drafts, c.num_tree_nodes, c.num_tree_accepted_tokens) \
        == (1, 1, 6, 2)
    assert c.check_identities() == [] and c.to_dict()["num_tree_nodes"] == 6
    got = parse(observed(steps))
    assert got[(P + "spec_decode_tree_steps_total", ())] == 1
    assert got[(P + "spec_decode_num_tree_nodes_total", ())] == 6
    assert got[(P + "spec_decode_num_tree_accepted_tokens_total", ())] == 2
    assert got[(P + "spec_decode_tree_acceptance_length_count", ())] == 1
    assert got[(P + "spec_decode_tree_acceptance_length_sum", ())] == 3
    # the tree's size under its step's batch bucket (2 requests: "2-4"); chains add nothing
    assert got[(P + "spec_decode_tree_nodes_count", (("batch", "2-4"),))] == 1
    assert got[(P + "spec_decode_tree_nodes_sum", (("batch", "2-4"),))] == 6
    assert (P + "spec_decode_tree_nodes_count", (("batch", "1"),)) not in got
    with pytest.raises(ValueError, match="a tree of 5 nodes"):
        RequestStepSpec("t", 6, 2, 3, None, num_tree_nodes=5)


def test_batch_buckets_name_every_size():
    from dynaspec.metrics.prometheus import batch_bucket

    assert [batch_bucket(n) for n in (1, 2, 4, 5, 16, 17, 64, 65, 500)] == \
        ["1", "2-4", "2-4", "5-16", "5-16", "17-64", "17-64", "65+", "65+"]
