"""The middle of the step as phases: `launch` a plan's forward, `land` its result.

The engine's step is `schedule -> launch -> land -> emit` (docs/design.md §1b). `schedule` is the
scheduler's, `emit` the engine's (records and outputs); this module holds the two in between,
so every driver (the sync loop, the async pipeline, a data-parallel rank) runs the same code:

- `launch(plan, worker=None)`: drafts and flat inputs on the calling thread
  (`ModelRunner.prepare`), then the forward and verification (`ModelRunner.run`) inline, or on
  `worker` when the driver pipelines. A pipelined launch first lets the scheduler revise the
  plan (the previous step has landed since it formed) and hold placeholders for the step's
  tokens (`Scheduler.hold`), so the next `schedule` can run while this step is in flight.
- `land(launched)`: waits for the result, releases the placeholders and applies it through
  `Scheduler.update` (the only writer of a request's counters), or fails the step's requests
  when it raised (`Scheduler.fail`).
`drop_ended` is the first thing `emit` does: the landed step without the requests that ended
since it landed (a new `Landed`; nothing here changes one once built).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Protocol

from dynaspec.engine.step_records import orphan_spec, prompt_tokens
from dynaspec.metrics.records import RequestStepSpec
from dynaspec.outputs import RunnerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.scheduler.scheduler import Hold, Scheduler, StepUpdate
from dynaspec.step_plan import StepPlan
from dynaspec.worker.model_runner import PreparedStep

log = logging.getLogger("dynaspec")


@dataclass(frozen=True)
class Launched:
    """A step whose forward runs (or ran): land it to apply its result."""

    plan: StepPlan  # as launched (revised under async scheduling)
    future: Future  # -> RunnerOutput, or the exception the step raised
    holds: tuple[Hold, ...]  # placeholders held while it is in flight (async only)
    num_prompt_tokens: int  # counted at launch, before any counter moves


@dataclass(frozen=True, kw_only=True)
class Landed:
    """A step whose result is applied to the requests; `emit` turns it into outputs."""

    plan: StepPlan
    res: RunnerOutput | None  # None when the step raised
    updates: tuple[StepUpdate, ...] = ()
    orphans: tuple[RequestStepSpec, ...] = ()  # requests that ended while it was in flight
    num_prompt_tokens: int
    update_seconds: float = 0.0
    error: Exception | None = None
    failed: tuple[Request, ...] = ()  # requests the error finished


class StepRunner(Protocol):
    """What the phases hold of the model runner (worker/model_runner.py): a step prepared from
    the requests on the calling thread, then run, inline or on a driver's worker thread."""

    def prepare(self, plan: StepPlan) -> PreparedStep: ...

    def run(self, prepared: PreparedStep) -> RunnerOutput: ...


class StepPhases:
    def __init__(self, scheduler: Scheduler, runner: StepRunner) -> None:
        self.scheduler, self.runner = scheduler, runner

    def launch(self, plan: StepPlan, worker: Executor | None = None) -> Launched | None:
        """Start the plan's forward; None when a revision left nothing to run."""
        holds: tuple[Hold, ...] = ()
        if worker is not None:
            plan = self.scheduler.revise(plan)
            if not plan.scheduled:
                return None
        num_prompt = prompt_tokens(plan.scheduled)
        future: Future = Future()
        try:
            prepared = self.runner.prepare(plan)
        except Exception as exc:  # noqa: BLE001 - as a failed forward: only these requests
            future.set_exception(exc)
            return Launched(plan, future, holds, num_prompt)
        if worker is None:
            try:
                future.set_result(self.runner.run(prepared))
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                future.set_exception(exc)
            return Launched(plan, future, holds, num_prompt)
        holds = self.scheduler.hold(plan, {rid: len(d) for rid, d in prepared.drafts.items()})
        return Launched(plan, worker.submit(self.runner.run, prepared), holds, num_prompt)

    def land(self, launched: Launched) -> Landed:
        """Wait for the step, release its placeholders, apply the result (or the failure)."""
        plan = launched.plan
        try:
            res: RunnerOutput = launched.future.result()
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            log.error("step failed", exc_info=exc)
            self.scheduler.release(launched.holds)
            return Landed(plan=plan, res=None, num_prompt_tokens=launched.num_prompt_tokens,
                          error=exc, failed=tuple(self.scheduler.fail(plan)))
        t0 = time.perf_counter()
        self.scheduler.release(launched.holds)
        orphans = tuple(spec for s, r in zip(plan.scheduled, res.results)
                        if s.request.status.finished and (spec := orphan_spec(s, r, plan.step_k)))
        updates = tuple(self.scheduler.update(plan, res))
        return Landed(plan=plan, res=res, updates=updates, orphans=orphans,
                      num_prompt_tokens=launched.num_prompt_tokens,
                      update_seconds=time.perf_counter() - t0)


def drop_ended(landed: Landed) -> Landed:
    """Requests aborted (or failed) after the step landed (async: before its outputs were
    emitted) never get its tokens: their records become orphans (nothing emitted, the row
    invalid), like those that ended while the step was in flight."""
    gone = {RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}

    def ended_since(u: StepUpdate) -> bool:
        # An update that itself finished the request (a grammar dead end ends it with an
        # error) is its final output, not an orphan.
        return u.request.status in gone and not u.finished

    if not any(ended_since(u) for u in landed.updates):
        return landed
    entries = {s.request.request_id: s for s in landed.plan.scheduled}
    kept, orphans = [], list(landed.orphans)
    for u in landed.updates:
        if not ended_since(u):
            kept.append(u)
        elif spec := orphan_spec(entries[u.request.request_id], u.result, landed.plan.step_k):
            orphans.append(spec)
    return replace(landed, updates=tuple(kept), orphans=tuple(orphans))
