"""Async scheduling (docs/design.md §7b): overlap the engine's Python work with the step's forward.

`--async-scheduling` pipelines three steps. While step N's forward and verification run on a
worker thread (`ModelRunner.run`), the engine thread finishes step N-1's outputs (stop strings,
detokenization, metric records, RequestOutputs for streaming) and forms step N+1:

    engine thread:  drain(N-1) | schedule(N+1) | wait N | land(N) | recap+prepare(N+1) | drain(N) ...
    worker thread:  ------------ run(N) ----------------|         |------------ run(N+1) ---------

Placeholders. N+1 is formed before N's tokens are known. At launch each of N's sampling requests
has its counters advanced as if every draft in its row were accepted (`num_computed_tokens +=
new + drafts`, `num_placeholders = 1 + drafts`, which `num_tokens` counts), so the scheduler
reserves KV for the longest outcome, and computes caps for the shortest (one token; see
`Scheduler._view`). When N lands the advance is undone and `Scheduler.update` applies the
result exactly as the sync path does, rejected drafts rolled back.

Where drafting sits: at the end of step N for N+1, on the engine thread between `land(N)` and
the launch of N+1 (`ModelRunner.prepare`), because n-gram, suffix and draft-model drafters need
N's tokens. The K used is the one `schedule()` decided for N+1, the batch that verifies the
drafts (docs/design.md §3: no lag); only its per-request caps are re-checked (`recap_drafts`) with N's
real tokens, and the budgeted slots they cut are `async_placeholder` invalids, never drafts.
Acceptance-aware policies see N's acceptance one step late (N+1 was decided before N landed).

The invalid-draft channel (engine/step_specs.py). A request that ends while its step is in
flight (a stop string found in N-1's tokens, an abort, a failure) is in N's batch: its result is
thrown away and every slot of its row counts `async_placeholder`; one that ended after N+1 was
formed but before it started is dropped from N+1 (it never drafted: nothing of it ran). A
request preempted by N+1's schedule while in N keeps N's tokens (they were computed on intact
KV). Stop strings are checked one step late; the tokens after one were already appended and are
dropped (`Scheduler.end_at_stop_string`), so outputs equal sync's token for token.

KV safety: blocks freed while a step is in flight (finish, abort, preemption) may be handed to a
request of the next step, but steps run one at a time on the worker, so the in-flight step's
writes to them land before any write or read of the next step. Runner state of a finished
request (generator, drafter and grammar state) is dropped only once no step is in flight.

Threads: the worker runs torch with the engine's thread count; on a CPU the forward uses every
core, so what overlaps is the Python time outside the forward. On CUDA the forward runs on the
same worker thread (no separate stream yet).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dynaspec.engine.step_specs import orphan_spec, prompt_tokens
from dynaspec.metrics.stats import RequestStepSpec
from dynaspec.outputs import RequestOutput, RunnerOutput, ScheduledRequest, SchedulerOutput
from dynaspec.request import RequestStatus
from dynaspec.scheduler.scheduler import Scheduler, StepUpdate

StopCheck = Callable[[Any, list[int]], "int | None"]


@dataclass
class LandedStep:
    """A step whose result is applied to the requests; its outputs are finished later."""

    out: SchedulerOutput
    res: RunnerOutput
    updates: list[StepUpdate]
    orphans: list[RequestStepSpec]  # requests that ended while it was in flight
    num_prompt_tokens: int
    update_seconds: float = 0.0


@dataclass
class _InFlight:
    out: SchedulerOutput
    future: Future
    # per request: (entry, counter advance, its preemption count) at launch
    advanced: list[tuple[ScheduledRequest, int, int]]
    num_prompt_tokens: int  # counted at launch, before the advance


class AsyncStepLoop:
    """The pipeline; `step()` replaces `schedule -> execute -> update` for one engine step.

    `finish(landed)` records and emits a landed step (the engine's); `fail(out, exc)` fails the
    requests of a step that raised and returns their error outputs (also the engine's)."""

    def __init__(self, scheduler: Scheduler, runner: Any, check_stop: StopCheck | None,
                 finish: Callable[[LandedStep], list[RequestOutput]],
                 fail: Callable[[SchedulerOutput, Exception], list[RequestOutput]]) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.check_stop, self.finish, self.fail = check_stop, finish, fail
        threads = torch.get_num_threads()  # the worker keeps the engine's torch thread count
        self.worker = ThreadPoolExecutor(1, "dynaspec-forward", torch.set_num_threads, (threads,))
        self.inflight: _InFlight | None = None
        self.pending: LandedStep | None = None  # landed, outputs not finished yet
        self._failed: list[RequestOutput] = []  # error outputs of failed steps, not returned yet
        self._forgets: list[str] = []  # runner state to drop once no step is in flight

    @property
    def busy(self) -> bool:
        """A step is in flight or outputs are waiting to be finished."""
        return self.inflight is not None or self.pending is not None or bool(self._failed)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's runner state, after the step in flight (it may use it)."""
        if self.inflight is None:
            self.runner.forget(request_id)
        else:
            self._forgets.append(request_id)

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.future.exception()  # let the forward finish before tearing down
        self.worker.shutdown(wait=True)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outs = self._drain()  # overlapped with the step in flight
        nxt = self.scheduler.schedule()  # ditto; placeholders stand for its tokens
        if self.inflight is not None:
            self._land(self.inflight)
        if nxt.scheduled:
            self._launch(nxt)
        if self.inflight is None:  # nothing to overlap with: finish the landed step now
            outs += self._drain()
        return outs

    def _launch(self, out: SchedulerOutput) -> None:
        """Drop requests that ended since `out` was formed (they never draft, so nothing of
        them is in flight), re-check caps, draft, advance the counters, start the forward."""
        out.scheduled = [s for s in out.scheduled if s.request.status is RequestStatus.RUNNING]
        if not out.scheduled:
            return
        try:
            self.scheduler.recap_drafts(out)
            prepared = self.runner.prepare(out)
        except Exception as exc:  # noqa: BLE001 - as a failed forward: only these requests
            self._failed += self.fail(out, exc)
            return
        advanced, num_prompt = [], prompt_tokens(out.scheduled)
        for s in out.scheduled:
            req, sampling = s.request, s.sampling
            d = len(prepared.drafts.get(req.request_id, ())) if sampling else 0
            if sampling:
                req.num_placeholders = 1 + d
            req.num_computed_tokens += s.num_new_tokens + d
            advanced.append((s, s.num_new_tokens + d, req.num_preemptions))
        self.inflight = _InFlight(out, self.worker.submit(self.runner.run, prepared), advanced,
                                  num_prompt)

    def _land(self, f: _InFlight) -> None:
        """Wait for the step, undo the launch-time advance, apply the result (sync's update)."""
        try:
            res: RunnerOutput | None = f.future.result()
            exc: Exception | None = None
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            res, exc = None, e
        self.inflight = None
        t0 = time.perf_counter()
        for s, adv, preemptions in f.advanced:
            req = s.request
            req.num_placeholders = 0
            if req.num_preemptions == preemptions:  # a preempted request restarts from 0
                req.num_computed_tokens -= adv
        if res is None:
            alive = [s for s in f.out.scheduled if s.request.request_id in self.scheduler.requests]
            self._failed += self.fail(SchedulerOutput(alive, f.out.step_k, 0), exc)
        else:
            orphans = [spec for s, r in zip(f.out.scheduled, res.results)
                       if s.request.status.finished and (spec := orphan_spec(s, r, f.out.step_k))]
            updates = self.scheduler.update(f.out, res)
            self.pending = LandedStep(f.out, res, updates, orphans, f.num_prompt_tokens,
                                      time.perf_counter() - t0)
        for rid in self._forgets:
            self.runner.forget(rid)
        self._forgets.clear()

    def _drain(self) -> list[RequestOutput]:
        """Finish the landed step: stop strings (one step late), records, outputs."""
        landed, self.pending = self.pending, None
        outs, self._failed = self._failed, []
        if landed is None:
            return outs
        t0 = time.perf_counter()
        self._orphan_ended(landed)
        if self.check_stop is not None:
            for u in landed.updates:
                if not u.new_token_ids:
                    continue
                kept = self.check_stop(u.request, u.new_token_ids)
                if kept is not None:
                    self.scheduler.end_at_stop_string(u.request, len(u.new_token_ids) - kept)
                    u.new_token_ids, u.finished = u.new_token_ids[:kept], True
        landed.update_seconds += time.perf_counter() - t0
        return outs + self.finish(landed)

    @staticmethod
    def _orphan_ended(landed: LandedStep) -> None:
        """Requests aborted (or failed) after the step landed never get its tokens: their
        records become orphans (nothing emitted, the row invalid), like those ended in flight."""
        gone = {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
        if not any(u.request.status in gone for u in landed.updates):
            return
        entries = {s.request.request_id: s for s in landed.out.scheduled}
        kept = []
        for u in landed.updates:
            if u.request.status not in gone:
                kept.append(u)
            elif spec := orphan_spec(entries[u.request.request_id], u.result, landed.out.step_k):
                landed.orphans.append(spec)
        landed.updates = kept
