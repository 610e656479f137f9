"""What one rank says at each step exchange (dp/agreement.py), and its row of float64s.

A rank's ``RankState`` is built whole before the exchange, from its scheduler's step view, its
loop's control (unfinished requests, stopping, the group it is ready to move to, its previous
step's time) and its K policy's report of the previous step (``StepObservation`` and the
per-position acceptance counts since the last exchange). ``all_gather`` moves float64 rows, so
every rank decodes the same rows into the same ``RankState``s and sums them bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

# Row layout: one float64 per field, then the acceptance counts (reached, then hits; 2 * max_k).
_FIELDS = ("num_reqs", "num_decoding", "sum_ctx", "max_ctx", "num_unfinished", "stopping",
           "join_epoch", "step_seconds", "ran_step", "obs_valid", "obs_num_reqs", "obs_ctx",
           "obs_width", "obs_target_s", "obs_draft_s", "obs_drafted", "obs_emitted",
           "obs_modelled")
_IX = {name: i for i, name in enumerate(_FIELDS)}
_OBS = slice(_IX["obs_num_reqs"], _IX["obs_modelled"] + 1)


@dataclass(frozen=True)
class StepObservation:
    """A step as the goodput policy's cost model and guard see it (``observe_step``'s
    arguments): its shape, its target and draft seconds, drafted and emitted tokens, and the
    goodput its decision modelled (None: no decision to pair with)."""

    num_reqs: int
    ctx: int
    width: int
    target_seconds: float
    draft_seconds: float
    num_drafted: int
    num_emitted: int
    modelled_goodput: float | None = None

    def values(self) -> list[float]:
        m = self.modelled_goodput
        return [float(self.num_reqs), float(self.ctx), float(self.width), self.target_seconds,
                self.draft_seconds, float(self.num_drafted), float(self.num_emitted),
                -1.0 if m is None else m]

    @staticmethod
    def of_values(v: list[float]) -> StepObservation:
        return StepObservation(int(v[0]), int(v[1]), int(v[2]), v[3], v[4], int(v[5]), int(v[6]),
                               v[7] if v[7] >= 0 else None)


@dataclass(frozen=True)
class RankState:
    num_reqs: int  # requests the scheduler expects in this step (prefill included)
    num_decoding: int
    sum_ctx: int  # of the decoding requests
    max_ctx: int
    num_unfinished: int  # requests on the rank, plus a step in flight (all zero: every rank idles)
    stopping: bool  # leave after this exchange (every rank leaves on the same tick)
    join_epoch: int  # the group the rank is ready to move to (0: none; dp/regroup.py)
    step_seconds: float  # its previous step's time (0: none ran); the timeout grows with it
    ran_step: bool  # a real step ran since the previous exchange
    observation: StepObservation | None  # that step, where the policy has one to share
    acceptance: tuple[float, ...]  # per-position reached then hit counts since the last exchange

    @staticmethod
    def of_step(num_reqs: int, decoding_ctxs: list[int], num_unfinished: int = 0,
                stopping: bool = False, join_epoch: int = 0, step_seconds: float = 0.0,
                ran_step: bool = False, observation: StepObservation | None = None,
                acceptance: tuple[float, ...] = ()) -> RankState:
        return RankState(num_reqs, len(decoding_ctxs), sum(decoding_ctxs),
                         max(decoding_ctxs, default=0), num_unfinished, stopping, join_epoch,
                         step_seconds, ran_step, observation, acceptance)

    def row(self, max_k: int) -> list[float]:
        row = [0.0] * len(_FIELDS)
        for name, value in (("num_reqs", self.num_reqs), ("num_decoding", self.num_decoding),
                            ("sum_ctx", self.sum_ctx), ("max_ctx", self.max_ctx),
                            ("num_unfinished", self.num_unfinished),
                            ("stopping", self.stopping), ("join_epoch", self.join_epoch),
                            ("step_seconds", self.step_seconds), ("ran_step", self.ran_step)):
            row[_IX[name]] = float(value)
        if self.observation is not None:
            row[_IX["obs_valid"]] = 1.0
            row[_OBS] = self.observation.values()
        counts = list(self.acceptance) or [0.0] * (2 * max_k)
        if len(counts) != 2 * max_k:
            raise ValueError(f"acceptance counts for {len(counts) // 2} positions, the "
                             f"exchange carries {max_k}")
        return row + counts

    @staticmethod
    def of_row(row: list[float]) -> RankState:
        def n(name: str) -> int:
            return int(row[_IX[name]])

        obs = StepObservation.of_values(row[_OBS]) if row[_IX["obs_valid"]] else None
        return RankState(n("num_reqs"), n("num_decoding"), n("sum_ctx"), n("max_ctx"),
                         n("num_unfinished"), bool(row[_IX["stopping"]]), n("join_epoch"),
                         row[_IX["step_seconds"]], bool(row[_IX["ran_step"]]), obs,
                         tuple(row[len(_FIELDS):]))
