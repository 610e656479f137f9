"""The periodic engine/speculation log line (docs/design.md §5; vLLM's `SpecDecodingLogging`,
fixed).

Differences from vLLM's `SpecDecodingLogging` (vllm/v1/spec_decode/metrics.py) and its known
inaccuracies, on purpose:
- per-position rates are *conditional*, accepted_per_pos[i] / drafted_per_pos[i], so deep
  positions do not look worse just because K varied;
- an interval without drafts says "no drafts" instead of "0.0%" or NaN;
- skipped drafting is shown by reason, with the step census by K, so a drafter that never ran
  cannot hide behind an acceptance rate.
Every value is for the interval since the previous line, except the snapshot's gauges and the
lifetime prefix-cache hit rate.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from dynaspec.metrics.records import EngineSnapshot
from dynaspec.metrics.stats import SpecCounters

logger = logging.getLogger("dynaspec.metrics")


def _rate(n: float, elapsed_s: float) -> str:
    return f"{n / elapsed_s:.1f}" if elapsed_s > 0 else "n/a"


def _counts(m: Mapping[Any, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in m.items()) + "}"


def _engine_part(d: SpecCounters, elapsed_s: float, snap: EngineSnapshot | None) -> str:
    parts = [
        f"prompt {_rate(d.num_prompt_tokens, elapsed_s)} tok/s",
        f"generation {_rate(d.num_generation_tokens, elapsed_s)} tok/s",
        f"steps {d.num_steps}",
        f"preemptions {d.num_preemptions}",
    ]
    if snap is not None:
        hit = (
            f"{100 * snap.prefix_cache_hits / snap.prefix_cache_queries:.1f}%"
            if snap.prefix_cache_queries
            else "n/a"
        )
        parts += [
            f"running {snap.num_running}",
            f"waiting {snap.num_waiting}",
            f"KV {100 * snap.kv_usage:.1f}%",
            f"KV pool tokens target {snap.kv_pool_tokens_target} "
            f"drafter {snap.kv_pool_tokens_drafter}",
            f"prefix-cache hit rate {hit} (lifetime)",
        ]
    return "Engine: " + ", ".join(parts)


def _spec_part(d: SpecCounters, elapsed_s: float) -> str:
    if d.num_drafts:
        per_pos = " ".join("-" if r is None else f"{r:.2f}" for r in d.acceptance_rate_per_pos)
        head = [
            f"acceptance rate {100 * (d.acceptance_rate or 0.0):.1f}% "
            f"({d.num_accepted_tokens}/{d.num_draft_tokens} tokens)",
            f"mean acceptance length {d.mean_acceptance_length:.2f} over {d.num_drafts} drafts",
            f"per-position (conditional) [{per_pos}]",
        ]
    else:
        head = ["acceptance rate n/a (no drafts)"]
    return "Spec: " + ", ".join(
        head
        + [
            f"accepted {_rate(d.num_accepted_tokens, elapsed_s)} tok/s",
            f"drafted {_rate(d.num_draft_tokens, elapsed_s)} tok/s",
            f"emitted {_rate(d.num_emitted_tokens, elapsed_s)} tok/s",
            f"steps by K {_counts(d.steps_by_k)}",
            f"skips {_counts(d.draft_skips)}",
            f"invalid drafts {_counts(d.invalid_draft_tokens)}",
            f"time draft {d.draft_seconds:.3f}s verify {d.verify_seconds:.3f}s "
            f"scheduler {d.scheduler_seconds:.3f}s",
        ]
    )


def format_log_line(
    counters: SpecCounters,
    prev_counters: SpecCounters | None,
    elapsed_s: float,
    snapshot: EngineSnapshot | None,
) -> str:
    """One line for the interval `prev_counters` -> `counters` (engine-wide), `elapsed_s` long.

    `prev_counters=None` means "since start". The speculation part is left out when no step of
    the interval ran with speculation on (k=None throughout).
    """
    d = counters - (prev_counters if prev_counters is not None else SpecCounters())
    line = _engine_part(d, elapsed_s, snapshot)
    if d.num_steps - d.num_spec_off_steps > 0 or d.num_spec_request_steps > 0:
        line += " | " + _spec_part(d, elapsed_s)
    return line


class PeriodicLogger:
    """Logs `format_log_line` at most every `interval_s` seconds; `interval_s=0` turns it off.

    Holds the counters of the last line (immutable, so the engine cannot alias them). The first
    call only starts the clock, so the first line covers a full interval.
    """

    def __init__(
        self,
        interval_s: float,
        *,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(interval_s) and interval_s >= 0):
            raise ValueError(f"log interval must be a finite number of seconds >= 0: {interval_s}")
        self.interval_s = float(interval_s)
        self._log = log if log is not None else logger
        self._clock = clock
        self._last_time: float | None = None
        self._last: SpecCounters | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def maybe_log(
        self,
        counters: SpecCounters,
        snapshot: EngineSnapshot | None = None,
        now: float | None = None,
    ) -> str | None:
        """Log and return the line if an interval has passed; otherwise return None."""
        if not self.enabled:
            return None
        now = self._clock() if now is None else now
        if self._last_time is None:
            self._last_time, self._last = now, counters
            return None
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        line = format_log_line(counters, self._last, elapsed, snapshot)
        self._log.info("%s", line)
        self._last_time, self._last = now, counters
        return line
