"""The goodput policy's engine-wide state as one value: what a K decision reads beyond its view
and the per-request histories (docs/design.md §7).

Four parts: the step cost table, the drafter's cost per drafted token (and the samples its
median comes from), the engine-wide acceptance prior, and the divergence guard's counters.
Under data parallelism every rank holds the same value (dynaspec/dp moves it with the gathered
observations and hands it whole to a re-formed group), and the lockstep decision is
``GoodputPolicy.decide(view, state)``: a function of the view, this value and nothing else
shared. The per-request histories are not in it: they only lower their own request's cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel

Seconds = tuple[tuple[tuple[float, ...], ...], ...]


@dataclass(frozen=True)
class CostTable:
    """A step cost table's cells (StepCostModel's ``seconds[b][c][w]``) with its grid."""

    grid: CostGrid
    seconds: Seconds
    source: str
    learn: bool

    @staticmethod
    def of(model: StepCostModel) -> CostTable:
        return CostTable(model.grid, tuple(tuple(tuple(c) for c in r) for r in model.seconds),
                         model.source, model.learn)

    def to_json(self) -> dict:
        """StepCostModel.from_json's form (a rank that must switch to the goodput policy)."""
        g = self.grid
        return {"batches": list(g.batches), "contexts": list(g.contexts), "widths": list(g.widths),
                "seconds": [[list(c) for c in r] for r in self.seconds], "source": self.source,
                "learn": self.learn}


@dataclass(frozen=True)
class EngineAcceptance:
    """The engine-wide acceptance prior (an AcceptanceHistory's learned fields)."""

    rates: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()
    num_updates: int = 0


@dataclass(frozen=True)
class GuardState:
    """The divergence guard's counters and the goodput EMAs it compares (goodput_policy)."""

    modelled_goodput: float | None = None
    observed_goodput: float | None = None
    num_decode_steps: int = 0
    diverged_steps: int = 0
    last_reprobe_step: int | None = None
    reprobe_pending: bool = False
    num_reprobes: int = 0


@dataclass(frozen=True)
class PolicyState:
    cost: CostTable
    draft_seconds_per_token: float
    draft_costs: tuple[float, ...]  # the recent per-token samples its median is taken over
    acceptance: EngineAcceptance
    guard: GuardState
