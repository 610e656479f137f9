"""server/request_outcomes.py: every ended request counted once by reason, rendered as a
Prometheus counter family with the engine's prefix."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from dynaspec.server.request_outcomes import RequestOutcomes, metrics_prefix


def test_counts_render_as_one_counter_family_with_the_prefix():
    o = RequestOutcomes()
    for reason in ("length", "length", "abort", "stop", None):
        o.add(reason)
    text = o.render("vllm:", {"model_name": "m"}).decode()
    fams = list(text_string_to_metric_families(text))
    assert [f.name for f in fams] == ["vllm:request_success"] and fams[0].type == "counter"
    got = {s.labels["finished_reason"]: s.value for s in fams[0].samples}
    assert got == {"stop": 1, "length": 2, "abort": 1, "error": 1}
    assert {s.labels["model_name"] for s in fams[0].samples} == {"m"}


def test_prefix_is_read_from_the_engine_metrics_or_a_dp_front_end_total():
    assert metrics_prefix(SimpleNamespace(prefix="vllm:")) == "vllm:"
    assert metrics_prefix(SimpleNamespace(total=SimpleNamespace(prefix="x:"))) == "x:"
    assert metrics_prefix(None) == "dynaspec:"
