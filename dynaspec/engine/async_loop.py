"""Async scheduling (docs/design.md §7b): a driver of the engine's phases that overlaps them.

`--async-scheduling` orders the same four calls the sync step makes (`schedule -> launch ->
land -> emit`, engine/llm_engine.py) so that step N's forward and verification run on a worker
thread while the engine thread emits step N-1's outputs (detokenization, metric records,
RequestOutputs for streaming) and schedules N+1:

    engine thread:  emit(N-1) | schedule(N+1) | land(N) | launch(N+1) | emit(N) ...
    worker thread:  ---------- run(N) -------|          |------- run(N+1) -------

Placeholders. N+1 is scheduled before N's tokens are known. A pipelined launch has the scheduler
hold N's requests' counters as if every draft in its row were accepted (`Scheduler.hold`), so
it reserves KV for the longest outcome and caps drafts for the shortest (one token; see
`Scheduler._view`); `land` releases them and applies the result exactly as the sync path does,
rejected drafts rolled back. The driver itself touches no request counter.

Where drafting sits: at the end of step N for N+1, on the engine thread in `launch(N+1)` after
`land(N)`, because n-gram, suffix and draft-model drafters need N's tokens. The K used is the one
`schedule()` decided for N+1, the batch that verifies the drafts (docs/design.md §3: no lag); only
its
per-request caps are re-checked with N's real tokens (`Scheduler.revise`), and the budgeted slots
they cut are `async_placeholder` invalids, never drafts. Acceptance-aware policies see N's
acceptance one step late (N+1 was decided before N landed).

Request ends. Stop strings are checked by the scheduler when a step lands, as in the sync loop
(one check for every driver), so a request that stops in N is dropped from N+1 before it drafts.
A request that ends while its step is in flight (an abort, a failure) is in N's batch: its
result is thrown away and every slot of its row counts `async_placeholder`
(metrics/step_records.py).
A request preempted by N+1's schedule while in N keeps N's tokens (computed on intact KV).

KV safety: blocks freed while a step is in flight (finish, abort, preemption) may be handed to a
request of the next step, but steps run one at a time on the worker, so the in-flight step's
writes to them land before any write or read of the next step. Runner state of a finished
request (generator, drafter and grammar state) is dropped only once no step is in flight.

Threads: the worker runs torch with the engine's thread count; on a CPU the forward uses every
core, so what overlaps is the Python time outside the forward. The engine thread drops to one
torch thread and releases its OpenMP team (omp_threads.py): two teams on one machine's cores
made every parallel region sleep and wake, and async ran at 0.4-0.55x of sync. On CUDA the
forward runs on the same worker thread (no separate stream yet).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from dynaspec.engine.driver import EnginePhases
from dynaspec.engine.phases import Landed, Launched
from dynaspec.omp_threads import release_omp_pool
from dynaspec.outputs import RequestOutput
from dynaspec.step_plan import StepPlan


def _use_threads(n: int) -> None:
    """The worker's torch thread count, fixed for the thread's life. torch sets a thread's count
    lazily, at its first parallel op, from the process-wide value, which the engine thread has
    set to 1 by then: set_num_threads alone left the worker's forward on one thread."""
    torch.set_num_threads(n)
    got = torch.get_num_threads()  # the lazy per-thread set-up runs now, with n
    if got != n:
        raise RuntimeError(f"the forward worker got {got} torch threads, not {n}")


class AsyncStepLoop:
    """The pipelined driver; `step()` is one engine step of it.

    `engine` provides the phases (`EnginePhases`, engine/driver.py)."""

    def __init__(self, engine: EnginePhases) -> None:
        self.engine = engine
        self.threads = torch.get_num_threads()  # the worker keeps the engine's thread count
        torch.set_num_threads(1)  # the engine thread's own ops stay on it
        # Released before the worker starts: released after, the worker's parallel regions ran
        # on one thread from then on (the forward at CPU/wall 1.00: 152 against sync's 227
        # tok/s at c8 chat, docs/history/benchmarks-waves-1-4.md, wave 4 third session).
        release_omp_pool()
        self.worker = ThreadPoolExecutor(1, "dynaspec-forward", _use_threads, (self.threads,))
        self.worker.submit(lambda: None).result()  # started now, with the engine's count
        self.inflight: Launched | None = None
        self.pending: Landed | None = None  # landed, outputs not emitted yet
        self._forgets: list[str] = []  # runner state to drop once no step is in flight
        self.num_landed = 0  # steps landed so far (a DP rank reports what it observed)

    @property
    def busy(self) -> bool:
        """A step is in flight or outputs are waiting to be emitted."""
        return self.inflight is not None or self.pending is not None

    def forget(self, request_id: str) -> None:
        """Drop a finished request's runner state, after the step in flight (it may use it)."""
        if self.inflight is None:
            self.engine.release_runner_state(request_id)
        else:
            self._forgets.append(request_id)

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.future.exception()  # let the forward finish before tearing down
        self.worker.shutdown(wait=True)
        torch.set_num_threads(self.threads)

    def step(self, schedule: Callable[[], StepPlan] | None = None) -> list[RequestOutput]:
        """`schedule`: how the next plan is formed (a data-parallel rank passes one that
        schedules on the view its ranks agreed, dp/rank.py); the engine's own by default."""
        outs = self._emit()  # overlapped with the step in flight
        # ditto; placeholders stand for its tokens
        nxt = self.engine.schedule() if schedule is None else schedule()
        if self.inflight is not None:
            launched, self.inflight = self.inflight, None
            self.pending = self.engine.land(launched)
            self.num_landed += 1
            for rid in self._forgets:
                self.engine.release_runner_state(rid)
            self._forgets.clear()
        if nxt.scheduled:
            self.inflight = self.engine.launch(nxt, self.worker)
        if self.inflight is None:  # nothing to overlap with: emit the landed step now
            outs += self._emit()
        return outs

    def _emit(self) -> list[RequestOutput]:
        landed, self.pending = self.pending, None
        return self.engine.emit(landed) if landed is not None else []
