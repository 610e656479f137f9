"""Scheduler driven by hand-built RunnerOutputs (docs/design.md §9): no model, no runner.

Each test plays the runner's part: it reads the StepPlan and answers with the tokens a
model would have emitted (accepted drafts + one), then checks the counters, the block tables and
the pool. A token a request emits at output position p is `_tok(p)`, so a recomputed request
must reproduce the same output as one that never left the pool.
"""

from __future__ import annotations

import pytest

from dynaspec.config import SchedulerConfig
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.outputs import RequestResult, RunnerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.sampling_params import SamplingParams
from dynaspec.scheduler.scheduler import Scheduler
from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.policies import make_policy
from dynaspec.step_plan import StepPlan

EOS = 2


def _tok(pos: int) -> int:
    return 100 + pos  # never EOS, never a stop token unless a test asks


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_seqs: int = 16,
         spec: tuple = ("none", 0, None), max_model_len: int = 256,
         prefix_caching: bool = False) -> Scheduler:
    plan = build_spec_plan(*spec)
    policy = make_policy(plan, "table") if plan.speculating else None
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return Scheduler(SchedulerConfig(budget, max_seqs), kv, plan, policy, max_model_len, (EOS,))


def add(sch: Scheduler, rid: str, prompt_len: int, **params) -> Request:
    params.setdefault("max_tokens", 16)
    req = Request(
        rid, [10 + i % 50 for i in range(prompt_len)], SamplingParams(temperature=0, **params)
    )
    sch.add_request(req)
    return req


def respond(out: StepPlan, answers: dict[str, tuple[list[int], int]] | None = None) -> RunnerOutput:
    """The runner's answer: per sampling request (tokens, drafts verified); default one token."""
    results = []
    for s in out.scheduled:
        r = s.request
        if not s.sampling:
            results.append(RequestResult(request_id=r.request_id, token_ids=(),
                                         skip_reason=s.skip_reason))
            continue
        tokens, drafted = (answers or {}).get(r.request_id, ([_tok(r.num_output_tokens)], 0))
        assert drafted <= s.draft_budget, "the runner may not verify more drafts than budgeted"
        results.append(RequestResult(request_id=r.request_id, token_ids=tuple(tokens),
                                     num_draft_tokens=drafted, num_accepted_tokens=len(tokens) - 1,
                                     skip_reason=None if drafted else s.skip_reason))
    return RunnerOutput(results=tuple(results))


def step(sch: Scheduler, answers=None):  # type: ignore[no-untyped-def]
    out = sch.schedule()
    return out, sch.update(out, respond(out, answers))


