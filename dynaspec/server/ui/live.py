"""`GET /ui/live`: the Prometheus registry's samples as JSON, for the page's charts.

One source of truth: the page reads the very samples `/metrics` renders (same registries, same
lock), not a second set of counters. Counters stay cumulative and histograms stay buckets, so
the page derives rates and percentiles from the difference of two polls exactly as Prometheus
does from two scrapes. Under data parallelism every rank's registry and the summed one
(`rank="all"`) are read, so the page can draw per-rank lines.

Cost per poll: one `collect()` of the registries under the metrics lock (what a /metrics
scrape does, minus the text rendering) and a JSON dump; nothing runs on the engine thread.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import nullcontext
from typing import Any

# The label every series carries (one model is served): left out of the JSON, sent once.
_CONSTANT_LABELS = ("model_name",)

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
            "end in _total, histograms in _bucket/_sum/_count) -> its samples as "
            "[labels, value] pairs; model_name is left out of the labels",
            "additionalProperties": {"type": "array", "items": {
                "type": "array", "minItems": 2, "maxItems": 2,
                "prefixItems": [{"type": "object", "additionalProperties": {"type": "string"}},
                                {"type": ["number", "null"]}]}},
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
    with lock or nullcontext(), own_lock or nullcontext():
        families = [fam for m in instances for fam in m.registry.collect()]
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
