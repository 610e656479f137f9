"""How every request the server queued ended, as vLLM's `request_success_total` counter.

The engine's own metrics count tokens and steps; nothing counted requests by how they ended, so
`/metrics` could not show that a load with disconnecting clients lost none: every request queued
ends exactly once here, as stop, length, abort (its client left, or shutdown) or error. The
AsyncEngine's thread counts (`RequestOutcomes.add`); the /metrics handler renders the counts
beside the engine's series with the same prefix and model label.
"""

from __future__ import annotations

import threading
from typing import Any

FAMILY = "request_success"  # rendered as <prefix>request_success_total{finished_reason=...}
REASONS = ("stop", "length", "abort", "error")


class RequestOutcomes:
    """Counts of ended requests by finish reason (written by one thread, read by any)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REASONS, 0)

    def add(self, reason: str | None) -> None:
        with self._lock:
            key = reason or "error"
            self._counts[key] = self._counts.get(key, 0) + 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def render(self, prefix: str, labels: dict[str, str]) -> bytes:
        """The exposition text of one counter family (Prometheus text format 0.0.4)."""
        from dynaspec.metrics.prometheus import render_counter

        name = (prefix if prefix.endswith(":") else prefix + ":") + FAMILY
        return render_counter(name, "Requests ended, by finish reason (abort: the client left "
                              "or the server shut down).", labels, "finished_reason",
                              self.counts())


def metrics_prefix(metrics: Any) -> str:
    """The prefix the engine's series use (a DP front end's metrics keep theirs on `total`)."""
    prefix = getattr(metrics, "prefix", None) or getattr(getattr(metrics, "total", None),
                                                          "prefix", None)
    return prefix or "dynaspec:"
