"""Async scheduling driven by hand-built runner outputs: the invalid-draft channel (docs/design.md
§7b).

The real Scheduler, the real launch/land phases and the real AsyncStepLoop driver run; a fake
engine emits (folds records) and a fake runner plays prepare/run: it drafts
its whole budget, every draft is right (the target agrees) unless a test says otherwise, and it
emits accepted + 1 tokens, the token at output position p being `_tok(p)`. The worker thread
runs `run`, which only returns what `prepare` built, and the engine side waits for it before
applying it, so every test is deterministic. Each test states the step-by-step trace it expects
and checks num_drafts, num_draft_tokens, invalid_draft_tokens, skips and the identities.
"""

from __future__ import annotations

from types import SimpleNamespace

from dynaspec.config import SchedulerConfig
from dynaspec.engine.async_loop import AsyncStepLoop
from dynaspec.engine.phases import StepPhases, drop_ended
from dynaspec.engine.step_records import request_spec
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.metrics.records import StepStats
from dynaspec.metrics.stats import SpecCounters, fold_step
from dynaspec.outputs import RequestResult, RunnerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.sampling_params import SamplingParams
from dynaspec.scheduler.scheduler import Scheduler
from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.policies import make_policy

EOS = 2


def _tok(pos: int) -> int:
    return 100 + pos


class FakeRunner:
    """prepare: drafts = the budget; accepted = all of them unless `accept[rid]` says fewer."""

    def __init__(self) -> None:
        self.accept: dict[str, int] = {}
        self.forgotten: list[str] = []

    def prepare(self, out):  # type: ignore[no-untyped-def]
        results, drafts = [], {}
        for s in out.scheduled:
            r, rid = s.request, s.request.request_id
            if not s.sampling:
                results.append(RequestResult(request_id=rid, token_ids=(),
                                             skip_reason=s.skip_reason))
                continue
            d = s.draft_budget
            a = min(d, self.accept.get(rid, d))
            drafts[rid] = [_tok(r.num_output_tokens + j) for j in range(d)]
            toks = [_tok(r.num_output_tokens + j) for j in range(a + 1)]
            results.append(RequestResult(request_id=rid, token_ids=tuple(toks), num_draft_tokens=d,
                                         num_accepted_tokens=a,
                                         skip_reason=None if d else s.skip_reason,
                                         num_async_invalid_tokens=s.num_async_invalid))
        return SimpleNamespace(drafts=drafts, res=RunnerOutput(results=tuple(results)))

    def run(self, prepared):  # type: ignore[no-untyped-def]
        return prepared.res

    def forget(self, rid: str) -> None:
        self.forgotten.append(rid)


