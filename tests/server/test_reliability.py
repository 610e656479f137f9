"""`bench reliability`: each scenario's core check, on the tiny checkpoint with small counts.

The figures in docs/history/benchmarks-waves-1-4.md come from the same functions at full size on the
default model; here every scenario must pass its checks, and the checks must be the ones that matter
(preemptions really happened, requests really were aborted in the engine, fuzzed requests really
reached it).
"""

from __future__ import annotations

import pytest

from dynaspec.bench.reliability import run_scenario, scenario_engine_kwargs
from dynaspec.engine_flags import parse_engine_args


def _kwargs(scenario: str, model: str, **over) -> dict:
    kw = scenario_engine_kwargs(scenario, parse_engine_args(["--model", model]))
    return {**kw, "dtype": "float32", **over}


def _assert_passed(result: dict) -> None:
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert result["ok"] and not failed, (failed, result)
    assert result["leaks"] == {}, result["held"]


def test_fuzz_reaches_the_engine_without_server_errors(tiny_llama_dir):
    pytest.importorskip("schemathesis")
    result = run_scenario("fuzz", _kwargs("fuzz", tiny_llama_dir), requests=40, seed=3)
    _assert_passed(result)
    assert result["reached_engine"] >= 40 and result["server_errors"] == 0
    assert set(result["by_status"]) - {"200"}, "validation was never exercised"


def test_overload_preempts_and_matches_the_unloaded_run(tiny_llama_dir):
    kw = _kwargs("overload", tiny_llama_dir, num_kv_blocks=10, max_model_len=256)
    result = run_scenario("overload", kw, requests=16, seed=1, scale=0.05)
    _assert_passed(result)
    assert result["preemptions"] > 0 and result["reference_preemptions"] == 0
    assert result["failed"] == 0 and result["mismatches"] == 0


def test_abort_storm_leaks_nothing(tiny_llama_dir):
    kw = _kwargs("abort", tiny_llama_dir, max_model_len=256, max_num_batched_tokens=32)
    result = run_scenario("abort", kw, requests=60, seed=2, scale=0.03)
    _assert_passed(result)
    assert result["aborted_in_engine"] >= 3, result["aborted_where"]


def test_abort_storm_with_a_draft_model_frees_drafter_kv(tiny_llama_dir):
    kw = _kwargs("abort", tiny_llama_dir, max_model_len=256, max_num_batched_tokens=32,
                 speculator="draft", draft_model=tiny_llama_dir, num_spec_tokens=3)
    result = run_scenario("abort", kw, requests=30, seed=4, scale=0.03)
    _assert_passed(result)
    assert result["held"]["drafter_kv_blocks_held"] == 0 and result["aborted_in_engine"] >= 1


def test_soak_smoke(tiny_llama_dir):
    kw = _kwargs("soak", tiny_llama_dir, max_model_len=256, num_kv_blocks=256)
    result = run_scenario("soak", kw, duration_s=3.0, concurrency=8, seed=5, scale=0.1)
    _assert_passed(result)
    assert result["requests"] > 0 and result["errors"] == 0
    assert len(result["rss_mb_samples"]) >= 2 and result["latency_s"]["p99"] is not None


def test_disconnects_lose_nothing_and_metrics_account_for_all(tiny_llama_dir):
    kw = _kwargs("disconnect", tiny_llama_dir, max_model_len=256, num_kv_blocks=256)
    result = run_scenario("disconnect", kw, requests=60, concurrency=12, seed=6, scale=0.1)
    _assert_passed(result)
    assert result["cut_by_client"] == 3 and result["aborted_in_engine"] >= 1, result
    assert result["completed"] == 57 and result["metrics_ended_by_reason"]["length"] >= 57
    assert result["metrics_generation_tokens"] >= result["streamed_tokens"] == 57 * 32
