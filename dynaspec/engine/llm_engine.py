"""LLMEngine: the step's phases over the parts the builder made; requests in, outputs out.

One step is `schedule -> launch -> land -> emit` (docs/design.md §1b), each a public method, and the
drivers are orders of those calls: `engine/sync_driver.py`, `engine/async_loop.py` (launch N+1
before emitting N) and `dp/rank.py` (a step-view exchange before `schedule`). A failure inside a
step fails only the requests in that step (their blocks are freed); the engine keeps serving.
Request checks are `engine/request_check.py`; metrics `engine/step_recorder.py`; the facts a
front reads (pools, model card, snapshot) `engine/reporter.py`.
"""

from __future__ import annotations

from concurrent.futures import Executor

from dynaspec.config import EngineConfig
from dynaspec.engine.async_loop import AsyncStepLoop
from dynaspec.engine.builder import EngineParts, build_engine_parts
from dynaspec.engine.client import EngineState, ModelCard, PoolReport
from dynaspec.engine.driver import Driver
from dynaspec.engine.phases import Landed, Launched, StepPhases, drop_ended
from dynaspec.engine.reporter import EngineReporter
from dynaspec.engine.request_check import check_request
from dynaspec.engine.step_recorder import StepRecorder, StepTimes
from dynaspec.engine.sync_driver import SyncDriver
from dynaspec.metrics.records import EngineSnapshot, FinishedRequestTimes, StepStats
from dynaspec.metrics.stats import SpecCounters
from dynaspec.outputs import RequestOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.sampling_params import SamplingParams
from dynaspec.scheduler.scheduler import StepUpdate
from dynaspec.spec_decode.plan.step_width import GlobalStepView, StepView
from dynaspec.step_plan import StepPlan
from dynaspec.structured_params import StructuredOutputParams


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        """`parts`: built from `config` unless given (a data-parallel rank injects its policy
        through `build_engine_parts(config, wrap_policy=...)`)."""
        self.config = config
        self.parts = parts = parts if parts is not None else build_engine_parts(config)
        self.tokenizer, self.plan, self.exec_plan = parts.tokenizer, parts.plan, parts.exec_plan
        self.scheduler, self.runner, self.kv = parts.scheduler, parts.runner, parts.kv
        self.max_model_len, self.structured = parts.max_model_len, parts.structured
        self.outputs = parts.outputs  # its check_stop is the scheduler's stop-string hook
        self.phases = StepPhases(self.scheduler, self.runner)
        # The order of the phases: sync, or pipelined with --async-scheduling (async_loop.py).
        self.driver: Driver = (AsyncStepLoop(self) if config.scheduler.async_scheduling
                               else SyncDriver(self))
        self.recorder = StepRecorder(self.structured.drain_compile_seconds)
        self.reporter = EngineReporter(config, parts, self.recorder)
        self._next_id = 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; raises ValueError naming what is wrong."""
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(ids, params, self.parts.vocab_size, self.max_model_len, self.lossless,
                      self.structured)
        req = Request(request_id, ids, params)
        self.scheduler.add_request(req)
        self.outputs.add(req)
        self.recorder.start(request_id)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.recorder.aborted(req)
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return req is not None

    def _forget(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        self.driver.forget(request_id)  # a step in flight may still use it: the driver decides
        self.recorder.forget(request_id)

    def release_runner_state(self, request_id: str) -> None:
        """Drop a request's runner state (generator, drafter, grammar) now (drivers call it)."""
        self.runner.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        # A pipelined driver is busy while a step runs or its outputs are not returned yet.
        return self.scheduler.has_unfinished() or self.driver.busy

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step: schedule -> launch -> land -> emit ----------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of the engine's driver."""
        return self.driver.step()

    def step_view(self) -> StepView:
        """The batch the next `schedule` expects (data parallel: what the ranks exchange)."""
        return self.scheduler.step_view()

    def schedule(self, global_view: GlobalStepView | None = None) -> StepPlan:
        """The step's immutable plan (data parallel: `global_view` agreed before this call)."""
        return self.scheduler.schedule(global_view)

    def launch(self, plan: StepPlan, worker: Executor | None = None) -> Launched | None:
        """Start the plan's forward, inline or on `worker` (engine/phases.py)."""
        return self.phases.launch(plan, worker)

    def land(self, launched: Launched) -> Landed:
        """Apply the step's result to the requests (engine/phases.py)."""
        return self.phases.land(launched)

    def emit(self, landed: Landed) -> list[RequestOutput]:
        """Record a landed step's metrics and return its outputs (error outputs if it failed)."""
        if landed.error is not None:  # their outputs first: they keep the text produced so far
            failed = [self.outputs.error(req, landed.error) for req in landed.failed]
            for req in landed.failed:
                self._forget(req.request_id)
            return failed
        landed = drop_ended(landed)
        self.recorder.record(landed)
        # A request aborted since the step landed has no output state left: nothing to emit.
        outs = [self._emit(u) for u in landed.updates
                if u.request.request_id in self.outputs.states]
        return [o for o in outs if o is not None]

    def _emit(self, u: StepUpdate) -> RequestOutput | None:
        # Tokens past the request's end were dropped by the scheduler; so are their logprobs.
        lp = u.result.logprobs[:len(u.new_token_ids)] if u.result.logprobs is not None else None
        out = self.outputs.process(u.request, u.new_token_ids, u.finished, lp)
        if out.finished:
            out.spec = self.reporter.request_spec(u.request.request_id)
            assert out.timings is not None  # a final output carries its timings
            self.recorder.finished(u.request, out.timings)
            self.driver.forget(u.request.request_id)
        return out if u.new_token_ids or out.finished else None

    # ---- the engine client protocol (engine/client.py); reports come from the reporter ----
    @property
    def lossless(self) -> bool:
        return self.reporter.lossless

    def pool_report(self) -> PoolReport:
        return self.reporter.pool_report()

    def model_card(self) -> ModelCard:
        return self.reporter.model_card()

    def state(self) -> EngineState:
        return self.reporter.state()

    def snapshot(self) -> EngineSnapshot:
        return self.reporter.snapshot()

    @property
    def log_stats_interval_s(self) -> float:
        return self.config.observability.log_stats_interval_s

    def compile_grammar(self, spec: StructuredOutputParams) -> None:
        self.structured.compile(spec)

    def progress(self) -> int:
        # An async launch returns nothing yet but is work: count it as progress.
        return self.recorder.times.steps * 2 + int(self.driver.busy)

    def failure(self) -> str | None:
        return None  # one process: a failed step fails its requests, never the engine

    def take_finished_times(self) -> list[FinishedRequestTimes]:
        return self.recorder.take_finished_times()

    def take_step(self) -> StepStats | None:
        return self.recorder.take_step()

    def shutdown(self) -> None:
        """Nothing runs outside this process's step (the DP front end stops its ranks)."""

    @property
    def counters(self) -> SpecCounters:
        return self.recorder.counters

    @property
    def times(self) -> StepTimes:
        return self.recorder.times

    # ---- checks and tools ----------------------------------------------------------------
    def reset_drafter_cache(self) -> None:
        """Empty a drafter's cross-request cache (the suffix drafter's), if it has one."""
        if self.runner.proposer is not None:
            self.runner.proposer.reset_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.has_unfinished_requests():
            assert self.kv.num_free_blocks() == self.kv.num_blocks, "blocks leaked at rest"
