"""Continuous batching with the counter model: each step, every request catches up under a budget.

A request carries `num_computed_tokens`; the scheduler grants it the tokens it still has to
compute (chunked under `max_num_batched_tokens`), plus a draft budget on steps where it samples.
The draft budget (token budget and KV lookahead) is charged for the K the step will choose, not
the plan's maximum: the policy is asked once for the step's prospective batch before the batch
is formed, and again for the batch formed (never above what was reserved).
After verification, `num_computed_tokens` advances past the accepted drafts only, so the slots of
rejected drafts are rewritten next step. Preemption is by recompute: the victim frees its blocks
and rejoins the front of the queue; its output so far is kept and its prompt+output recomputed.
`update` is the one place that decides a request's end (EOS, stop token, stop string through
`stop_check`, max_tokens, max_model_len), before its blocks are cached or freed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from dynaspec.config import SchedulerConfig
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.outputs import RequestResult, RunnerOutput, ScheduledRequest, SchedulerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.spec_decode.k_policy import (KPolicy, RequestView, StepK, StepView, drafter_gate,
                                           hard_cap)
from dynaspec.spec_decode.plan import SpecPlan
from dynaspec.worker.execution_plan import ExecutionPlan


# (request, tokens about to be appended) -> how many of them to keep because a stop string
# ended the request with the last kept one, or None. The engine's output processor provides it.
StopCheck = Callable[[Request, list[int]], "int | None"]


@dataclass(frozen=True)
class _Reserve:
    """Draft slots each request may reserve this step, from the K decided for the prospective
    batch; requests it does not name (admitted from the queue) get `k`."""

    per_request: dict[str, int]
    reasons: dict[str, str]
    k: int

    def of(self, request_id: str) -> tuple[int, str | None]:
        n = self.per_request.get(request_id, self.k)
        return n, (self.reasons.get(request_id, "schedule_zero") if n == 0 else None)


_NO_RESERVE = _Reserve({}, {}, 0)


@dataclass
class StepUpdate:
    """What `update` hands the engine: per request, the tokens it emitted this step."""

    request: Request
    new_token_ids: list[int]
    result: RequestResult
    finished: bool


GRAMMAR_DEAD_END = "grammar dead end"  # the server answers 400 for errors that start so


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, plan: SpecPlan,
                 policy: KPolicy | None, max_model_len: int, eos_token_ids: tuple[int, ...],
                 drafter_max_len: int | None = None, exec_plan: ExecutionPlan | None = None) -> None:
        self.cfg, self.kv, self.plan, self.policy = cfg, kv, plan, policy
        self.exec_plan = exec_plan or ExecutionPlan.build(plan, cfg.max_num_seqs)
        self._may_pad = any(self.exec_plan.path_for(*shape)[0] != "eager" for shape in self.exec_plan.grid)
        self.max_model_len = max_model_len
        self.eos = frozenset(eos_token_ids)
        self.drafter_max_len = drafter_max_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.stop_check: StopCheck | None = None  # stop strings; set by the engine

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
    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        budget = self.cfg.max_num_batched_tokens
        reserve = self._planned_reserve()
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(scheduled, preempted, budget, reserve)
        if not preempted:
            self._schedule_waiting(scheduled, budget, reserve)
        step_k = self._decide_k(scheduled, reserve.k) if self.plan.speculating else None
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        batch = self._describe(scheduled, step_k)
        return SchedulerOutput(scheduled, step_k, num_tokens, preempted, time.perf_counter() - t0,
                               batch)

    def _describe(self, scheduled: list[ScheduledRequest], step_k: int | None):
        """The step's BatchDescriptor, from the plan: a decode-only step verifies width 1+K (K
        from the plan, so the width is one of plan.widths); it may take a fixed-shape path only
        if every request has KV slots reserved for K drafts, because there every request is
        padded to the full width."""
        k = step_k or 0
        decode_only = bool(scheduled) and all(s.sampling and s.num_new_tokens == 1 for s in scheduled)
        planned = sum(s.num_new_tokens + s.draft_budget for s in scheduled)
        batch = self.exec_plan.descriptor(len(scheduled), 1 + k if decode_only else None, planned)
        if batch.fixed_shape and any(s.num_lookahead < k for s in scheduled):
            # A request reserved fewer slots than K (its cap, or the batch changed since the
            # reservation): padding it to the full width would write past them, so run eager.
            batch = replace(batch, path="eager", num_reqs_padded=len(scheduled),
                            num_tokens_padded=planned)
        if batch.fixed_shape:
            for s in scheduled:
                s.pad_drafts = True
        return batch

    def _planned_reserve(self) -> _Reserve:
        """The K decision for the batch this step will most likely form: every running request
        plus the queue up to max_num_seqs. Its caps are what the decoding requests reserve."""
        if not self.plan.speculating:
            return _NO_RESERVE
        room = max(0, self.cfg.max_num_seqs - len(self.running))
        num_reqs = len(self.running) + min(len(self.waiting), room)
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        decision = self.policy.decide(StepView(tuple(map(self._view, decoding)), num_reqs,
                                               planned=True))
        return _Reserve(dict(decision.per_request), dict(decision.reasons), decision.k)

    def _schedule_running(self, scheduled: list[ScheduledRequest], preempted: list[str],
                          budget: int, reserve: _Reserve) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            la, reason = self._lookahead(req, num_new, budget, reserve)
            while not self.kv.allocate_slots(req, num_new + la):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            scheduled.append(self._entry(req, num_new, la, reason))
            budget -= num_new + la
            i += 1
        return budget

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int,
                          reserve: _Reserve) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            blocks, hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            num_new = min(req.num_tokens - req.num_computed_tokens - hit, budget)
            la, reason = self._lookahead(req, num_new, budget, reserve,
                                         computed=req.num_computed_tokens + hit)
            if not self.kv.allocate_slots(req, num_new + la, new_computed_blocks=blocks,
                                          num_new_computed_tokens=hit):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0 and req.status is RequestStatus.WAITING:
                req.num_cached_tokens = hit
            req.num_computed_tokens += hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._entry(req, num_new, la, reason))
            budget -= num_new + la

    def _lookahead(self, req: Request, num_new: int, budget: int, reserve: _Reserve,
                   computed: int | None = None) -> tuple[int, str | None]:
        """Draft slots to reserve, and why there are none: only a request decoding one token
        drafts (not a prefill step), as many as its reserve, if the token budget fits them."""
        if not self.plan.speculating:
            return 0, None
        computed = req.num_computed_tokens if computed is None else computed
        if num_new != 1 or computed + num_new != req.num_tokens:
            return 0, "prefill"
        want, reason = reserve.of(req.request_id)
        if self._may_pad:  # a fixed-shape step pads every decoding row to 1+K: reserve them all
            want, reason = max(want, reserve.k), (reason if reserve.k == 0 else None)
        if want == 0:
            return 0, reason
        return (want, None) if budget >= 1 + want else (0, "token_budget")

    def _entry(self, req: Request, num_new: int, la: int, reason: str | None) -> ScheduledRequest:
        # draft_budget starts as the reserved lookahead; _decide_k lowers it to the step's K.
        return ScheduledRequest(req, num_new, la, reason, self.kv.block_table(req.request_id),
                                num_lookahead=la)

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
        # one (an upper bound on the true caps; recap_drafts lowers them once its tokens land).
        inflight = 1 if r.num_placeholders else 0
        ctx = r.num_tokens - r.num_placeholders + inflight
        room = None if self.drafter_max_len is None else self.drafter_max_len - ctx
        return RequestView(r.request_id, ctx,
                           r.sampling_params.max_tokens - r.num_output_tokens - inflight,
                           self.max_model_len - ctx, room)

    def _decide_k(self, scheduled: list[ScheduledRequest], reserved_k: int) -> int:
        """Apply the K policy to the batch just formed: the verifying batch is this batch. Its K
        never exceeds the K whose slots were reserved (the batch can differ from the planned
        one), so every decoding request has KV for the step's width."""
        views = [self._view(s.request) for s in scheduled if s.draft_budget > 0]
        decision = self.policy.decide(StepView(tuple(views), len(scheduled)))
        if decision.k > reserved_k:
            decision = _clamped(decision, reserved_k)
        for s in scheduled:
            if s.draft_budget == 0:
                continue
            rid = s.request.request_id
            s.draft_budget = min(s.draft_budget, decision.per_request.get(rid, decision.k))
            if s.draft_budget == 0:
                s.skip_reason = decision.reasons.get(rid, "schedule_zero")
        return decision.k

    # ---- update -------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, res: RunnerOutput) -> list[StepUpdate]:
        """Append verified tokens, roll back rejected drafts, cache verified blocks, finish requests."""
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
                    self.policy.observe(req.request_id, r.num_draft_tokens, r.num_accepted_tokens,
                                        req.num_tokens)
            else:
                self.finish_request(req.request_id, status)
            updates.append(StepUpdate(req, emitted, r, status is not None))
        return updates

    def _finish_dead_end(self, req: Request, r) -> StepUpdate:
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

    def _observe_step(self, out: SchedulerOutput, res: RunnerOutput) -> None:
        """Feed a pure decode/verify step's timing to the policy's cost model (before the
        step's tokens are appended, so contexts are the ones the decision saw)."""
        if not out.scheduled or any(not s.sampling or s.num_new_tokens != 1 for s in out.scheduled):
            return  # prefill chunks in the step: not the shape the cost model describes
        ctx = -(-sum(s.request.num_tokens for s in out.scheduled) // len(out.scheduled))
        verified = [r.num_draft_tokens + r.num_padding_tokens for r in res.results]
        self.policy.observe_step(len(out.scheduled), ctx, 1 + max(verified), res.forward_seconds
                                 + res.sample_seconds + res.prepare_seconds, res.draft_seconds,
                                 sum(r.num_draft_tokens for r in res.results),
                                 sum(len(r.token_ids) for r in res.results))

    def _append_checked(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
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
        emitted = tokens[:n]
        kept = self.stop_check(req, emitted) if self.stop_check is not None else None
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

    def recap_drafts(self, out: SchedulerOutput) -> None:
        """`out` was formed while the previous step was in flight, with caps for its fewest
        tokens. Now that they are known, lower each draft budget to the exact cap (max_tokens,
        max_model_len, drafter length); the slots cut are placeholders that turned out skipped:
        invalid `async_placeholder`, never drafts."""
        if out.step_k is None:
            return
        for s in out.scheduled:
            if s.draft_budget == 0:
                continue
            view = self._view(s.request)
            cap, why = drafter_gate(*hard_cap(out.step_k, view), view)
            if cap < s.draft_budget:
                s.num_async_invalid += s.draft_budget - cap
                s.draft_budget = cap
                if cap == 0:
                    s.skip_reason = why

    def end_at_stop_string(self, req: Request, num_drop: int) -> None:
        """A stop string was found (one step late: stop strings are checked while the next
        step runs) in the tokens appended last for `req`: drop the `num_drop` after it and
        finish the request, "stop" even if that step had also ended it by length."""
        if num_drop:
            del req.output_token_ids[-num_drop:]
        if req.request_id in self.requests:
            self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        else:
            req.status = RequestStatus.FINISHED_STOPPED


def _clamped(d: StepK, k: int) -> StepK:
    """The decision with its K lowered to `k` (a K the plan produced for the reservation)."""
    per = {rid: min(c, k) for rid, c in d.per_request.items()}
    return StepK(k, per, d.reasons, d.ctx_stat)
