"""engine/phases.py: launch and land, inline (the sync and data-parallel drivers) and failing.

The real Scheduler runs; a stub runner answers each step with one token per sampling request
(no drafts). A step that raises in `prepare` or in `run` fails only its own requests, through
the scheduler (finished with an error, blocks freed), and `land` reports them for `emit`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynaspec.config import SchedulerConfig
from dynaspec.engine.phases import StepPhases
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.outputs import RequestResult, RunnerOutput
from dynaspec.request import Request, RequestStatus
from dynaspec.sampling_params import SamplingParams
from dynaspec.scheduler.scheduler import Scheduler
from dynaspec.spec_decode.plan.plan import build_spec_plan


class StubRunner:
    def __init__(self, fail_in: str | None = None) -> None:
        self.fail_in = fail_in

    def prepare(self, plan):  # type: ignore[no-untyped-def]
        if self.fail_in == "prepare":
            raise RuntimeError("prepare broke")
        return SimpleNamespace(plan=plan, drafts={})

    def run(self, prepared):  # type: ignore[no-untyped-def]
        if self.fail_in == "run":
            raise RuntimeError("forward broke")
        return RunnerOutput(results=tuple(
            RequestResult(request_id=s.request.request_id, token_ids=(7,) if s.sampling else ())
            for s in prepared.plan.scheduled))


def _scheduler() -> Scheduler:
    plan = build_spec_plan("none", 0, None)
    return Scheduler(SchedulerConfig(64, 8), KVCacheManager(32, 4, False), plan, None, 128, (2,))


def _add(sch: Scheduler, rid: str) -> Request:
    req = Request(rid, [10, 11, 12], SamplingParams(temperature=0.0, max_tokens=5))
    sch.add_request(req)
    return req


def test_inline_launch_and_land_apply_the_step_through_the_scheduler():
    sch = _scheduler()
    a = _add(sch, "a")
    phases = StepPhases(sch, StubRunner())
    plan = sch.schedule()
    launched = phases.launch(plan)
    assert launched.future.done() and launched.holds == (), "inline: no placeholders held"
    landed = phases.land(launched)
    assert landed.error is None and [u.new_token_ids for u in landed.updates] == [[7]]
    assert a.output_token_ids == [7] and a.num_computed_tokens == 3
    assert landed.num_prompt_tokens == 3


@pytest.mark.parametrize("where", ["prepare", "run"])
def test_a_failing_step_fails_only_its_requests(where):
    sch = _scheduler()
    a, b = _add(sch, "a"), _add(sch, "b")
    plan = sch.schedule()
    c = _add(sch, "c")  # queued after the step formed: not in it
    phases = StepPhases(sch, StubRunner(fail_in=where))
    landed = phases.land(phases.launch(plan))
    assert isinstance(landed.error, RuntimeError) and landed.updates == ()
    assert landed.failed == (a, b)
    assert a.status is b.status is RequestStatus.FINISHED_ERROR
    assert c.status is RequestStatus.WAITING and sch.has_unfinished()
    assert sch.kv.num_free_blocks() == sch.kv.num_blocks, "the failed requests' blocks are freed"
