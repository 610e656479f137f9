"""Continuous batching with the counter model: each step, every request catches up under a budget.

A request carries `num_computed_tokens`; the scheduler grants it the tokens it still has to
compute (chunked under `max_num_batched_tokens`), plus a draft budget on steps where it samples.
`schedule()` returns the step's immutable `StepPlan`; how its K, caps and width are reserved,
decided, clamped and described is `spec_decode/plan/step_width.py`, which this module only calls.
After verification, `num_computed_tokens` advances past the accepted drafts only, so the slots of
rejected drafts are rewritten next step. Preemption is by recompute: the victim frees its blocks
and rejoins the front of the queue; its output so far is kept and its prompt+output recomputed.
The scheduler is the only writer of a request's counters: `update` applies a step's result and
is the one place that decides a request's end (EOS, stop token, stop string through
`stop_check`, max_tokens, max_model_len), before its blocks are cached or freed; under async
scheduling `hold`/`release` advance and restore the counters of a step in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dynaspec.config import SchedulerConfig
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.outputs import RequestResult, RunnerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.spec_decode.plan import step_width as width
from dynaspec.spec_decode.plan.execution_plan import ExecutionPlan
from dynaspec.spec_decode.plan.plan import SpecPlan
from dynaspec.spec_decode.plan.step_width import (
    GlobalStepView,
    RequestView,
    Reserve,
    StepK,
    StepView,
)
from dynaspec.spec_decode.policy.k_policy import KPolicy
from dynaspec.step_plan import ScheduledRequest, StepPlan

# (request, tokens about to be appended) -> how many of them to keep because a stop string
# ended the request with the last kept one, or None. The engine's output processor provides it;
# it is called only for requests with stop strings.
StopCheck = Callable[[Request, list[int]], "int | None"]


@dataclass(frozen=True)
class StepUpdate:
    """What `update` hands the engine: per request, the tokens it emitted this step."""

    request: Request
    new_token_ids: list[int]
    result: RequestResult
    finished: bool


@dataclass(frozen=True)
class Hold:
    """A launched step's counter advance (async scheduling), undone by `release`."""

    request: Request
    advance: int  # new tokens + drafts in flight, added to num_computed_tokens
    num_preemptions: int  # at launch: a request preempted since restarts from 0 instead


@dataclass
class _Row:
    """A request being placed in the step (mutable while the step forms)."""

    request: Request
    num_new_tokens: int
    lookahead: int
    reason: str | None
    sampling: bool


