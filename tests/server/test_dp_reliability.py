"""`bench reliability --scenario rank-kill`: the scenario runs end to end on the tiny checkpoint
(2 ranks, a few dozen streams) and its checks that do not read a clock pass. The timed ones
(the survivor's token gap, the time to full strength) are figures for an idle machine
(docs/history/benchmarks-waves-1-4.md), not assertions on a shared one; here they must only be
measured.
"""

from __future__ import annotations

from dynaspec.bench.reliability import run_scenario, scenario_engine_kwargs
from dynaspec.engine_flags import parse_engine_args

UNTIMED = ("rank_lost_once", "every_unstreamed_request_completed", "failures_name_rank_1",
           "only_streaming_requests_failed", "kv_pools_whole")


def test_rank_kill_scenario_serves_through_the_loss(tiny_llama_dir):
    kw = scenario_engine_kwargs("rank-kill", parse_engine_args(["--model", tiny_llama_dir]))
    kw = {**kw, "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256}
    result = run_scenario("rank-kill", kw, requests=30, concurrency=6, seed=2, scale=1.5)
    failed = [name for name in UNTIMED if not result["checks"][name]]
    assert not failed, (failed, result)
    assert result["completed"] + result["failed"] == result["requests"] == 30
    assert result["failed"] == result["failed_by_engine_count"]  # each failure is the rank's
    assert result["replacements"] == 1, result
    assert result["survivor_longest_gap_s"] >= 0 and result["signal_to_full_strength_s"] > 0
