"""ui/live.py without a server: the JSON is the registries' samples, per rank under data
parallelism, with the prefix given to /metrics, and it reads nothing but the registries."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("prometheus_client")
from dynaspec.dp.metrics import DPMetrics  # noqa: E402
from dynaspec.metrics.prometheus import PrometheusMetrics  # noqa: E402
from dynaspec.metrics.records import EngineSnapshot, RequestStepSpec, StepStats  # noqa: E402
from dynaspec.server.ui.live import live_stats  # noqa: E402

STEP = StepStats(k=2, requests=(RequestStepSpec("a", 2, 1, 2, None),), num_generation_tokens=2)


def snap(running: int, goodput: float | None = None) -> EngineSnapshot:
    return EngineSnapshot(
        num_running=running,
        num_waiting=0,
        kv_usage=0.5,
        kv_pool_tokens_target=1024,
        kv_pool_tokens_drafter=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions_total=0,
        modelled_goodput=goodput,
        observed_goodput=goodput,
        k_policy="goodput",
    )


def samples(live: dict, name: str) -> dict[tuple, float]:
    return {tuple(sorted(labels.items())): v for labels, v in live["series"][name]}


@pytest.mark.parametrize("prefix", ["dynaspec", "vllm"])
def test_one_engine(prefix):
    m = PrometheusMetrics(labels={"model_name": "m"}, prefix=prefix)
    m.observe_step(STEP)
    m.observe_step(STEP)
    m.observe_snapshot(snap(3, 12.5))
    live = live_stats(m, threading.Lock(), {"num_running": 3})
    assert live["prefix"] == f"{prefix}:" and live["model_name"] == "m"
    assert samples(live, "generation_tokens_total") == {(): 4.0}
    assert samples(live, "spec_decode_steps_total") == {(("k", "2"),): 2.0}
    assert samples(live, "spec_decode_num_accepted_tokens_per_pos_total") == \
        {(("position", "0"),): 2.0, (("position", "1"),): 0.0}  # 2 drafted, 1 accepted
    assert samples(live, "k_policy_goodput_tokens_per_second") == \
        {(("kind", "modelled"),): 12.5, (("kind", "observed"),): 12.5}
    assert live["state"] == {"num_running": 3}
    json.dumps(live, allow_nan=False)  # strict JSON


def test_data_parallel_has_every_rank_and_the_sum():
    m = DPMetrics(2, {"model_name": "m"}, "dynaspec")
    m.rank_step(0, STEP)
    m.rank_step(1, STEP)
    m.rank_step(1, STEP)
    m.rank_snapshot(0, snap(1))
    m.rank_snapshot(1, snap(2))
    live = live_stats(m, None, {})
    assert samples(live, "generation_tokens_total") == {
        (("rank", "0"),): 2.0, (("rank", "1"),): 4.0, (("rank", "all"),): 6.0}
    assert samples(live, "num_requests_running") == {
        (("rank", "0"),): 1.0, (("rank", "1"),): 2.0, (("rank", "all"),): 3.0}


def test_it_waits_for_the_metrics_lock():
    """The engine thread feeds the registries under the lock: a poll never reads half a step."""
    m = PrometheusMetrics(labels={"model_name": "m"})
    lock, done = threading.Lock(), threading.Event()
    with lock:
        t = threading.Thread(target=lambda: (live_stats(m, lock, {}), done.set()))
        t.start()
        assert not done.wait(0.2)
    t.join(5)
    assert done.is_set()


def test_answered_polls_stay_out_of_the_access_log():
    import logging

    from dynaspec.server.ui.routes import QuietPolls

    def record(path: str, status: int) -> logging.LogRecord:  # as uvicorn.access logs
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0,
                                 '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", status), None)

    f = QuietPolls()
    assert not f.filter(record("/ui/live", 200))
    assert f.filter(record("/ui/live", 404))  # a failing poll is news
    assert f.filter(record("/v1/models", 200))