def drain(sch: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sch.has_unfinished():
            return
        step(sch)
    raise AssertionError("requests did not finish")


def assert_pool_clean(sch: Scheduler) -> None:
    sch.kv.check_integrity()
    assert sch.kv.num_free_blocks() == sch.kv.num_blocks, "blocks leaked"


def blocks_for(sch: Scheduler, num_tokens: int) -> int:
    return -(-num_tokens // sch.kv.block_size)


# ---- chunked prefill ---------------------------------------------------------------------------
def test_chunked_prefill_catches_up_under_the_budget():
    sch = make(budget=8)
    a = add(sch, "a", 20)
    chunks = []
    for _ in range(3):
        out, ups = step(sch)
        (s,) = out.scheduled
        chunks.append(s.num_new_tokens)
        assert len(sch.kv.block_table("a")) == blocks_for(sch, a.num_computed_tokens)
    assert chunks == [8, 8, 4]
    assert a.output_token_ids == [_tok(0)]  # only the last chunk samples
    assert a.num_computed_tokens == 20  # the sampled token has no KV yet
    out, _ = step(sch)
    assert out.scheduled[0].num_new_tokens == 1 and a.num_computed_tokens == 21


def test_budget_is_shared_running_first_then_the_queue():
    sch = make(budget=10)
    a = add(sch, "a", 3)
    step(sch)  # a prefilled, now decoding
    add(sch, "b", 30)
    out, ups = step(sch)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert [u.new_token_ids for u in ups] == [[_tok(1)], []]
    assert out.scheduled[1].skip_reason is None  # speculation is off: no skip reasons at all
    assert a.num_output_tokens == 2


# ---- preemption by recompute -------------------------------------------------------------------
def test_preemption_by_recompute_and_recovery():
    sch = make(num_blocks=6, block_size=4)  # 24 slots for two requests that need 2 x 20
    a, b = add(sch, "a", 8, max_tokens=12), add(sch, "b", 8, max_tokens=12)
    preempted_at = None
    for n in range(200):
        out, _ = step(sch)
        if out.preempted_ids and preempted_at is None:
            preempted_at = n
            assert out.preempted_ids == ("b",)  # the last admitted is the victim
            assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert sch.waiting[0] is b and sch.kv.block_table("b") == []
            assert b.num_output_tokens > 0  # its output is kept, to be recomputed
            kept = list(b.output_token_ids)
        if not sch.has_unfinished():
            break
    assert preempted_at is not None and sch.num_preemptions >= 1 and b.num_preemptions >= 1
    assert b.output_token_ids[:len(kept)] == kept
    # Recovered: each finished with the output it would have had alone.
    for r in (a, b):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [_tok(p) for p in range(12)]
    assert_pool_clean(sch)


def test_recomputed_request_prefills_prompt_and_output_together():
    sch = make(num_blocks=5, block_size=4, budget=64)
    add(sch, "a", 8, max_tokens=10)
    b = add(sch, "b", 8, max_tokens=10)
    while not b.num_preemptions:
        step(sch)
    need = b.num_tokens  # prompt + output so far
    while True:
        out = sch.schedule()
        entry = next((s for s in out.scheduled if s.request is b), None)
        if entry is not None:
            break
        sch.update(out, respond(out))
    assert entry.num_new_tokens == need and entry.sampling  # one chunk, then it samples
    sch.update(out, respond(out))
    drain(sch)
    assert b.output_token_ids == [_tok(p) for p in range(10)]
    assert_pool_clean(sch)


# ---- speculation: rollback of rejected drafts --------------------------------------------------
def test_rejected_drafts_are_rolled_back():
    sch = make(spec=("ngram", 3, None), block_size=4, prefix_caching=True)
    a = add(sch, "a", 6, max_tokens=20)
    step(sch)  # prefill -> 1 output token, now decoding
    out = sch.schedule()
    (s,) = out.scheduled
    assert s.draft_budget == 3 and out.step_k == 3
    # KV lookahead: the decoded token plus 3 draft slots are allocated.
    assert len(sch.kv.block_table("a")) == blocks_for(sch, a.num_tokens + 3)
    before = a.num_tokens
    ups = sch.update(out, respond(out, {"a": ([_tok(1), _tok(2)], 3)}))  # 1 of 3 accepted
    assert ups[0].new_token_ids == [_tok(1), _tok(2)]
    # KV is valid through the accepted draft; the 2 rejected slots are rewritten next step.
    assert a.num_computed_tokens == before + 1 == a.num_tokens - 1
    state = sch.kv._reqs["a"]
    assert state.num_cached_blocks * sch.kv.block_size <= a.num_computed_tokens
    out, _ = step(sch, {"a": ([_tok(3)], 3)})  # all 3 rejected
    assert out.scheduled[0].num_new_tokens == 1
    assert a.num_computed_tokens == a.num_tokens - 1
    drain(sch)
    assert a.output_token_ids == [_tok(p) for p in range(20)]
    assert_pool_clean(sch)


# ---- finishing in the middle of an accepted run ------------------------------------------------
def _decoding(spec_k: int = 4, **params):  # type: ignore[no-untyped-def]
    sch = make(spec=("ngram", spec_k, None), max_model_len=params.pop("max_model_len", 256))
    req = add(sch, "a", params.pop("prompt_len", 6), **params)
    step(sch)  # prefill: one output token
    return sch, req


@pytest.mark.parametrize(
    "case", ["eos", "stop_token", "max_tokens", "max_model_len", "stop_string"]
)
def test_finish_in_the_middle_of_an_accepted_run(case):
    params = {"max_tokens": 20}
    if case == "stop_token":
        params["stop_token_ids"] = (102,)
    if case == "max_tokens":
        params["max_tokens"] = 3
    if case == "max_model_len":
        params.update(prompt_len=8, max_model_len=11)  # 8 prompt + 1 output + 2 more fit
    if case == "stop_string":  # the hook runs only for requests with stop strings
        params["stop"] = ["</s>"]
    sch, req = _decoding(**params)
    run = [_tok(1), EOS if case == "eos" else _tok(2), _tok(3), _tok(4), _tok(5)]
    if case == "stop_string":  # the output processor's hook: a stop string ends at run[1]
        sch.stop_check = lambda r, toks: 2 if len(toks) >= 2 else None
    out = sch.schedule()
    assert out.scheduled[0].draft_budget >= 2 or case in ("max_tokens", "max_model_len")
    drafted = min(4, out.scheduled[0].draft_budget)
    (u,) = sch.update(out, respond(out, {"a": (run[: drafted + 1], drafted)}))
    expect = {
        "eos": (2, RequestStatus.FINISHED_STOPPED),
        "stop_token": (2, RequestStatus.FINISHED_STOPPED),
        "max_tokens": (2, RequestStatus.FINISHED_LENGTH),
        "max_model_len": (2, RequestStatus.FINISHED_LENGTH),
        "stop_string": (2, RequestStatus.FINISHED_STOPPED),
    }[case]
    assert u.finished and req.status is expect[1]
    assert (
        u.new_token_ids == run[: expect[0]] and req.output_token_ids == [_tok(0)] + run[: expect[0]]
    )
    assert req.stop_reason == (102 if case == "stop_token" else None)
    assert sch.requests == {} and not sch.running
    assert_pool_clean(sch)  # finished and freed in the same update


def test_max_tokens_caps_the_draft_budget():
    sch, req = _decoding(max_tokens=3)  # 1 emitted, 2 left: at most 1 draft + 1 bonus
    out = sch.schedule()
    assert out.scheduled[0].draft_budget == 1 and out.step_k == 4


# ---- abort ---------------------------------------------------------------------------------------
def test_abort_while_waiting_and_while_running():
    sch = make(budget=16)
    a, b = add(sch, "a", 10), add(sch, "b", 10)
    c = add(sch, "c", 10)
    out, _ = step(sch)  # a prefilled, b got 6 of 10, c waits
    assert c in sch.waiting and b in sch.running
    assert sch.finish_request("c", RequestStatus.FINISHED_ABORTED) is c
    assert c not in sch.waiting and c.status is RequestStatus.FINISHED_ABORTED
    assert sch.finish_request("b", RequestStatus.FINISHED_ABORTED) is b  # mid-prefill
    assert sch.kv.block_table("b") == []
    assert sch.finish_request("b", RequestStatus.FINISHED_ABORTED) is None  # idempotent
    # Aborted between schedule and update: the step's result for it is dropped.
    out = sch.schedule()
    sch.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert sch.update(out, respond(out)) == []
    assert a.num_output_tokens == 1
    assert not sch.has_unfinished()
    assert_pool_clean(sch)


# ---- the draft budget is charged for the step's K, not the plan's maximum ----------------------
VARIABLE = ("ngram", 0, "[[1, 1, 4], [2, 64, 0]]")  # K=4 alone, K=0 in any batch of 2+


def test_k_zero_step_charges_one_token_per_decode():
    sch = make(spec=VARIABLE, budget=8, block_size=4)
    reqs = [add(sch, f"r{i}", 1) for i in range(6)]
    out = sch.schedule()
    # Charged 1 each (K=0 for a batch of 6), all six fit the budget of 8; charging 1+max_k
    # would have fitted one request with drafts and three without.
    assert len(out.scheduled) == 6 and out.step_k == 0
    assert all(s.draft_budget == 0 and s.skip_reason == "schedule_zero" for s in out.scheduled)
    # No KV lookahead either: one token, one block.
    assert all(len(sch.kv.block_table(r.request_id)) == 1 for r in reqs)
    sch.update(out, respond(out))
    drain(sch)
    assert_pool_clean(sch)


def test_k_of_a_lone_request_is_reserved_in_budget_and_kv():
    sch = make(spec=VARIABLE, budget=8, block_size=4)
    r = add(sch, "alone", 1)
    out = sch.schedule()
    (s,) = out.scheduled
    assert out.step_k == 4 and s.draft_budget == 4
    assert len(sch.kv.block_table("alone")) == blocks_for(sch, r.num_tokens + 4)


def test_draft_budget_never_exceeds_what_was_reserved():
    # Predicted a batch of 2 (K=0), but the queued request finds no KV room, so the batch is
    # 1 (K=4): the step's K is clamped to the reserved K=0, since no slots were reserved for
    # drafts, so the running request verifies none and the step is plain decode (width 1).
    sch = make(spec=VARIABLE, num_blocks=3, block_size=4)
    add(sch, "a", 1)
    step(sch)
    add(sch, "b", 40)
    out = sch.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"] and out.step_k == 0
    assert out.batch.width == 1
    assert out.scheduled[0].draft_budget == 0 and out.scheduled[0].skip_reason == "schedule_zero"
    # max_num_seqs 1: the queue cannot join, so the prediction is a batch of 1 and K=4.
    sch = make(spec=VARIABLE, max_seqs=1, block_size=4)
    add(sch, "a", 1)
    step(sch)
    add(sch, "b", 4)
    out = sch.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"] and out.scheduled[
        0
    ].draft_budget == 4


def test_token_budget_too_small_for_the_drafts_skips_them_with_a_reason():
    sch = make(spec=("ngram", 4, None), budget=3)
    add(sch, "a", 1)
    out = sch.schedule()
    assert out.scheduled[0].draft_budget == 0 and out.scheduled[0].skip_reason == "token_budget"
