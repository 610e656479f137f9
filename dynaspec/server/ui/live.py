"""`GET /ui/live`: the Prometheus registry's samples the dashboard draws, as JSON.

One source of truth: the page reads the very samples `/metrics` renders (same registries, same
lock), not a second set of counters. Counters stay cumulative and histograms stay buckets, so
the page derives rates and percentiles from the difference of two polls exactly as Prometheus
does from two scrapes. Under data parallelism every rank's registry and the summed one
(`rank="all"`) are read, so the page can draw per-rank lines.

Cost per poll: collecting those samples under the metrics lock (part of what a /metrics scrape
does, without the text rendering) and a JSON dump of about 5 kB; nothing runs on the engine
thread.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import nullcontext
from typing import Any

# The label every series carries (one model is served): left out of the JSON, sent once.
_CONSTANT_LABELS = ("model_name",)
# The samples the dashboard draws (names without the prefix, as /metrics writes them). Only
# these are collected: half the work of collecting every family (no e2e, request-size or grammar
# histograms), a few milliseconds a poll at most.
DASHBOARD_SERIES = (
    "prompt_tokens_total", "generation_tokens_total", "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total", "spec_decode_num_drafted_tokens_per_pos_total",
    "spec_decode_steps_total", "spec_decode_draft_skips_total",
    "k_policy_goodput_tokens_per_second", "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket", "num_requests_running", "num_requests_waiting",
    "kv_cache_usage_perc",
)

# OpenAPI schema of the answer (api_server publishes it on the route).
LIVE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["time", "prefix", "series", "state"],
    "properties": {
        "time": {"type": "number", "description": "server wall clock, unix seconds"},
        "prefix": {"type": "string", "description": "the metric names' prefix, e.g. 'dynaspec:'"},
        "model_name": {"type": ["string", "null"]},
        "series": {
            "type": "object",
            "description": "sample name without the prefix (as /metrics writes it: counters "
            "end in _total, histogram buckets in _bucket) -> its samples as [labels, value] "
            "pairs, model_name left out of the labels; the series the dashboard draws: "
            + ", ".join(DASHBOARD_SERIES),
            # Each pair's items as anyOf, not prefixItems: schemathesis 4 rewrites prefixItems
            # to the pre-2020 list form of `items`, which its OpenAPI 3.1 check then refuses.
            "additionalProperties": {"type": "array", "items": {
                "type": "array", "minItems": 2, "maxItems": 2, "description": "[labels, value]",
                "items": {"anyOf": [
                    {"type": "object", "additionalProperties": {"type": "string"}},
                    {"type": ["number", "null"]}]}}},
        },
        "state": {"type": "object", "description": "the engine state /health publishes"},
    },
}


def metric_instances(metrics: Any) -> list[Any]:
    """The PrometheusMetrics behind `metrics`: itself, or under data parallelism (DPMetrics,
    dp/metrics.py) each rank's and the summed one."""
    ranks = getattr(metrics, "ranks", None)
    return [*ranks, metrics.total] if ranks is not None else [metrics]


def live_stats(metrics: Any, lock: threading.Lock | None, state: dict) -> dict[str, Any]:
    """The JSON answer of /ui/live for `metrics` (PrometheusMetrics or DPMetrics)."""
    instances = metric_instances(metrics)
    own_lock = getattr(metrics, "lock", None)  # DPMetrics feeds its registries under its own
    wanted = [[m.prefix + name for name in DASHBOARD_SERIES] for m in instances]
    with lock or nullcontext(), own_lock or nullcontext():
        families = [fam for m, names in zip(instances, wanted)
                    for fam in m.registry.restricted_registry(names).collect()]
    prefix = instances[-1].prefix
    series: dict[str, list] = {}
    model_name = None
    for fam in families:
        for s in fam.samples:
            if not s.name.startswith(prefix):
                continue
            labels = {k: v for k, v in s.labels.items() if k not in _CONSTANT_LABELS}
            model_name = s.labels.get("model_name", model_name)
            series.setdefault(s.name[len(prefix):], []).append([labels, _finite(s.value)])
    return {"time": time.time(), "prefix": prefix, "model_name": model_name, "series": series,
            "state": dict(state)}


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity (a +Inf bucket's bound is a label, not a value, so only a
    gauge could be one): null, which the page draws as a gap."""
    return x if math.isfinite(x) else None