GRAMMAR_DEAD_END = "grammar dead end"  # the server answers 400 for errors that start so


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, plan: SpecPlan,
                 policy: KPolicy | None, max_model_len: int, eos_token_ids: tuple[int, ...], *,
                 drafter_max_len: int | None = None, exec_plan: ExecutionPlan | None = None,
                 stop_check: StopCheck | None = None) -> None:
        self.cfg, self.kv, self.plan, self.policy = cfg, kv, plan, policy
        self.exec_plan = exec_plan or ExecutionPlan.build(plan, cfg.max_num_seqs)
        self._may_pad = width.may_pad(self.exec_plan)
        self.max_model_len = max_model_len
        self.eos = frozenset(eos_token_ids)
        self.drafter_max_len = drafter_max_len
        self.stop_check = stop_check
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (abort, stop string, error) a request wherever it is; frees its KV blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        if self.policy is not None:
            self.policy.forget(request_id)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule -----------------------------------------------------------------------
    def step_view(self) -> StepView:
        """The batch this step will most likely form: every running request plus the queue up
        to max_num_seqs, with its decoding requests' views (what data-parallel ranks exchange)."""
        room = max(0, self.cfg.max_num_seqs - len(self.running))
        num_reqs = len(self.running) + min(len(self.waiting), room)
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        return StepView(tuple(map(self._view, decoding)), num_reqs)

    def schedule(self, global_view: GlobalStepView | None = None) -> StepPlan:
        """The step's plan. `global_view`: under data parallelism, the step view agreed with the
        other ranks before this call; both K decisions read it, so every rank gets one K."""
        t0 = time.perf_counter()
        budget = self.cfg.max_num_batched_tokens
        reserve = width.NO_RESERVE
        decisions = width.OneStepDecisions(self.policy) if self.policy is not None else None
        if self.plan.speculating:
            assert decisions is not None  # a speculating plan comes with its K policy
            reserve = width.reserve(decisions, replace(self.step_view(), global_view=global_view))
        rows: list[_Row] = []
        preempted: list[str] = []
        budget = self._schedule_running(rows, preempted, budget, reserve)
        if not preempted:
            self._schedule_waiting(rows, budget, reserve)
        decision, entries = self._finalize(rows, reserve.k, global_view, decisions)
        shapes = [width.RowShape(e.num_new_tokens, e.sampling, e.draft_budget, e.num_lookahead)
                  for e in entries]
        step_k = None if decision is None else decision.k
        return StepPlan(scheduled=tuple(entries), step_k=step_k,
                        num_batched_tokens=sum(e.num_new_tokens for e in entries),
                        batch=width.describe(self.exec_plan, shapes, step_k or 0),
                        preempted_ids=tuple(preempted), schedule_seconds=time.perf_counter() - t0,
                        modelled_goodput=None if decision is None else decision.modelled_goodput)

    def _finalize(self, rows: list[_Row], reserved_k: int, global_view: GlobalStepView | None,
                  decisions: width.OneStepDecisions | None
                  ) -> tuple[StepK | None, list[ScheduledRequest]]:
        """Decide K for the batch formed (the verifying batch) and fix every row's cap."""
        decision = None
        if self.plan.speculating:
            views = tuple(self._view(r.request) for r in rows if r.lookahead > 0)
            view = StepView(views, len(rows), global_view)
            assert decisions is not None  # a speculating plan comes with its K policy
            decision = width.decide(decisions, view, reserved_k)
        entries = []
        for r in rows:
            budget, reason, fallback, grammar = r.lookahead, r.reason, None, None
            if decision is not None:
                rid = r.request.request_id
                budget, reason = width.cap(r.lookahead, r.reason, decision, rid)
                if rid in decision.fallback:
                    fallback = min(budget, decision.fallback[rid])
                if rid in decision.grammar:  # forced drafts' cap, the drafter's own
                    grammar = tuple(min(budget, c) for c in decision.grammar[rid])
            entries.append(ScheduledRequest(
                request=r.request, num_new_tokens=r.num_new_tokens, draft_budget=budget,
                skip_reason=reason, block_table=self.kv.block_table(r.request.request_id),
                sampling=r.sampling, num_lookahead=r.lookahead, fallback_budget=fallback,
                grammar_budget=None if grammar is None else grammar[0],
                drafter_budget=None if grammar is None else grammar[1],
                draft_tree=decision is None or decision.drafts_tree(r.request.request_id),
                min_draft_depth=0 if decision is None else decision.min_depth.get(
                    r.request.request_id, 0)))
        return decision, entries

    def _schedule_running(self, rows: list[_Row], preempted: list[str], budget: int,
                          reserve: Reserve) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            row = self._row(req, num_new, budget, reserve, req.num_computed_tokens)
            while not self.kv.allocate_slots(req, num_new + row.lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            rows.append(row)
            budget -= num_new + row.lookahead
            i += 1
        return budget

    def _schedule_waiting(self, rows: list[_Row], budget: int, reserve: Reserve) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            blocks, hit = (
                self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            )
            num_new = min(req.num_tokens - req.num_computed_tokens - hit, budget)
            row = self._row(req, num_new, budget, reserve, req.num_computed_tokens + hit)
            if not self.kv.allocate_slots(req, num_new + row.lookahead, new_computed_blocks=blocks,
                                          num_new_computed_tokens=hit):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0 and req.status is RequestStatus.WAITING:
                req.num_cached_tokens = hit
            req.num_computed_tokens += hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            rows.append(row)
            budget -= num_new + row.lookahead

    def _row(self, req: Request, num_new: int, budget: int, reserve: Reserve,
             computed: int) -> _Row:
        sampling = computed + num_new == req.num_tokens
        la, reason = 0, None
        if self.plan.speculating:
            la, reason = width.lookahead(reserve, req.request_id,
                                         decoding=num_new == 1 and sampling, budget=budget,
                                         padding=self._may_pad)
        return _Row(req, num_new, la, reason, sampling)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _view(self, r: Request) -> RequestView:
        # Async scheduling: a step in flight emits at least one token, so caps are computed for
        # one (an upper bound on the true caps; `revise` lowers them once its tokens land).
        inflight = 1 if r.num_placeholders else 0
        ctx = r.num_tokens - r.num_placeholders + inflight
        room = None if self.drafter_max_len is None else self.drafter_max_len - ctx
        return RequestView(r.request_id, ctx,
                           r.sampling_params.max_tokens - r.num_output_tokens - inflight,
                           self.max_model_len - ctx, room,
                           structured=r.sampling_params.structured_output is not None)

    # ---- update -------------------------------------------------------------------------
    def update(self, out: StepPlan, res: RunnerOutput) -> list[StepUpdate]:
        """Append verified tokens, roll back rejected drafts, cache verified blocks, finish
        requests."""
        updates = []
        if self.policy is not None:
            self._observe_step(out, res)
        for s, r in zip(out.scheduled, res.results):
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                if req.status is RequestStatus.PREEMPTED and r.token_ids:
                    updates.append(self._keep_preempted(req, r))
                continue  # finished or aborted while the step ran
            if r.grammar_dead_end:  # before the prefill branch: it may have no token at all
                updates.append(self._finish_dead_end(req, r))
                continue
            if not r.token_ids:  # partial prefill chunk
                req.num_computed_tokens += s.num_new_tokens
                self.kv.cache_full_blocks(req, req.num_computed_tokens)
                updates.append(StepUpdate(req, [], r, False))
                continue
            # NOTE: KV is valid up to the accepted drafts; the bonus token has no KV yet.
            req.num_computed_tokens = req.num_tokens + r.num_accepted_tokens
            emitted, status = self._append_checked(req, r.token_ids)
            if r.grammar_terminated and len(emitted) == len(r.token_ids) and \
                    status is not RequestStatus.FINISHED_STOPPED:
                status = RequestStatus.FINISHED_STOPPED  # its grammar is complete (§7c)
            if status is None:
                self.kv.cache_full_blocks(req, req.num_computed_tokens)
                if self.policy is not None:
                    self._observe_request(s, r)
            else:
                self.finish_request(req.request_id, status)
            updates.append(StepUpdate(req, emitted, r, status is not None))
        return updates

    def _observe_request(self, s: ScheduledRequest, r: RequestResult) -> None:
        """The request's drafts to the policy, by source: its grammar's forced prefix, then
        what its drafter drafted (after that prefix, seen only where the prefix was accepted)."""
        assert self.policy is not None
        rid, ctx, f = s.request.request_id, s.request.num_tokens, r.num_forced_tokens
        cap = s.draft_budget - s.num_async_invalid
        drafted, accepted = r.num_draft_tokens - f, r.num_accepted_tokens - f
        if f:
            self.policy.observe(rid, f, min(f, r.num_accepted_tokens), ctx, 0, grammar=True)
            if accepted < 0:
                return  # the drafter's continuation was never verified
            cap = 0  # after a forced prefix the drafter's own stops are not told apart
        elif s.drafter_budget is not None:
            cap = min(cap, s.drafter_budget)
        if r.drafts_from_fallback and s.fallback_budget is not None:
            cap = min(cap, s.fallback_budget)
        self.policy.observe(rid, drafted, accepted, ctx, cap, fallback=r.drafts_from_fallback,
                            walk=r.tree_walk)

    def _finish_dead_end(self, req: Request, r: RequestResult) -> StepUpdate:
        """No token continues the request's grammar: keep what it accepted, then end it (it
        alone) with an error the server turns into a 400."""
        req.num_computed_tokens = req.num_tokens + r.num_accepted_tokens
        emitted, status = self._append_checked(req, r.token_ids)
        if status is None:
            status = RequestStatus.FINISHED_ERROR
            req.error = (f"{GRAMMAR_DEAD_END} after {req.num_output_tokens} tokens: the grammar "
                         "needs a character that no token of this model's vocabulary spells")
        self.finish_request(req.request_id, status)
        return StepUpdate(req, emitted, r, True)

    def _observe_step(self, out: StepPlan, res: RunnerOutput) -> None:
        """Feed a pure decode/verify step's timing to the policy's cost model (before the
        step's tokens are appended, so contexts are the ones the decision saw)."""
        if not out.scheduled or any(not s.sampling or s.num_new_tokens != 1 for s in out.scheduled):
            return  # prefill chunks in the step: not the shape the cost model describes
        ctx = -(-sum(s.request.num_tokens for s in out.scheduled) // len(out.scheduled))
        # The width the runner laid out from the plan before the forward, not re-derived here.
        fallback = [r for r in res.results if r.drafts_from_fallback]
        assert self.policy is not None  # called only with a policy
        # Forced drafts cost no drafter call: the drafter's per-token cost leaves them out.
        self.policy.observe_step(len(out.scheduled), ctx, res.verified_width, res.forward_seconds
                                 + res.sample_seconds + res.prepare_seconds,
                                 res.draft_seconds - res.draft_setup_seconds,
                                 sum(r.num_draft_tokens - r.num_forced_tokens
                                     for r in res.results),
                                 sum(len(r.token_ids) for r in res.results),
                                 fallback_seconds=res.draft_fallback_seconds,
                                 fallback_drafted=sum(r.num_draft_tokens for r in fallback),
                                 modelled_goodput=out.modelled_goodput)

    def _append_checked(
        self, req: Request, tokens: Sequence[int]
    ) -> tuple[list[int], RequestStatus | None]:
        """Append the tokens up to the first that ends the request: EOS, a stop token,
        max_tokens, max_model_len, or a stop string (`stop_check`); the rest are dropped."""
        sp = req.sampling_params
        room = min(sp.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        n, status = len(tokens), None
        for i, t in enumerate(tokens):
            if (not sp.ignore_eos and t in self.eos) or t in sp.stop_token_ids:
                req.stop_reason = t if t in sp.stop_token_ids else None
                n, status = i + 1, RequestStatus.FINISHED_STOPPED
                break
            if i + 1 >= room:
                n, status = i + 1, RequestStatus.FINISHED_LENGTH
                break
        emitted = list(tokens[:n])
        kept = None
        if self.stop_check is not None and sp.stop:  # the one stop-string check, every driver
            kept = self.stop_check(req, emitted)
        if kept is not None:  # a stop string ended with token kept-1 (stop_check set stop_reason)
            emitted, status = emitted[:kept], RequestStatus.FINISHED_STOPPED
        req.output_token_ids.extend(emitted)
        return emitted, status

    # ---- async scheduling (engine/async_loop.py) -------------------------------------------
    def _keep_preempted(self, req: Request, r: RequestResult) -> StepUpdate:
        """The request was preempted (blocks freed, to be recomputed) by a schedule formed while
        its step was in flight. The step ran on intact KV, so its tokens are valid: keep them
        (the recompute covers them) instead of losing them."""
        emitted, status = self._append_checked(req, r.token_ids)
        if status is not None:
            self.finish_request(req.request_id, status)
        return StepUpdate(req, emitted, r, status is not None)

    def revise(self, plan: StepPlan) -> StepPlan:
        """`plan` was formed while the previous step was in flight; that step has landed. Drop
        the requests that ended since (they never drafted: nothing of them runs) and lower each
        draft cap to the exact one (step_width.recap_cap); the slots cut are placeholders that
        turned out skipped: invalid `async_placeholder`, never drafts. A new plan; the width
        and path stay as planned."""
        kept = []
        for s in plan.scheduled:
            if s.request.status is not RequestStatus.RUNNING:
                continue
            if plan.step_k is not None and s.draft_budget > 0:
                cap, why, cut = width.recap_cap(plan.step_k, self._view(s.request), s.draft_budget)
                if cut:
                    fb, gb, db = (None if b is None else min(b, cap) for b in (
                        s.fallback_budget, s.grammar_budget, s.drafter_budget))
                    s = replace(s, draft_budget=cap, skip_reason=why, fallback_budget=fb,
                                grammar_budget=gb, drafter_budget=db,
                                num_async_invalid=s.num_async_invalid + cut)
            kept.append(s)
        return replace(plan, scheduled=tuple(kept))

    def hold(self, plan: StepPlan, num_drafts: dict[str, int]) -> tuple[Hold, ...]:
        """A step launched before the previous one's outputs are applied: advance each request's
        counters as if every draft in its row were accepted (`num_computed_tokens += new +
        drafts`; a sampling request holds `1 + drafts` placeholder tokens, which `num_tokens`
        counts), so the next schedule reserves KV for the longest outcome."""
        holds = []
        for s in plan.scheduled:
            req = s.request
            d = num_drafts.get(req.request_id, 0) if s.sampling else 0
            if s.sampling:
                req.num_placeholders = 1 + d
            req.num_computed_tokens += s.num_new_tokens + d
            holds.append(Hold(req, s.num_new_tokens + d, req.num_preemptions))
        return tuple(holds)

    def release(self, holds: tuple[Hold, ...]) -> None:
        """Undo `hold` before the step's result is applied (`update` then rolls back exactly)."""
        for h in holds:
            h.request.num_placeholders = 0
            if h.request.num_preemptions == h.num_preemptions:  # preempted: restarts from 0
                h.request.num_computed_tokens -= h.advance

    def fail(self, plan: StepPlan) -> list[Request]:
        """A step raised: finish its requests that are still live with an error (their blocks
        are freed; the engine keeps serving the others). Returns them."""
        failed = []
        for s in plan.scheduled:
            if self.finish_request(s.request.request_id, RequestStatus.FINISHED_ERROR) is not None:
                failed.append(s.request)
        return failed