class Harness:
    """Scheduler + phases + AsyncStepLoop + fake runner; the harness is the engine the driver
    calls (schedule, launch, land, emit) and folds every emitted step like the engine."""

    def __init__(
        self,
        k: int = 4,
        num_blocks: int = 64,
        block_size: int = 4,
        drafter_max_len: int | None = None,
        stop=None,
    ) -> None:  # type: ignore[no-untyped-def]
        plan = build_spec_plan("ngram", k, None)
        kv = KVCacheManager(num_blocks, block_size, False)
        self.sch = Scheduler(SchedulerConfig(64, 16), kv, plan, make_policy(plan, "table"), 256,
                             (EOS,), drafter_max_len=drafter_max_len, stop_check=stop)
        self.runner = FakeRunner()
        self.phases = StepPhases(self.sch, self.runner)
        self.counters = SpecCounters()
        self.steps: list[StepStats] = []
        self.emitted: dict[str, list[int]] = {}
        self.loop = AsyncStepLoop(self)

    # ---- the engine's phases, as the driver calls them -----------------------------------
    def schedule(self):  # type: ignore[no-untyped-def]
        return self.sch.schedule()

    def launch(self, plan, worker=None):  # type: ignore[no-untyped-def]
        return self.phases.launch(plan, worker)

    def land(self, launched):  # type: ignore[no-untyped-def]
        return self.phases.land(launched)

    def emit(self, landed):  # type: ignore[no-untyped-def]
        if landed.error is not None:
            raise AssertionError(f"unexpected step failure: {landed.error!r}")
        landed = drop_ended(landed)
        specs = [request_spec(u.result, len(u.new_token_ids)) for u in landed.updates]
        step = StepStats(k=landed.plan.step_k, requests=(*specs, *landed.orphans))
        self.counters = fold_step(self.counters, step)
        self.steps.append(step)
        for u in landed.updates:
            self.emitted.setdefault(u.request.request_id, []).extend(u.new_token_ids)
        return []

    def release_runner_state(self, request_id: str) -> None:
        self.runner.forget(request_id)

    def add(self, rid: str, prompt_len: int = 6, **params) -> Request:  # type: ignore[no-untyped-def]
        req = Request(rid, [10 + i for i in range(prompt_len)],
                      SamplingParams(temperature=0, **params))
        self.sch.add_request(req)
        return req

    def run(self, max_calls: int = 200) -> None:
        for _ in range(max_calls):
            if not (self.sch.has_unfinished() or self.loop.busy):
                return
            self.loop.step()
        raise AssertionError("requests did not finish")

    def spec_of(self, step: int, rid: str):  # type: ignore[no-untyped-def]
        return next(r for r in self.steps[step].requests if r.request_id == rid)

    def assert_clean(self) -> None:
        assert self.counters.check_identities() == []
        assert self.counters.num_emitted_tokens == sum(map(len, self.emitted.values()))
        self.sch.kv.check_integrity()
        assert self.sch.kv.num_free_blocks() == self.sch.kv.num_blocks, "blocks leaked"
        assert not self.loop.busy and not self.loop._forgets


def test_drafter_skipped_after_scheduling_max_tokens():
    """Step 2 is formed while step 1 is in flight, so its cap assumes step 1 emitted one token
    (budget 4); step 1 emitted 5, which leaves room for 1 draft: 3 slots are placeholders."""
    h = Harness()
    a = h.add("a", max_tokens=8)
    h.run()
    assert a.output_token_ids == [_tok(p) for p in range(8)]
    assert a.status is RequestStatus.FINISHED_LENGTH
    # step 0 prefill (skip), step 1: 4 drafts all accepted, step 2: 1 valid + 3 placeholders.
    assert h.spec_of(1, "a").counts == (4, 4, 5)
    s2 = h.spec_of(2, "a")
    assert s2.counts == (1, 1, 2) and dict(s2.invalid_draft_tokens) == {"async_placeholder": 3}
    c = h.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (2, 5, 5)
    assert dict(c.invalid_draft_tokens) == {"async_placeholder": 3}
    assert dict(c.draft_skips) == {"prefill": 1}
    assert c.drafted_per_pos == (2, 1, 1, 1)
    h.assert_clean()


def test_all_drafts_invalid_is_an_all_invalid_skip():
    """max_tokens 7: after step 1 one token is left, so step 2's whole budget is invalid."""
    h = Harness()
    a = h.add("a", max_tokens=7)
    h.run()
    assert a.output_token_ids == [_tok(p) for p in range(7)]
    s2 = h.spec_of(2, "a")
    assert s2.counts == (0, 0, 1) and dict(s2.invalid_draft_tokens) == {"async_placeholder": 4}
    c = h.counters
    assert (c.num_drafts, c.num_draft_tokens) == (1, 4), "an all-invalid step is not a draft"
    assert dict(c.draft_skips) == {"prefill": 1, "all_invalid": 1}
    assert dict(c.invalid_draft_tokens) == {"async_placeholder": 4}
    h.assert_clean()


