"""Continuous batching with the counter model: each step, every request catches up under a budget.

A request carries `num_computed_tokens`; the scheduler grants it the tokens it still has to
compute (chunked under `max_num_batched_tokens`), plus a draft budget on steps where it samples.
After verification, `num_computed_tokens` advances past the accepted drafts only, so the slots of
rejected drafts are rewritten next step. Preemption is by recompute: the victim frees its blocks
and rejoins the front of the queue; its output so far is kept and its prompt+output recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from dynaspec.config import SchedulerConfig
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.outputs import RequestResult, RunnerOutput, ScheduledRequest, SchedulerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.spec_decode.k_policy import KPolicy, RequestView, StepView
from dynaspec.spec_decode.plan import SpecPlan
from dynaspec.worker.execution_plan import ExecutionPlan


@dataclass
class StepUpdate:
    """What `update` hands the engine: per request, the tokens it emitted this step."""

    request: Request
    new_token_ids: list[int]
    result: RequestResult
    finished: bool


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, plan: SpecPlan,
                 policy: KPolicy | None, max_model_len: int, eos_token_ids: tuple[int, ...],
                 drafter_max_len: int | None = None, exec_plan: ExecutionPlan | None = None) -> None:
        self.cfg, self.kv, self.plan, self.policy = cfg, kv, plan, policy
        self.exec_plan = exec_plan or ExecutionPlan.build(plan, cfg.max_num_seqs)
        self.max_model_len = max_model_len
        self.eos = frozenset(eos_token_ids)
        self.drafter_max_len = drafter_max_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.histories: dict[str, object] = {}

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
        self.histories.pop(request_id, None)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        budget = self.cfg.max_num_batched_tokens
        lookahead = self.plan.max_k if self.plan.speculating else 0
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(scheduled, preempted, budget, lookahead)
        if not preempted:
            self._schedule_waiting(scheduled, budget, lookahead)
        step_k = self._decide_k(scheduled) if self.plan.speculating else None
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
        decode_only = bool(scheduled) and all(
            s.sampling and s.num_new_tokens == 1 and s.num_lookahead >= k for s in scheduled)
        planned = sum(s.num_new_tokens + s.draft_budget for s in scheduled)
        batch = self.exec_plan.descriptor(len(scheduled), 1 + k if decode_only else None, planned)
        if batch.fixed_shape:
            for s in scheduled:
                s.pad_drafts = True
        return batch

    def _schedule_running(self, scheduled: list[ScheduledRequest], preempted: list[str],
                          budget: int, lookahead: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            la = self._lookahead(req, num_new, budget, lookahead)
            while not self.kv.allocate_slots(req, num_new + la):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    return budget
            scheduled.append(self._entry(req, num_new, la))
            budget -= num_new + la
            i += 1
        return budget

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int,
                          lookahead: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            blocks, hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            num_new = min(req.num_tokens - req.num_computed_tokens - hit, budget)
            la = self._lookahead(req, num_new, budget, lookahead, computed=req.num_computed_tokens + hit)
            if not self.kv.allocate_slots(req, num_new + la, new_computed_blocks=blocks,
                                          num_new_computed_tokens=hit):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0 and req.status is RequestStatus.WAITING:
                req.num_cached_tokens = hit
            req.num_computed_tokens += hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._entry(req, num_new, la))
            budget -= num_new + la

    def _lookahead(self, req: Request, num_new: int, budget: int, lookahead: int,
                   computed: int | None = None) -> int:
        """Draft slots to reserve: only a request decoding one token drafts (not a prefill step)."""
        computed = req.num_computed_tokens if computed is None else computed
        sampling = computed + num_new == req.num_tokens
        return lookahead if sampling and num_new == 1 and budget >= 1 + lookahead else 0

    def _entry(self, req: Request, num_new: int, la: int) -> ScheduledRequest:
        # draft_budget starts as the reserved lookahead; _decide_k lowers it to the step's K.
        reason = None
        if self.plan.speculating and la == 0:
            reason = "prefill" if num_new > 1 or req.num_computed_tokens + num_new < req.num_tokens \
                else "token_budget"
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

    def _decide_k(self, scheduled: list[ScheduledRequest]) -> int:
        """Apply the K policy to the batch just formed: the verifying batch is this batch."""
        views = []
        for s in scheduled:
            if s.draft_budget == 0:
                continue
            r = s.request
            room = None if self.drafter_max_len is None else self.drafter_max_len - r.num_tokens
            views.append(RequestView(r.request_id, r.num_tokens,
                                     r.sampling_params.max_tokens - r.num_output_tokens,
                                     self.max_model_len - r.num_tokens, room,
                                     self.histories.get(r.request_id)))
        decision = self.policy.decide(StepView(tuple(views), len(scheduled)))
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
        for s, r in zip(out.scheduled, res.results):
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            if not r.token_ids:  # partial prefill chunk
                req.num_computed_tokens += s.num_new_tokens
                self.kv.cache_full_blocks(req, req.num_computed_tokens)
                updates.append(StepUpdate(req, [], r, False))
                continue
            # NOTE: KV is valid up to the accepted drafts; the bonus token has no KV yet.
            req.num_computed_tokens = req.num_tokens + r.num_accepted_tokens
            emitted, status = self._append_checked(req, r.token_ids)
            if status is None:
                self.kv.cache_full_blocks(req, req.num_computed_tokens)
                history = self.histories.get(req.request_id)
                if history is not None and r.num_draft_tokens:
                    history.update(r.num_draft_tokens, r.num_accepted_tokens)
            else:
                self.finish_request(req.request_id, status)
            updates.append(StepUpdate(req, emitted, r, status is not None))
        return updates

    def _append_checked(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens one by one; stop at EOS, a stop token, max_tokens or max_model_len."""
        sp = req.sampling_params
        emitted = []
        for t in tokens:
            req.output_token_ids.append(t)
            emitted.append(t)
            if (not sp.ignore_eos and t in self.eos) or t in sp.stop_token_ids:
                req.stop_reason = t if t in sp.stop_token_ids else None
                return emitted, RequestStatus.FINISHED_STOPPED
            if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
                return emitted, RequestStatus.FINISHED_LENGTH
        return emitted, None
