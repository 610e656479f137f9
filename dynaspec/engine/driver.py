"""The seam between the engine and its drivers, as two protocols.

A driver is an order of the engine's phases (`schedule -> launch -> land -> emit`, docs/design.md
§1b): `SyncDriver` (engine/sync_driver.py), the pipelined `AsyncStepLoop` (engine/async_loop.py)
and the data-parallel rank's lockstep loop (dp/rank.py). `EnginePhases` is what a driver holds of
the engine: the four phases and the drop of a finished request's runner state, nothing else.
`Driver` is what the engine holds of its driver: one step, whether something is still in flight,
and when a request's runner state may go.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Protocol

from dynaspec.engine.phases import Landed, Launched
from dynaspec.outputs import RequestOutput
from dynaspec.step_plan import StepPlan


class EnginePhases(Protocol):
    def schedule(self) -> StepPlan: ...

    def launch(self, plan: StepPlan, worker: Executor | None = None) -> Launched | None: ...

    def land(self, launched: Launched) -> Landed: ...

    def emit(self, landed: Landed) -> list[RequestOutput]: ...

    def release_runner_state(self, request_id: str) -> None: ...


class Driver(Protocol):
    @property
    def busy(self) -> bool:
        """A step is in flight, or its outputs are not returned yet."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop the request's runner state once no step in flight may use it."""
        ...

    def close(self) -> None: ...

    def step(self) -> list[RequestOutput]: ...
