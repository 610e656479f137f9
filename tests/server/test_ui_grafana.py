"""deploy/grafana/dynaspec.json: every panel's query names series the server really exports, with
the labels it really has, under both metric prefixes (`--metrics-prefix vllm` too), single engine
and data parallel; and the panels the issue asks for are there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dynaspec.dp.metrics import DPMetrics  # noqa: E402
from dynaspec.metrics.prometheus import PrometheusMetrics  # noqa: E402
from dynaspec.metrics.records import (  # noqa: E402
    EngineSnapshot,
    FinishedRequestTimes,
    RequestStepSpec,
    StepStats,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dynaspec.json"
# Label names PromQL itself makes or consumes, not the server's.
_PROMQL_LABELS = {"le"}

STEP = StepStats(k=3, requests=(RequestStepSpec("a", 3, 2, 3, None),
                     RequestStepSpec("b", 0, 0, 1, "no_match")),
                 draft_seconds=0.01, verify_seconds=0.02, schedule_seconds=0.001,
                 num_prompt_tokens=5, num_generation_tokens=4)
STEP_K0 = StepStats(
    k=0, requests=(RequestStepSpec("a", 0, 0, 1, "schedule_zero"),), num_generation_tokens=1
)
SNAP = EngineSnapshot(
    num_running=2,
    num_waiting=1,
    kv_usage=0.25,
    kv_pool_tokens_target=4096,
    kv_pool_tokens_drafter=0,
    prefix_cache_queries=10,
    prefix_cache_hits=4,
    num_preemptions_total=0,
    modelled_goodput=30.0,
    observed_goodput=27.5,
    k_policy="goodput",
)
DONE = FinishedRequestTimes(
    ttft_s=0.05, inter_token_s=(0.02, 0.03), e2e_s=0.1, num_prompt_tokens=5, num_generation_tokens=3
)


def exported(prefix: str, world_size: int) -> dict[str, set[str]]:
    """Sample name -> label names, from the exposition text of metrics fed one of everything."""
    labels = {"model_name": "m"}
    if world_size == 1:
        m = PrometheusMetrics(labels=labels, prefix=prefix)
        m.observe_step(STEP)
        m.observe_step(STEP_K0)
        m.observe_snapshot(SNAP)
        m.observe_finished(DONE)
    else:
        m = DPMetrics(world_size, labels, prefix)
        for rank in range(world_size):
            m.rank_step(rank, STEP)
            m.rank_step(rank, STEP_K0)
            m.rank_snapshot(rank, SNAP)
            m.rank_finished(rank, DONE)
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.extend(p.get("panels", [])) if p.get("type") == "row" else out.append(p)
    return out


def queries(dashboard: dict, prefix: str) -> list[tuple[str, str]]:
    """(panel title, expr) with the dashboard's variables as Grafana would fill them."""
    subs = {"${prefix}": prefix, "$__rate_interval": "1m", "$model_name": "m"}
    out = []
    for p in panels(dashboard):
        assert p["targets"], f"{p['title']}: no query"
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in subs.items():
                expr = expr.replace(var, value)
            out.append((p["title"], expr))
    return out


def series_in(expr: str, prefix: str) -> list[tuple[str, str]]:
    """(metric name, the `{...}` matcher after it, or '') for every prefixed name in expr."""
    return re.findall(re.escape(prefix) + r":([A-Za-z0-9_:]+)(\{[^}]*\})?", expr)


def grouping_labels(expr: str) -> set[str]:
    found = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        found.update(x.strip() for x in group.split(",") if x.strip())
    return found


def problems(dashboard: dict, prefix: str, world_size: int) -> list[str]:
    """What in the dashboard's queries the server's exposition does not have."""
    names, bad = exported(prefix, world_size), []
    # A single engine has no rank label: `rank!="all"` (how a panel leaves out the data-parallel
    # sum) accepts its series, and `by (rank)` gives one series.
    no_rank = {"rank"} if world_size == 1 else set()
    for title, expr in queries(dashboard, prefix):
        if "$" in expr:
            bad.append(f"{title}: an unknown dashboard variable in {expr}")
        if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
            bad.append(f"{title}: unbalanced brackets in {expr}")
        found, used = series_in(expr, prefix), set()
        if not found:
            bad.append(f"{title}: no {prefix}: series in {expr}")
        for name, matcher in found:
            full = f"{prefix}:{name}"
            if full not in names:
                bad.append(f"{title}: {full} is not exported")
                continue
            matched = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*[!=]~?", matcher))
            if missing := matched - names[full] - no_rank:
                bad.append(f"{title}: {full} has no label(s) {sorted(missing)}")
            used |= names[full]
        if extra := grouping_labels(expr) - used - _PROMQL_LABELS - no_rank:
            bad.append(f"{title}: groups by label(s) {sorted(extra)} its series do not have")
    return bad


@pytest.mark.parametrize("prefix", ["dynaspec", "vllm"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_panel_reads_exported_series(prefix, world_size):
    dashboard = load()
    assert sum(len(series_in(e, prefix)) for _, e in queries(dashboard, prefix)) >= 20
    assert problems(dashboard, prefix, world_size) == []


def test_a_wrong_series_or_label_is_caught():
    """The check is not vacuous: a counter without _total, a label the series lacks, a typo'd
    grouping and a variable Grafana would not fill are each reported."""
    dashboard = load()
    target = panels(dashboard)[0]["targets"][0]
    for broken, why in (
            ("rate(${prefix}:generation_tokens[1m])", "is not exported"),
            ('rate(${prefix}:generation_tokens_total{reason="x"}[1m])', "has no label(s)"),
            ("sum by (kind) (${prefix}:num_requests_running)", "groups by label(s)"),
            ("${prefix}:num_requests_running{model_name=~\"$model\"}", "unknown dashboard"),
    ):
        target["expr"] = broken
        found = problems(dashboard, "dynaspec", 2)
        assert len(found) == 1 and why in found[0], (broken, found)


def test_the_dashboard_has_the_issues_panels():
    titles = " | ".join(p["title"].lower() for p in panels(load()))
    for what in ("tokens/s", "acceptance by draft position", "k chosen", "batch size",
                 "modelled vs observed", "k=0", "ttft", "inter-token latency",
                 "running / waiting", "kv cache", "per rank"):
        assert what in titles, f"no panel about {what!r}: {titles}"
    variables = {v["name"]: v for v in load()["templating"]["list"]}
    assert {o["value"] for o in variables["prefix"]["options"]} == {"dynaspec", "vllm"}
    ids = [p["id"] for p in panels(load())]
    assert len(ids) == len(set(ids)), "panel ids must be unique for Grafana"
