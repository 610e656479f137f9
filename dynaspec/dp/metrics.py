"""/metrics under data parallelism: every series per rank (label ``rank="0"``...) and summed
over the ranks (``rank="all"``), in one exposition.

Each rank's reports (its steps, snapshots and finished requests) feed that rank's own
``PrometheusMetrics`` and the ``all`` one, each on its own registry; ``render`` merges the
families so each metric name appears once. Sum over ranks with ``{rank="all"}`` (or
``sum without (rank) (...{rank!="all"})``); never a bare ``sum(...)`` over both.

Losing ranks (§7d), read from the roster's counts when rendered (no rank label):
``dp_rank_losses_total``, ``dp_rank_replacements_total``, ``dp_requests_requeued_total``
(a lost rank's requests that had streamed nothing, sent again), ``dp_requests_failed_total``
(those that had streamed, ended with an error), ``dp_rank_start_given_up_total`` and the gauges
``dp_ranks_serving`` / ``dp_ranks``.
"""

from __future__ import annotations

import threading

from dynaspec.metrics.records import EngineSnapshot, FinishedRequestTimes, StepStats


class DPMetrics:
    """Renders like ``PrometheusMetrics`` for the AsyncEngine, which feeds it nothing under DP
    (the DP engine's `take_step` and `take_finished_times` hand out nothing); the front end
    feeds it each rank's reports."""

    def __init__(self, world_size: int, labels: dict[str, str], prefix: str | None = None,
                 roster=None) -> None:
        from dynaspec.metrics.prometheus import PREFIX, PrometheusMetrics

        # Every registry gets the same prefix: `--metrics-prefix vllm` renames the per-rank and
        # the summed series alike, so one dashboard reads both.
        prefix = prefix or PREFIX
        self.lock = threading.Lock()
        # One rank (--engine-process): the series of a single engine, with no rank label.
        self.ranks = [PrometheusMetrics(labels={**labels, "rank": str(r)}, prefix=prefix)
                      for r in range(world_size)] if world_size > 1 else []
        self.total = PrometheusMetrics(labels={**labels, "rank": "all"} if world_size > 1
                                       else labels, prefix=prefix)
        self.snapshots: dict[int, EngineSnapshot] = {}
        self.resilience = None
        if roster is not None and world_size > 1:
            from dynaspec.metrics.prometheus import RosterMetrics

            self.resilience = RosterMetrics(prefix, labels, roster)

    # ---- fed by the front end (its engine thread) --------------------------------------------
    def rank_step(self, rank: int, step: StepStats) -> None:
        with self.lock:
            for m in self._rank(rank):
                m.observe_step(step)
            self.total.observe_step(step)

    def rank_finished(self, rank: int, times: FinishedRequestTimes) -> None:
        with self.lock:
            for m in self._rank(rank):
                m.observe_finished(times)
            self.total.observe_finished(times)

    def rank_snapshot(self, rank: int, snap: EngineSnapshot) -> None:
        with self.lock:
            self.snapshots[rank] = snap
            for m in self._rank(rank):
                m.observe_snapshot(snap)
            self.total.observe_snapshot(sum_snapshots(list(self.snapshots.values())))

    def rank_lost(self, rank: int) -> None:
        """A lost rank's gauges leave the sum (its counters stay: they happened)."""
        with self.lock:
            if self.snapshots.pop(rank, None) is not None and self.snapshots:
                self.total.observe_snapshot(sum_snapshots(list(self.snapshots.values())))

    def _rank(self, rank: int) -> list:
        return self.ranks[rank:rank + 1]

    # ---- the AsyncEngine's calls: nothing to do, the front end feeds us ------------------------
    def observe_step(self, step: StepStats) -> None: ...

    def observe_snapshot(self, snap: EngineSnapshot) -> None: ...

    def observe_finished(self, times: FinishedRequestTimes) -> None: ...

    def render(self) -> bytes:
        from dynaspec.metrics.prometheus import render_merged

        with self.lock:
            body = render_merged([*self.ranks, self.total])
        if self.resilience is not None:
            body += self.resilience.render()
        return body


def sum_snapshots(snaps: list[EngineSnapshot]) -> EngineSnapshot:
    """Counts summed; KV usage pooled over the ranks' blocks; goodput left per rank (None)."""
    tokens = sum(s.kv_pool_tokens_target for s in snaps)
    usage = sum(s.kv_usage * s.kv_pool_tokens_target for s in snaps) / tokens if tokens else 0.0
    return EngineSnapshot(
        num_running=sum(s.num_running for s in snaps),
        num_waiting=sum(s.num_waiting for s in snaps),
        kv_usage=usage,
        kv_pool_tokens_target=tokens,
        kv_pool_tokens_drafter=sum(s.kv_pool_tokens_drafter for s in snaps),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in snaps),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in snaps),
        num_preemptions_total=sum(s.num_preemptions_total for s in snaps),
    )
