"""Rendezvous resolution, threads per rank and the merged /metrics, without processes."""

from __future__ import annotations

import re

import pytest

from dynaspec.config import EngineConfig, ParallelConfig
from dynaspec.dp.metrics import DPMetrics
from dynaspec.dp.rendezvous import SECRET_ENV, resolve, threads_per_rank
from dynaspec.metrics.records import EngineSnapshot, RequestStepSpec, StepStats


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", SECRET_ENV):
        monkeypatch.delenv(name, raising=False)


def test_single_machine_defaults():
    r = resolve(ParallelConfig(data_parallel_size=3))
    assert (r.master_addr, r.store_port, r.world_size, r.local_ranks) == (
        "127.0.0.1",
        0,
        3,
        (0, 1, 2),
    )
    assert not r.multi_machine and len(r.authkey) == 32


def test_flags_win_over_environment(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv(SECRET_ENV, "s")
    r = resolve(ParallelConfig(data_parallel_size=4, dp_local_size=2, dp_master_addr="10.0.0.1",
                               dp_master_port=29500))
    assert (r.master_addr, r.store_port, r.control_port, r.local_ranks) == (
        "10.0.0.1",
        29500,
        29501,
        (0, 1),
    )
    assert r.authkey == b"s"
    r = resolve(ParallelConfig(data_parallel_size=4, dp_local_size=2))
    assert (r.master_addr, r.store_port) == ("10.0.0.9", 1234)


def test_worker_takes_torchrun_environment(monkeypatch):
    for k, v in {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4",
                 "RANK": "3", SECRET_ENV: "s"}.items():
        monkeypatch.setenv(k, v)
    r = resolve(ParallelConfig(), worker=True)
    assert (r.world_size, r.local_ranks, r.store_port) == (4, (3,), 29500)


def test_multi_machine_needs_port_and_secret(monkeypatch):
    with pytest.raises(ValueError, match="rendezvous port"):
        resolve(ParallelConfig(data_parallel_size=2, dp_local_size=1))
    with pytest.raises(ValueError, match=SECRET_ENV):
        resolve(ParallelConfig(data_parallel_size=2, dp_local_size=1, dp_master_port=2000))


@pytest.mark.parametrize("kwargs, match", [
    (dict(data_parallel_size=0), "data_parallel_size"),
    (dict(data_parallel_size=2, dp_local_size=3), "dp_local_size"),
    (dict(data_parallel_size=2, dp_local_size=1, dp_rank_start=2), "dp_rank_start"),
    (dict(dp_rank_timeout_s=0), "dp_rank_timeout_s"),
    (dict(dp_master_port=70000), "dp_master_port"),
])
def test_bad_parallel_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_threads_per_rank_splits_the_cores(monkeypatch):
    monkeypatch.setattr("dynaspec.dp.rendezvous.default_num_threads", lambda: 16)
    assert threads_per_rank(ParallelConfig(data_parallel_size=4), 4) == 4
    assert threads_per_rank(ParallelConfig(data_parallel_size=32), 32) == 1
    assert threads_per_rank(ParallelConfig(data_parallel_size=2, num_threads=3), 2) == 3


def _value(text: str, name: str, rank: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*rank="{rank}"[^}}]*\}} (\S+)', text, re.M)
    return float(m.group(1))


def test_metrics_per_rank_and_summed_in_one_family():
    m = DPMetrics(2, {"model_name": "x"})
    for rank, emitted in ((0, 3), (1, 5)):
        step = StepStats(
            k=2, requests=(RequestStepSpec(f"r{rank}", 2, 1, emitted if emitted < 3 else 2, None),)
        )
        m.rank_step(rank, step)
        m.rank_snapshot(
            rank,
            EngineSnapshot(
                num_running=rank + 1,
                num_waiting=0,
                kv_usage=0.5 * rank,
                kv_pool_tokens_target=100,
                kv_pool_tokens_drafter=0,
                prefix_cache_queries=10,
                prefix_cache_hits=5,
                num_preemptions_total=0,
            ),
        )
    text = m.render().decode()
    name = "dynaspec:spec_decode_num_draft_tokens_total"
    assert (_value(text, name, "0"), _value(text, name, "1"), _value(text, name, "all")) == (
        2,
        2,
        4,
    )
    assert _value(text, "dynaspec:num_requests_running", "all") == 3
    assert _value(text, "dynaspec:kv_cache_usage_perc", "all") == pytest.approx(0.25)
    assert text.count("# TYPE dynaspec:spec_decode_num_draft_tokens_total counter") == 1