def test_drafter_length_cap_found_after_scheduling():
    """The drafter's position limit: at schedule time step 2's context was taken as 8 (room 6),
    at launch it is 12 (room 2 < 4): that request alone drafts nothing this step."""
    h = Harness(drafter_max_len=14)
    a = h.add("a", max_tokens=12)
    h.run()
    assert a.output_token_ids == [_tok(p) for p in range(12)]
    s2 = h.spec_of(2, "a")
    assert s2.counts == (0, 0, 1) and dict(s2.invalid_draft_tokens) == {"async_placeholder": 4}
    # Later steps are formed knowing the drafter is full: plain drafter_length skips, as sync.
    assert [h.spec_of(i, "a").skip_reason for i in range(3, len(h.steps))] == \
        ["drafter_length"] * (len(h.steps) - 4) + ["max_tokens"]
    c = h.counters
    assert c.draft_skips.get("all_invalid") == 1 and c.num_drafts == 1
    assert dict(c.invalid_draft_tokens) == {"async_placeholder": 4}
    h.assert_clean()


def test_stop_string_ends_the_request_in_the_step_that_found_it():
    """a's stop string is in step 1's tokens: the scheduler finds it when step 1 lands (the
    same check as sync), before step 2 launches, so a is dropped from step 2 (formed while step
    1 ran) and never drafts there: no placeholder, no orphan row. b, in the same batch, keeps
    its counts."""
    stop = lambda req, toks: next((i + 1 for i, t in enumerate(toks)  # noqa: E731
                                   if req.request_id == "a" and t == _tok(3)), None)
    h = Harness(stop=stop)
    a, b = h.add("a", max_tokens=20, stop=["<end>"]), h.add("b", max_tokens=11)
    h.run()
    assert (
        a.output_token_ids == [_tok(p) for p in range(4)]
        and a.status is RequestStatus.FINISHED_STOPPED
    )
    assert h.emitted["a"] == a.output_token_ids
    assert b.output_token_ids == [_tok(p) for p in range(11)]
    assert h.spec_of(1, "a").counts == (4, 4, 3)  # emitted after the stop-string cut
    assert all(r.request_id != "a" for st in h.steps[2:] for r in st.requests), \
        "a stopped in step 1: nothing of it runs in step 2"
    assert h.spec_of(2, "b").counts == (4, 4, 5)
    c = h.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (3, 12, 12)
    assert dict(c.invalid_draft_tokens) == {}
    assert dict(c.draft_skips) == {"prefill": 2}
    assert c.num_emitted_tokens == 15
    h.assert_clean()


def test_mixed_batch_only_some_invalid_and_rejections_roll_back():
    """a is cut by max_tokens after scheduling (partly invalid), b rejects drafts (rolled back
    exactly as sync), c is untouched: each request's record is its own."""
    h = Harness()
    a, b, c = h.add("a", max_tokens=8), h.add("b", max_tokens=12), h.add("c", max_tokens=12)
    h.runner.accept["b"] = 1
    h.run()
    for r in (a, b, c):
        assert r.output_token_ids == [_tok(p) for p in range(r.sampling_params.max_tokens)]
    sa, sb, sc = (h.spec_of(2, x) for x in "abc")
    assert sa.counts == (1, 1, 2) and dict(sa.invalid_draft_tokens) == {"async_placeholder": 3}
    assert sb.counts == (4, 1, 2) and not sb.invalid_draft_tokens
    assert sc.counts == (4, 4, 5) and not sc.invalid_draft_tokens
    total = h.counters
    assert total.invalid_draft_tokens.get("async_placeholder") == 3 + sum(
        r.invalid_draft_tokens.get("async_placeholder", 0)
        for st in h.steps[3:]
        for r in st.requests
    )
    assert total.num_draft_tokens == sum(r.num_draft_tokens for st in h.steps for r in st.requests)
    h.assert_clean()


