"""Data parallelism with 2 local ranks (gloo, tiny fp32 model): one shared engine for the module.

Order matters and is the file's order: the last test stops a rank (SIGSTOP) and checks that the
engine names it when its heartbeat goes silent, fails only the requests that had streamed on
it, finishes the other rank's exactly as without the loss, replaces it, and leaves no process
behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from dynaspec import LLM, SamplingParams
from dynaspec.spec_decode.plan.plan import build_spec_plan
from tests.e2e.conftest import assert_greedy_equal, random_prompts
from tests.e2e.dp_helpers import assert_processes_gone, finish_all

SCHEDULE = [[1, 2, 3], [3, 5, 2], [6, 64, 1]]
KW = dict(dtype="float32", num_kv_blocks=128, speculator="ngram", num_spec_tokens=3,
          k_schedule=SCHEDULE, prompt_lookup_min=1)  # auto + a schedule: the table
# Generous enough that a loaded machine's stall of a healthy rank is not taken for a stuck
# rank; the stuck-rank test below waits for it once.
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def dp2(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, data_parallel_size=2, dp_rank_timeout_s=TIMEOUT_S, **KW)
    pids = set(llm.engine.rank_pids().values())
    yield llm
    pids |= set(llm.engine.rank_pids().values())  # a replacement's too
    llm.shutdown()
    assert_processes_gone(pids)


def test_greedy_equals_single_rank(dp2, tiny_llama_dir):
    prompts = random_prompts(8, 280, seed=3, lo=4, hi=40, repetitive=True)
    params = SamplingParams(temperature=0, max_tokens=20)
    got = dp2.generate(prompts, params)
    ref = LLM(model=tiny_llama_dir, **KW).generate(prompts, params)
    for i, (p, r, g) in enumerate(zip(prompts, ref, got)):
        assert g.finish_reason == r.finish_reason or g.token_ids != r.token_ids
        assert_greedy_equal(tiny_llama_dir, p, r.token_ids, g.token_ids, f"prompt {i}")
    emitted = [c.num_emitted_tokens for c in dp2.engine.query("counters")]
    assert all(n > 0 for n in emitted), f"least-loaded routing left a rank idle: {emitted}"
    assert sum(emitted) == dp2.engine.counters.num_emitted_tokens


def test_variable_schedule_same_k_on_every_rank_at_different_load(dp2):
    eng = dp2.engine
    start = [len(log) for log in eng.query("decisions")]
    # Rank 0 carries six requests that finish at different times, rank 1 one long one: the
    # global batch walks down the schedule's buckets while the ranks' own loads differ. Rank
    # 1's goes first, so both ranks log from the first tick of the widest batch (K=1) on.
    eng.add_request(
        [9, 10, 11, 9, 10], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), dp_rank=1
    )
    for i in range(6):
        eng.add_request([5 + i, 6, 7, 5 + i, 6, 7], SamplingParams(
            temperature=0, max_tokens=3 + 8 * i, ignore_eos=True), dp_rank=0)
    finish_all(eng)
    logs = [{t.tick: t for t in log[s:]} for log, s in zip(eng.query("decisions"), start)]
    # Each rank answered the query at its own moment: compare the ticks both had run.
    lo, hi = max(min(log) for log in logs), min(max(log) for log in logs)
    ticks = list(range(lo, hi + 1))
    assert len(ticks) >= 15 and all(t in log for log in logs for t in ticks), \
        "ranks did not step in lockstep"
    plan = build_spec_plan("ngram", 3, SCHEDULE)
    ks, uneven = set(), 0
    for t in ticks:
        d0, d1 = logs[0][t], logs[1][t]
        assert (d0.k, d0.num_reqs, d0.ctx_stat) == (d1.k, d1.num_reqs, d1.ctx_stat), \
            f"tick {t}: rank 0 {d0} vs rank 1 {d1}"
        assert d0.k == plan.k_for(d0.num_reqs, d0.ctx_stat)
        assert d0.num_reqs == d0.rank_reqs + d1.rank_reqs
        ks.add(d0.k)
        uneven += d0.rank_reqs != d1.rank_reqs
    print(f"{len(ticks)} lockstep ticks, K values {sorted(ks)}, {uneven} with uneven load")
    assert {1, 2, 3} <= ks, f"the global batch should pass every bucket, K seen {ks}"
    assert uneven >= len(ticks) // 2


def test_abort_frees_blocks_on_the_owning_rank(dp2):
    eng = dp2.engine
    # Sampled at temperature 1 the n-gram drafter rarely matches: about one token per step, so
    # the request runs for ~240 steps and is still running when the abort arrives.
    rid = eng.add_request([3, 4, 5], SamplingParams(temperature=1.0, seed=7, max_tokens=240,
                                                    ignore_eos=True), dp_rank=1)
    got = 0
    deadline = time.monotonic() + 60
    while got < 3 and time.monotonic() < deadline:
        got += sum(len(o.new_token_ids) for o in eng.step() if o.request_id == rid)
    kv = eng.query("kv")
    assert kv[1]["num_free_blocks"] < kv[1]["num_blocks"] and kv[1]["num_unfinished"] == 1
    assert kv[0]["num_free_blocks"] == kv[0]["num_blocks"]
    assert eng.abort_request(rid) and not eng.has_unfinished_requests()
    kv = eng.query("kv")  # the abort reaches rank 1 before the query (one ordered channel)
    assert kv[1]["num_free_blocks"] == kv[1]["num_blocks"] and kv[1]["num_unfinished"] == 0
    eng.check_integrity()


def test_bad_prompt_is_refused_before_routing(dp2):
    before = dict(dp2.engine.records)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dp2.engine.add_request([1, 99999], SamplingParams(max_tokens=2))
    assert dp2.engine.records == before and dp2.engine.load == [0, 0]


def test_stuck_rank_costs_only_its_streamed_requests_and_is_replaced(dp2, tiny_llama_dir):
    eng = dp2.engine
    pids = eng.rank_pids()
    prompts = random_prompts(4, 280, seed=8, lo=4, hi=12, repetitive=True)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    ref = [o.token_ids for o in dp2.generate(prompts, params)]  # the run without a loss
    ids = [eng.add_request(p, params, dp_rank=k % 2) for k, p in enumerate(prompts)]
    deadline = time.monotonic() + 60
    while not all(eng.records[rid].token_ids for rid in ids):
        assert time.monotonic() < deadline, "a request streamed nothing"
        eng._backlog = eng.step() + eng._backlog
    os.kill(pids[0], signal.SIGSTOP)  # alive to the OS, but its heartbeat stops (default 1 s)
    t0 = time.monotonic()
    final = finish_all(eng, timeout_s=120)
    elapsed = time.monotonic() - t0
    assert set(final) == set(ids)
    for k, rid in enumerate(ids):
        out = final[rid]
        if k % 2 == 0:
            assert out.finish_reason == "error", out
            # named by its heartbeat, long before the exchange's timeout (the backstop)
            assert "data-parallel rank 0 stopped answering (no heartbeat" in out.error, out.error
        else:  # rank 1 kept stepping its own requests, exactly as without the loss
            assert out.finish_reason == "length", out
            assert_greedy_equal(tiny_llama_dir, prompts[k], ref[k], out.token_ids, f"req {k}")
    # The backstop's bound (rank 1 waits grace + idle poll + 2 x the longest step, then the
    # front end settles 1 s) with a generous margin (a loaded machine), never a tight clock.
    assert elapsed < 2 * (TIMEOUT_S + 1.0) + 60, f"failure took {elapsed:.1f} s to surface"
    assert eng.failure() is None  # rank 1 serves: /health 200, degraded
    assert_processes_gone([pids[0]])  # the stopped rank was killed, not left behind
    assert eng.wait_serving(2, timeout_s=180), f"rank 0 not replaced: {eng.health()}"
    assert eng.resilience.rank_losses == 1 and eng.resilience.replacements == 1
    out = dp2.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=20,
                                                    ignore_eos=True))[0]
    assert_greedy_equal(tiny_llama_dir, prompts[0], ref[0][:20], out.token_ids, "after")
