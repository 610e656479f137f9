"""/metrics under data parallelism: every series per rank (label ``rank="0"``...) and summed
over the ranks (``rank="all"``), in one exposition; and the ranks' KV pools and schedulers seen
as one (``KVPoolsView``, ``SchedulersView``) for /health and the periodic log line.

Each rank's reports (its steps, snapshots and finished requests) feed that rank's own
``PrometheusMetrics`` and the ``all`` one, each on its own registry; ``render`` merges the
families so each metric name appears once. Sum over ranks with ``{rank="all"}`` (or
``sum without (rank) (...{rank!="all"})``); never a bare ``sum(...)`` over both.
"""

from __future__ import annotations

import threading
from typing import Any

from dynaspec.metrics.stats import EngineSnapshot, FinishedRequestTimes, StepStats


class DPMetrics:
    """Quacks like ``PrometheusMetrics`` for the AsyncEngine, which feeds it nothing under DP
    (the DP engine reports no ``last_step`` and no finished times); the front end feeds it."""

    def __init__(self, world_size: int, labels: dict[str, str], prefix: str | None = None) -> None:
        from dynaspec.metrics.prometheus import PREFIX, PrometheusMetrics

        # Every registry gets the same prefix: `--metrics-prefix vllm` renames the per-rank and
        # the summed series alike, so one dashboard reads both.
        prefix = prefix or PREFIX
        self.lock = threading.Lock()
        self.ranks = [PrometheusMetrics(labels={**labels, "rank": str(r)}, prefix=prefix)
                      for r in range(world_size)]
        self.total = PrometheusMetrics(labels={**labels, "rank": "all"}, prefix=prefix)
        self.snapshots: dict[int, EngineSnapshot] = {}

    # ---- fed by the front end (its engine thread) --------------------------------------------
    def rank_step(self, rank: int, step: StepStats) -> None:
        with self.lock:
            self.ranks[rank].observe_step(step)
            self.total.observe_step(step)

    def rank_finished(self, rank: int, t: dict) -> None:
        times = FinishedRequestTimes(t.get("ttft_s"), tuple(t.get("inter_token_s") or ()),
                                     t.get("e2e_s", 0.0), t.get("num_prompt_tokens", 0),
                                     t.get("num_generation_tokens", 0))
        with self.lock:
            self.ranks[rank].observe_finished(times)
            self.total.observe_finished(times)

    def rank_snapshot(self, rank: int, snap: EngineSnapshot) -> None:
        with self.lock:
            self.snapshots[rank] = snap
            self.ranks[rank].observe_snapshot(snap)
            self.total.observe_snapshot(sum_snapshots(list(self.snapshots.values())))

    # ---- the AsyncEngine's calls: nothing to do, the front end feeds us ------------------------
    def observe_step(self, step: StepStats) -> None: ...

    def observe_snapshot(self, snap: EngineSnapshot) -> None: ...

    def observe_finished(self, times: FinishedRequestTimes) -> None: ...

    def render(self) -> bytes:
        from dynaspec.metrics.prometheus import render_merged

        with self.lock:
            return render_merged([*self.ranks, self.total])


def sum_snapshots(snaps: list[EngineSnapshot]) -> EngineSnapshot:
    """Counts summed; KV usage pooled over the ranks' blocks; goodput left per rank (None)."""
    tokens = sum(s.kv_pool_tokens_target for s in snaps)
    usage = sum(s.kv_usage * s.kv_pool_tokens_target for s in snaps) / tokens if tokens else 0.0
    return EngineSnapshot(sum(s.num_running for s in snaps), sum(s.num_waiting for s in snaps),
                          usage, tokens, sum(s.kv_pool_tokens_drafter for s in snaps),
                          sum(s.prefix_cache_queries for s in snaps),
                          sum(s.prefix_cache_hits for s in snaps),
                          sum(s.num_preemptions_total for s in snaps))


class KVPoolsView:
    """The ranks' KV pools as one, for /health and the periodic log line."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng

    @property
    def num_blocks(self) -> int:
        return sum(r.pool["num_blocks"] for r in self.eng.ready.values())

    def num_free_blocks(self) -> int:
        return sum(self.eng.free_blocks.values())

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_queries(self) -> int:
        return sum(s.prefix_cache_queries for s in self.eng.snapshots.values())

    @property
    def prefix_cache_hits(self) -> int:
        return sum(s.prefix_cache_hits for s in self.eng.snapshots.values())


class SchedulersView:
    policy = None  # the K policies live on the ranks; their goodput is in /metrics per rank

    def __init__(self, eng: Any) -> None:
        self.eng = eng

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions_total for s in self.eng.snapshots.values())