def test_preempted_while_in_flight_keeps_its_tokens():
    """A pool too small for both requests' next step: forming it preempts b while b's step is in
    flight; b keeps that step's tokens and its recomputed output continues them."""
    h = Harness(k=2, num_blocks=6, block_size=4)
    a, b = h.add("a", prompt_len=8, max_tokens=10), h.add("b", prompt_len=8, max_tokens=10)
    h.run(max_calls=400)
    assert h.sch.num_preemptions > 0
    for r in (a, b):
        assert r.output_token_ids == [_tok(p) for p in range(10)], r.request_id
        assert h.emitted[r.request_id] == r.output_token_ids
    h.assert_clean()


def test_abort_while_in_flight_leaks_nothing():
    """Aborted with one step landed (outputs not returned) and the next in flight."""
    h = Harness()
    reqs = [h.add(f"r{i}", max_tokens=30) for i in range(4)]
    for _ in range(3):
        h.loop.step()
    assert h.loop.inflight is not None
    for r in reqs[:2]:
        assert h.sch.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED) is r
        h.loop.forget(r.request_id)
    assert h.runner.forgotten == [], "runner state is dropped only after the step lands"
    h.run()
    assert sorted(h.runner.forgotten) == ["r0", "r1"]
    # Aborted after step 1 landed (its tokens not yet returned) and while step 2 ran: both
    # rows are thrown away, so each request has two orphan records and emits nothing more.
    after = [r for st in h.steps[1:] for r in st.requests if r.request_id in ("r0", "r1")]
    assert [(r.counts, dict(r.invalid_draft_tokens)) for r in after] == \
        [((0, 0, 0), {"async_placeholder": 4})] * 4
    assert h.emitted["r0"] == [_tok(0)] and h.emitted["r1"] == [_tok(0)]
    for r in reqs[2:]:
        assert r.output_token_ids == [_tok(p) for p in range(30)]
    h.assert_clean()


def test_prometheus_carries_the_async_invalid_counters():
    """The steps the pipeline produced, exported: invalid tokens by reason, all_invalid skips,
    and draft tokens that exclude them, equal to the folded counters."""
    from prometheus_client.parser import text_string_to_metric_families

    from dynaspec.metrics.prometheus import PrometheusMetrics

    h = Harness()
    h.add("a", max_tokens=7)  # all invalid in step 2
    h.add("b", max_tokens=8)  # partly invalid in step 2
    h.run()
    m = PrometheusMetrics()
    for st in h.steps:
        m.observe_step(st)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    c, p = h.counters, "dynaspec:spec_decode_"
    assert c.invalid_draft_tokens["async_placeholder"] == 7
    assert got[(f"{p}invalid_draft_tokens_total", (("reason", "async_placeholder"),))] == 7
    assert (
        got[(f"{p}draft_skips_total", (("reason", "all_invalid"),))]
        == c.draft_skips["all_invalid"]
        == 1
    )
    assert got[(f"{p}num_draft_tokens_total", ())] == c.num_draft_tokens == 9
    assert got[(f"{p}num_drafts_total", ())] == c.num_drafts == 3
    h.assert_clean()


def test_async_scheduling_flag_reaches_the_engine_config():
    from dynaspec.config import EngineConfig
    from dynaspec.engine_flags import parse_engine_args

    on = EngineConfig.from_kwargs(**parse_engine_args(["--async-scheduling"]))
    off = EngineConfig.from_kwargs(**parse_engine_args([]))
    assert on.scheduler.async_scheduling is True and off.scheduler.async_scheduling is False


def test_async_scheduling_composes_with_data_parallel_and_trees():
    """Accepted at configuration (run: tests/e2e/test_dp_async.py, test_composition_matrix.py)."""
    from dynaspec.config import EngineConfig

    cfg = EngineConfig.from_kwargs(async_scheduling=True, data_parallel_size=2,
                                   speculator="ngram", num_spec_tokens=4, draft_tree=True)
    assert cfg.scheduler.async_scheduling and cfg.parallel.data_parallel_size == 2
