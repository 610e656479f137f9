"""LLMEngine: the step's phases over the parts the builder made; requests in, outputs out.

One step is `schedule -> launch -> land -> emit` (docs/design.md §1b), each a public method, and the
drivers are orders of those calls: `step()` below (sync), `engine/async_loop.py` (launch N+1
before emitting N) and `dp/rank.py` (a step-view exchange before `schedule`). A failure inside a
step fails only the requests in that step (their blocks are freed); the engine keeps serving.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Executor

from dynaspec.config import EngineConfig
from dynaspec.engine.builder import EngineParts, build_engine_parts
from dynaspec.engine.client import EngineState, ModelCard, PoolReport
from dynaspec.engine.phases import Landed, Launched, StepPhases, drop_ended
from dynaspec.engine.step_recorder import StepRecorder, StepTimes
from dynaspec.engine.sync_driver import SyncDriver
from dynaspec.metrics.stats import (
    EngineSnapshot,
    FinishedRequestTimes,
    RequestSpecSummary,
    SpecCounters,
    StepStats,
)
from dynaspec.outputs import RequestOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.sampling_params import SamplingParams
from dynaspec.scheduler.scheduler import StepUpdate
from dynaspec.spec_decode.step_width import GlobalStepView, StepView
from dynaspec.step_plan import StepPlan

log = logging.getLogger("dynaspec")


def check_request(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                  lossless: bool, structured) -> None:
    """Raises ValueError naming what is wrong with a request (also the DP front end's check);
    compiles its grammar (a cache hit when pre-compiled) so a bad one is refused here."""
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    if not lossless and params.structured_output is not None:
        raise ValueError("structured output cannot be combined with --rejection-mode synthetic: "
                         "synthetic acceptance takes drafts the grammar never checked")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                         f"max_model_len {max_model_len}")
    if params.structured_output is not None:
        structured.compile(params.structured_output)


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        """`parts`: built from `config` unless given (a data-parallel rank injects its policy
        through `build_engine_parts(config, wrap_policy=...)`)."""
        self.config = config
        parts = parts if parts is not None else build_engine_parts(config)
        self.parts = parts
        self.tokenizer = parts.tokenizer
        self.plan = parts.plan
        self.exec_plan = parts.exec_plan
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.kv = parts.kv
        self.max_model_len = parts.max_model_len
        self.structured = parts.structured
        self.outputs = parts.outputs  # its check_stop is the scheduler's stop-string hook
        self.phases = StepPhases(self.scheduler, self.runner)
        # The order of the phases: sync, or pipelined with --async-scheduling (async_loop.py).
        self.driver = _driver(config)(self)
        self.recorder = StepRecorder(self.structured.drain_compile_seconds)
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
            phase = ("waiting" if req.status is not RequestStatus.RUNNING else
                     "prefill" if req.num_computed_tokens < req.num_prompt_tokens else "decode")
            self.recorder.aborted(phase)
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        return req is not None

    def _forget(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        self._forget_runner_state(request_id)
        self.recorder.forget(request_id)

    def _forget_runner_state(self, request_id: str) -> None:
        # A pipelined driver's step in flight may still use it: the driver decides when.
        self.driver.forget(request_id)

    def release_runner_state(self, request_id: str) -> None:
        """Drop a request's runner state (generator, drafter, grammar) now (drivers call it)."""
        self.runner.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.step_in_flight

    @property
    def step_in_flight(self) -> bool:
        """A pipelined driver: a step runs or its outputs are not returned yet."""
        return self.driver.busy

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
        if landed.error is not None:
            return [self._error_output(req, landed.error) for req in landed.failed]
        landed = drop_ended(landed)
        self.recorder.record(landed)
        # A request aborted since the step landed has no output state left: nothing to emit.
        outs = [self._emit(u) for u in landed.updates
                if u.request.request_id in self.outputs.states]
        return [o for o in outs if o is not None]

    def _emit(self, u: StepUpdate) -> RequestOutput | None:
        req = u.request
        lp = u.result.logprobs
        # Tokens past the request's end were dropped by the scheduler; so are their logprobs.
        lp = lp[:len(u.new_token_ids)] if lp is not None else None
        out = self.outputs.process(req, u.new_token_ids, u.finished, lp)
        if out.finished:
            out.spec = self.request_spec(req.request_id)
            t = out.timings
            self.recorder.finished(
                req.request_id,
                FinishedRequestTimes(
                    ttft_s=t.ttft_s,
                    inter_token_s=t.inter_token_s,
                    e2e_s=t.e2e_s,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_generation_tokens=req.num_output_tokens,
                ),
            )
            self._forget_runner_state(req.request_id)
        if not u.new_token_ids and not out.finished:
            return None
        return out

    def _error_output(self, req: Request, exc: Exception) -> RequestOutput:
        self._forget(req.request_id)
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids), [],
                             finished=True, finish_reason="error",
                             error=f"{type(exc).__name__}: {exc}")

    # ---- facts for reports ---------------------------------------------------------------
    @property
    def lossless(self) -> bool:
        """False under --rejection-mode synthetic: output is not the target's (even greedy)."""
        return self.config.spec.lossless or not self.plan.speculating

    def request_spec(self, request_id: str) -> RequestSpecSummary | None:
        if self.plan.kind == "off":
            return None
        return self.recorder.request_spec(request_id, self.lossless)

    def pool_report(self) -> PoolReport:
        p = self.parts
        return PoolReport(
            num_blocks=p.kv.num_blocks,
            block_size=p.kv.block_size,
            num_tokens=p.kv.num_blocks * p.kv.block_size,
            drafter_num_tokens=p.drafter_kv_tokens,
            drafter_cache=self.runner.proposer.cache_stats()
            if self.runner.proposer is not None
            else None,
        )

    # ---- the engine client protocol (engine/client.py) -----------------------------------
    @property
    def log_stats_interval_s(self) -> float:
        return self.config.observability.log_stats_interval_s

    def model_card(self) -> ModelCard:
        info = self.parts.policy_info
        cc = self.config.cache
        return ModelCard(
            max_model_len=self.max_model_len,
            vocab_size=self.parts.vocab_size,
            spec_plan=self.plan.to_json(),
            k_policy=info.to_json() if info is not None else None,
            lossless=self.lossless,
            execution_plan=self.exec_plan.to_json(),
            block_size=cc.block_size,
            prefix_caching=cc.enable_prefix_caching,
        )

    def compile_grammar(self, spec) -> None:
        self.structured.compile(spec)

    def progress(self) -> int:
        # An async launch returns nothing yet but is work: count it as progress.
        return self.recorder.times.steps * 2 + int(self.step_in_flight)

    def failure(self) -> str | None:
        return None  # one process: a failed step fails its requests, never the engine

    def state(self) -> EngineState:
        return EngineState(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_num_blocks=self.kv.num_blocks,
            kv_free_blocks=self.kv.num_free_blocks(),
            kv_usage=self.kv.usage(),
        )

    def snapshot(self) -> EngineSnapshot:
        pool, policy = self.pool_report(), self.scheduler.policy
        modelled, observed = policy.goodput_report() if policy is not None else (None, None)
        info = self.parts.policy_info
        return EngineSnapshot(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv.usage(),
            kv_pool_tokens_target=pool.num_tokens,
            kv_pool_tokens_drafter=pool.drafter_num_tokens,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions_total=self.scheduler.num_preemptions,
            modelled_goodput=modelled,
            observed_goodput=observed,
            k_policy=info.name if info else None,
            k_policy_reprobes=policy.num_reprobes if policy is not None else 0,
        )

    def take_finished_times(self) -> list[FinishedRequestTimes]:
        return self.recorder.take_finished_times()

    def shutdown(self) -> None:
        """Nothing runs outside this process's step (the DP front end stops its ranks)."""

    def take_step(self) -> StepStats | None:
        return self.recorder.take_step()

    # The recorder's readings, as the engine client protocol names them.
    @property
    def counters(self) -> SpecCounters:
        return self.recorder.counters

    @property
    def times(self) -> StepTimes:
        return self.recorder.times

    @property
    def execution_steps(self) -> Counter:
        return self.recorder.execution_steps

    @property
    def last_step(self) -> StepStats | None:
        return self.recorder.last_step

    def generate_sync(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def reset_drafter_cache(self) -> None:
        """Empty a drafter's cross-request cache (the suffix drafter's), if it has one."""
        if self.runner.proposer is not None:
            self.runner.proposer.reset_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.has_unfinished_requests():
            assert self.kv.num_free_blocks() == self.kv.num_blocks, (
                "blocks leaked after all requests finished"
            )


def _driver(config: EngineConfig):
    if config.scheduler.async_scheduling:
        from dynaspec.engine.async_loop import AsyncStepLoop
        return AsyncStepLoop
    return SyncDriver
