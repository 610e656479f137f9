"""Async scheduling and draft trees under data parallelism (docs/design.md §7, §7b, §4c): two
local ranks (gloo, tiny fp32 model) pipelining their steps with n-gram trees keep the lockstep
guarantees: one K per tick on every rank (the schedule's, from the agreed global view), and
greedy output identical to one synchronous rank."""

from __future__ import annotations

import pytest

from dynaspec import LLM, SamplingParams
from dynaspec.spec_decode.plan.plan import build_spec_plan
from tests.e2e.conftest import assert_greedy_equal, random_prompts
from tests.e2e.dp_helpers import assert_processes_gone
from tests.e2e.test_tree_spec import _branching_prompts

SCHEDULE = [[1, 4, 8], [5, 8, 6], [9, 64, 4]]
KW = dict(dtype="float32", num_kv_blocks=128, speculator="ngram", num_spec_tokens=8,
          k_schedule=SCHEDULE, prompt_lookup_min=1, draft_tree=True)


@pytest.fixture(scope="module")
def dp2_async(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, data_parallel_size=2, dp_rank_timeout_s=30.0,
              async_scheduling=True, **KW)
    pids = set(llm.engine.rank_pids().values())
    yield llm
    llm.shutdown()
    assert_processes_gone(pids)


def test_async_trees_dp2_greedy_equal_one_sync_rank_one_k_per_tick(dp2_async, tiny_llama_dir):
    eng = dp2_async.engine
    start = [len(log) for log in eng.query("decisions")]
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128)
    # branching n-gram matches (trees are drafted) and plain repetitive ones
    prompts = _branching_prompts(plain) + random_prompts(4, 280, seed=5, lo=4, hi=40,
                                                         repetitive=True)
    params = [SamplingParams(temperature=0, max_tokens=12 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]
    got = dp2_async.generate(prompts, params)
    ref = LLM(model=tiny_llama_dir, **{**KW, "draft_tree": False}).generate(prompts, params)
    for i, (p, r, g) in enumerate(zip(prompts, ref, got)):
        assert_greedy_equal(tiny_llama_dir, p, r.token_ids, g.token_ids, f"prompt {i}")
    counters = eng.query("counters")
    assert all(c.num_emitted_tokens > 0 for c in counters), "a rank stayed idle"
    assert sum(c.num_accepted_tokens for c in counters) > 0
    logs = [{t.tick: t for t in log[s:]} for log, s in zip(eng.query("decisions"), start)]
    ticks = sorted(set(logs[0]) & set(logs[1]))
    assert len(ticks) >= 10
    plan = build_spec_plan("ngram", 8, SCHEDULE)
    for t in ticks:
        d0, d1 = logs[0][t], logs[1][t]
        assert (d0.k, d0.num_reqs, d0.ctx_stat) == (d1.k, d1.num_reqs, d1.ctx_stat), \
            f"tick {t}: {d0} vs {d1}"
        assert d0.k == plan.k_for(d0.num_reqs, d0.ctx_stat)
        assert d0.num_reqs == d0.rank_reqs + d1.rank_reqs
    assert sum(c.num_tree_drafts for c in counters) > 0, "no tree was verified"
    for rank_ok in eng.query("integrity"):
        assert rank_ok is True
