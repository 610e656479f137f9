"""Data parallelism with 3 local ranks: the seed case keeps K=2, then a rank is killed.

The seed bug (reference/vllm-spec-decode.md §1.6): vLLM drops the K schedule under data
parallelism and runs the raw maximum, so --num-spec-tokens 3 with a schedule whose entries all
resolve to 2 ran K=3 on every rank. Here every rank must run K=2, read from its own counters.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from dynaspec import LLM, SamplingParams
from tests.e2e.conftest import random_prompts
from tests.e2e.dp_helpers import assert_processes_gone, finish_all

# Generous: a loaded machine can stall a healthy rank for seconds, and a rank that misses the
# timeout is declared stuck. A killed rank is seen by its exit, not by this timeout.
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def dp3(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=96, data_parallel_size=3,
              speculator="ngram", num_spec_tokens=3, k_schedule=[[1, 8, 2], [9, 64, 2]],
              prompt_lookup_min=1, dp_rank_timeout_s=TIMEOUT_S)
    pids = llm.engine.rank_pids()
    yield llm
    llm.shutdown()
    assert_processes_gone(pids.values())


def test_seed_case_runs_k2_on_every_rank(dp3):
    eng = dp3.engine
    assert (eng.plan.kind, eng.plan.max_k) == ("constant", 2)
    prompts = random_prompts(9, 280, seed=11, lo=6, hi=30, repetitive=True)
    outs = dp3.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    per_rank = eng.query("counters")
    for rank, c in enumerate(per_rank):
        assert set(c.steps_by_k) == {2} and c.steps_by_k[2] > 0, f"rank {rank}: {c.steps_by_k}"
        assert len(c.drafted_per_pos) <= 2, f"rank {rank} drafted a third position"
        assert c.num_draft_tokens > 0, f"rank {rank} never drafted"
    assert sum(c.steps_by_k[2] for c in per_rank) == eng.counters.steps_by_k[2]


def test_killed_rank_errors_its_requests_and_leaves_no_process(dp3):
    eng = dp3.engine
    pids = eng.rank_pids()
    ids = [eng.add_request([7, 8, 9, 7, 8], SamplingParams(temperature=0, max_tokens=200,
                                                           ignore_eos=True)) for _ in range(6)]
    owners = {rid: eng.records[rid].rank for rid in ids}
    assert sorted(owners.values()) == [0, 0, 1, 1, 2, 2]  # least-loaded routing
    for _ in range(15):
        eng.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    final = finish_all(eng, timeout_s=60)
    elapsed = time.monotonic() - t0
    for rid in ids:
        out = final[rid]
        assert out.finish_reason == "error"
        if owners[rid] == 1:
            assert "data-parallel rank 1 died (exit code -9)" in out.error, out.error
        else:
            assert "shut down: data-parallel rank 1 died" in out.error, out.error
    assert elapsed < TIMEOUT_S, f"failure took {elapsed:.1f} s to surface (a death, not a timeout)"
    assert_processes_gone(pids.values())
    with pytest.raises(RuntimeError, match="rank 1 died"):
        dp3.generate([[4, 5]], SamplingParams(max_tokens=2))
