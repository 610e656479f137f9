"""StepRecorder: the engine's accounting of landed steps, apart from the step itself.

`emit` hands every landed step to `record`; the recorder folds it into the engine's counters
(docs/design.md §5), keeps phase times, tokens by kind, steps by execution path, each running
request's per-step spec records (folded once, when the request finishes: folding every step
costs) and finished requests' timings for the histograms. Readers (`/metrics`, the stats log line,
benchmarks) read its fields; nothing here changes a request or the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from dynaspec.engine.phases import Landed
from dynaspec.engine.step_records import request_spec
from dynaspec.metrics.records import (
    FinishedRequestTimes,
    GrammarStepStats,
    RequestStepSpec,
    StepStats,
)
from dynaspec.metrics.stats import RequestSpecSummary, SpecCounters, fold_step
from dynaspec.outputs import RequestTimings, RunnerOutput
from dynaspec.request import Request, RequestStatus


@dataclass
class StepTimes:
    schedule: float = 0.0
    prepare: float = 0.0
    draft: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    steps: int = 0
    grammar: float = 0.0  # structured output mask work (inside prepare and sample)
    grammar_steps: int = 0  # steps that masked >= 1 row


class StepRecorder:
    def __init__(self, drain_compile_seconds: Callable[[], tuple[float, ...]]) -> None:
        """`drain_compile_seconds()`: grammar compile time since the last call (structured)."""
        self._drain_compile_seconds = drain_compile_seconds
        self.counters = SpecCounters()
        self.times = StepTimes()
        self.last_step: StepStats | None = None
        self._step_taken: StepStats | None = None  # the last one take_step handed out
        self.execution_steps: Counter = Counter()  # (path, width label) -> steps
        self.finished_times: list[FinishedRequestTimes] = []  # take_finished_times drains it
        self.aborts_by_phase: dict[str, int] = {}  # where aborted requests were (reliability)
        self._request_records: dict[str, list[tuple[RequestStepSpec, int | None]]] = {}

    # ---- requests ------------------------------------------------------------------------
    def start(self, request_id: str) -> None:
        self._request_records[request_id] = []

    def forget(self, request_id: str) -> None:
        self._request_records.pop(request_id, None)

    def aborted(self, req: Request) -> None:
        """Count an abort by where the request was: waiting, in its prefill, or decoding."""
        phase = ("waiting" if req.status is not RequestStatus.RUNNING else
                 "prefill" if req.num_computed_tokens < req.num_prompt_tokens else "decode")
        self.aborts_by_phase[phase] = self.aborts_by_phase.get(phase, 0) + 1

    def finished(self, req: Request, t: RequestTimings) -> None:
        """A request's final output went out with these timings: keep them for the
        histograms and drop its records."""
        self.finished_times.append(FinishedRequestTimes(
            ttft_s=t.ttft_s, inter_token_s=t.inter_token_s, e2e_s=t.e2e_s,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=req.num_output_tokens))
        self.forget(req.request_id)

    def num_tracked(self) -> int:
        """Requests with records held (0 once every request has ended: nothing leaks)."""
        return len(self._request_records)

    def request_spec(self, request_id: str, lossless: bool) -> RequestSpecSummary | None:
        records = self._request_records.get(request_id)
        return RequestSpecSummary.of(records, lossless) if records is not None else None

    # ---- steps ---------------------------------------------------------------------------
    def record(self, landed: Landed) -> StepStats:
        plan, res, updates = landed.plan, landed.res, landed.updates
        assert res is not None  # emit() records only steps that did not raise
        t = self.times
        t.steps += 1
        t.schedule += plan.schedule_seconds
        t.prepare += res.prepare_seconds
        t.draft += res.draft_seconds
        t.forward += res.forward_seconds
        t.sample += res.sample_seconds
        t.update += landed.update_seconds
        # A request whose drafts were all invalid is an `all_invalid` skip (in the fold).
        specs = [request_spec(u.result, len(u.new_token_ids)) for u in updates]
        num_gen = sum(len(u.new_token_ids) for u in updates)
        batch = res.batch
        step = StepStats(
            k=plan.step_k,
            requests=(*specs, *landed.orphans),
            draft_seconds=res.draft_seconds,
            verify_seconds=res.forward_seconds + res.sample_seconds,
            schedule_seconds=plan.schedule_seconds,
            num_prompt_tokens=landed.num_prompt_tokens,
            num_generation_tokens=num_gen,
            num_preemptions=len(plan.preempted_ids),
            grammar=self._grammar_stats(res),
            path=batch.path if batch else None,
            width=batch.width_label if batch else None,
        )
        self.counters = fold_step(self.counters, step)
        self.last_step = step
        if batch is not None:
            self.execution_steps[(batch.path, batch.width_label)] += 1
        for spec in specs:
            records = self._request_records.get(spec.request_id)
            if records is not None:
                records.append((spec, plan.step_k))
        return step

    def _grammar_stats(self, res: RunnerOutput) -> GrammarStepStats | None:
        compiled = self._drain_compile_seconds()
        if not res.grammar_rows and not compiled:
            return None
        self.times.grammar += res.grammar_seconds
        self.times.grammar_steps += res.grammar_rows > 0
        return GrammarStepStats(res.grammar_seconds, res.grammar_rows, compiled)

    # ---- draining readers ----------------------------------------------------------------
    def take_step(self) -> StepStats | None:
        """The last recorded step, once (the server's per-step metrics)."""
        step = self.last_step
        if step is None or step is self._step_taken:
            return None
        self._step_taken = step
        return step

    def take_finished_times(self) -> list[FinishedRequestTimes]:
        times, self.finished_times = self.finished_times, []
        return times
