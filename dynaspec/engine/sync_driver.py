"""SyncDriver: the plain order of an engine's phases, one step at a time.

A driver holds the engine's phases (`EnginePhases`, engine/driver.py): this one, the pipelined
`AsyncStepLoop` (engine/async_loop.py) and the data-parallel rank's lockstep loop (dp/rank.py).
The engine runs whichever it was given; a driver calls only the engine's public phases.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynaspec.engine.client import EngineClient
from dynaspec.engine.driver import EnginePhases
from dynaspec.outputs import RequestOutput
from dynaspec.sampling_params import SamplingParams


class SyncDriver:
    def __init__(self, engine: EnginePhases) -> None:
        self.engine = engine

    @property
    def busy(self) -> bool:
        """Nothing outlives a sync step."""
        return False

    def forget(self, request_id: str) -> None:
        self.engine.release_runner_state(request_id)

    def close(self) -> None:
        """Nothing to stop."""

    def step(self) -> list[RequestOutput]:
        e = self.engine
        plan = e.schedule()
        if not plan.scheduled:
            return []
        launched = e.launch(plan)
        return e.emit(e.land(launched)) if launched is not None else []


def generate(engine: EngineClient, prompts: Sequence[str | list[int]],
             params: Sequence[SamplingParams]) -> list[RequestOutput]:
    """Queue `prompts` on `engine` and step it (by its own driver) until all have finished;
    their final outputs, in order."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return [final[i] for i in ids]
