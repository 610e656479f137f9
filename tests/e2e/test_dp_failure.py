"""Data parallelism with 3 local ranks: the seed case keeps K=2, then a rank is killed.

The seed bug (vLLM's global gating in `VllmConfig.__post_init__`): vLLM drops the K schedule under
data parallelism and runs the raw maximum, so --num-spec-tokens 3 with a schedule whose entries
all resolve to 2 ran K=3 on every rank. Here every rank must run K=2, read from its own counters,
before a rank is lost, while two ranks serve, and after its replacement joined (§7d)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dynaspec import LLM, SamplingParams
from tests.e2e.conftest import assert_greedy_equal, random_prompts
from tests.e2e.dp_helpers import assert_processes_gone, finish_all

# Generous: a loaded machine can stall a healthy rank for seconds, and a rank that misses the
# timeout is declared stuck. A killed rank is seen by its exit, not by this timeout.
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def dp3(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=96, data_parallel_size=3,
              speculator="ngram", num_spec_tokens=3, k_schedule=[[1, 8, 2], [9, 64, 2]],
              prompt_lookup_min=1, dp_rank_timeout_s=TIMEOUT_S)
    pids = set(llm.engine.rank_pids().values())
    yield llm
    pids |= set(llm.engine.rank_pids().values())  # the replacement's too
    llm.shutdown()
    assert_processes_gone(pids)


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


def _all_k2_in_lockstep(eng, start: list[int]) -> int:
    """Every rank ran K=2 in every tick since ``start`` (log lengths), and the ranks agree on
    each common tick's (K, global requests, context), the global count being their sum."""
    logs = [{t.tick: t for t in log[s:]} for log, s in zip(eng.query("decisions"), start)]
    common = sorted(set.intersection(*(set(log) for log in logs)))
    for t in common:
        rows = [log[t] for log in logs]
        assert len({(r.k, r.num_reqs, r.ctx_stat) for r in rows}) == 1, f"tick {t}: {rows}"
        assert rows[0].k == 2 and rows[0].num_reqs == sum(r.rank_reqs for r in rows), rows
    return len(common)


def test_killed_rank_costs_only_its_own_requests_and_is_replaced(dp3, tiny_llama_dir):
    eng = dp3.engine
    pids = eng.rank_pids()
    prompts = random_prompts(6, 280, seed=5, lo=4, hi=20, repetitive=True)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    ref = [o.token_ids for o in dp3.generate(prompts, params)]  # the run without a loss
    ids = [eng.add_request(p, params) for p in prompts]
    owners = {rid: eng.records[rid].rank for rid in ids}
    assert [owners[i] for i in ids] == [0, 1, 2, 0, 1, 2]  # least-loaded routing
    deadline = time.monotonic() + 60
    while not all(eng.records[i].token_ids for i in ids if owners[i] == 1):
        assert time.monotonic() < deadline, "rank 1 streamed nothing"
        eng._backlog = eng.step() + eng._backlog
    os.kill(pids[1], signal.SIGSTOP)  # frozen: what it is sent now it never reads
    queued = [eng.add_request(prompts[k], params, dp_rank=1) for k in (0, 1)]
    os.kill(pids[1], signal.SIGKILL)
    final = finish_all(eng, timeout_s=120)
    for k, rid in enumerate(ids):
        out = final[rid]
        if owners[rid] == 1:  # streamed on the lost rank: a clear error naming it
            assert out.finish_reason == "error", out
            assert "data-parallel rank 1 died (exit code -9)" in out.error, out.error
            assert "streamed token(s); not resumed" in out.error, out.error
        else:  # the survivors' requests: untouched, as in the run without the loss
            assert out.finish_reason == "length", out
            assert_greedy_equal(tiny_llama_dir, prompts[k], ref[k], out.token_ids, f"req {k}")
    for k, rid in zip((0, 1), queued):  # sent to rank 1, never read: re-queued elsewhere
        assert final[rid].finish_reason == "length", final[rid]
        assert_greedy_equal(tiny_llama_dir, prompts[k], ref[k], final[rid].token_ids, rid)
    r = eng.resilience
    assert (r.rank_losses, r.requeued, r.failed) == (1, 2, 2), r
    assert eng.wait_serving(3, timeout_s=180), f"rank 1 not replaced: {eng.health()}"
    assert eng.health()["status"] == "ok" and r.replacements == 1
    assert eng.rank_pids()[1] != pids[1]
    assert_processes_gone([pids[1]])
    # The seed's guarantee across the re-formed group: K=2 everywhere, one view per tick.
    start = [len(log) for log in eng.query("decisions")]
    more = random_prompts(9, 280, seed=12, lo=6, hi=30, repetitive=True)
    outs = dp3.generate(more, SamplingParams(temperature=0, max_tokens=16))
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert _all_k2_in_lockstep(eng, start) >= 5
    c = eng.query("counters")[1]  # the replacement's own counters
    assert set(c.steps_by_k) == {2} and c.num_draft_tokens > 0, c.steps_by_k
