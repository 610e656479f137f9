"""Step cost model: seconds per target step over (requests, context, verify width), per machine.

The goodput policy (``goodput_policy.py``) needs to know what a wider verify costs *here*: on a
memory-bound batch-1 decode one more verified token is almost free, on a compute-bound batch of
64 it costs nearly a full token. The model is a grid measured (in part) and checked at start-up
(``spec_decode/cost_profile``), cached on disk cell by cell (``cost_cache``), or injected as a fixed
table (``SpecConfig.cost_table``). While serving, every decode step the engine runs refreshes
the grid point nearest to it by an exponential moving average (not an injected table's), so a
noisy start or a changed load is corrected from the step times actually seen.

Lookup between grid points interpolates linearly in log2(requests), context and width; outside
the grid it extrapolates along the outermost segment (and never below a tiny positive cost).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dynaspec.cpu_features import cpu_model_name

# The cost tables' own root, read before DYNASPEC_CACHE_DIR (every cache's root): the test
# suite isolates its measured tables without also moving the kernels' build cache (a fresh JIT
# build of every kernel, minutes, for each run and each process it starts).
CACHE_ENV = "DYNASPEC_COST_CACHE_DIR"
ROOT_ENV = "DYNASPEC_CACHE_DIR"


@dataclass(frozen=True)
class CostGrid:
    """The axes a profile measures; every axis is sorted and strictly increasing."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    widths: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, axis in (
            ("batches", self.batches),
            ("contexts", self.contexts),
            ("widths", self.widths),
        ):
            if not axis or any(v < 1 for v in axis) or list(axis) != sorted(set(axis)):
                raise ValueError(f"cost grid {name} must be increasing integers >= 1, got {axis}")

    @staticmethod
    def default(max_num_seqs: int, max_model_len: int, max_width: int) -> CostGrid:
        """A few seconds of profiling: batch 1..64 in powers of 4, two contexts, <= 4 widths."""
        batches = tuple(b for b in (1, 4, 16, 64) if b <= max_num_seqs) or (1,)
        if max_num_seqs not in batches and max_num_seqs < 64:
            batches = tuple(sorted(set(batches) | {max_num_seqs}))
        contexts = tuple(sorted({min(c, max(1, max_model_len - max_width)) for c in (128, 1024)}))
        widths = tuple(sorted({1, min(2, max_width), max(1, (1 + max_width) // 2), max_width}))
        return CostGrid(batches, contexts, widths)


class _Axis:
    """One grid axis, its points transformed once (log2 for batches): a decision prices a few
    widths, every step, and transforming the axis on each lookup was most of its cost."""

    def __init__(self, points: tuple[int, ...], log: bool) -> None:
        self.log = log
        self.x = [self.f(p) for p in points]

    def f(self, v: float) -> float:
        return math.log2(max(v, 1e-9)) if self.log else float(v)

    def weights(self, value: float) -> list[tuple[int, float]]:
        """(index, weight) pairs interpolating `value`; linear extrapolation outside."""
        if len(self.x) == 1:
            return [(0, 1.0)]
        x = self.f(value)
        i = bisect.bisect_right(self.x, x) - 1
        i = min(max(i, 0), len(self.x) - 2)
        x0, x1 = self.x[i], self.x[i + 1]
        t = (x - x0) / (x1 - x0)
        return [(i, 1.0 - t), (i + 1, t)]

    def nearest(self, value: float) -> int:
        x = self.f(value)
        return min(range(len(self.x)), key=lambda i: abs(self.x[i] - x))


class StepCostModel:
    """``seconds[b][c][w]``: measured seconds of one decode/verify step on this machine."""

    MIN_COST = 1e-6

    def __init__(self, grid: CostGrid, seconds: list[list[list[float]]], alpha: float = 0.1,
                 source: str = "measured", learn: bool = True,
                 draft_seconds_per_token: float | None = None) -> None:
        shape = (len(grid.batches), len(grid.contexts), len(grid.widths))
        if (
            len(seconds),
            *{len(r) for r in seconds},
            *{len(c) for r in seconds for c in r},
        ) != shape:
            raise ValueError(f"cost table shape does not match the grid {shape}")
        if any(not s > 0 for r in seconds for c in r for s in c):
            raise ValueError("every measured step cost must be > 0 seconds")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if draft_seconds_per_token is not None and draft_seconds_per_token < 0:
            raise ValueError(f"draft_seconds_per_token must be >= 0, got {draft_seconds_per_token}")
        self.grid, self.alpha, self.source = grid, alpha, source
        self._axes = (_Axis(grid.batches, True), _Axis(grid.contexts, False),
                      _Axis(grid.widths, False))
        self.seconds = [[list(c) for c in r] for r in seconds]
        self.num_observations = 0
        # False for an injected table (tests, a user's fixed file): served steps leave it as it
        # is, so a decision depends on the table alone and never on this machine's timing.
        self.learn = learn
        # A fixed drafter cost per drafted token; None: the policy learns it from served steps.
        self.draft_seconds_per_token = draft_seconds_per_token

    def cost(self, num_reqs: int, ctx: int, width: int) -> float:
        b_axis, c_axis, w_axis = self._axes
        total = 0.0
        # Each axis's weights once, not once per grid cell they multiply.
        cws, wws = c_axis.weights(ctx), w_axis.weights(width)
        for bi, bw in b_axis.weights(num_reqs):
            for ci, cw in cws:
                for wi, ww in wws:
                    total += bw * cw * ww * self.seconds[bi][ci][wi]
        return max(self.MIN_COST, total)

    def widths_priced(self, num_reqs: int, ctx: int) -> Callable[[int], float]:
        """cost(width) at these requests and context, each width priced once: one decision's
        row checks, probes and candidates ask for the same few widths many times."""
        seen: dict[int, float] = {}

        def cost(width: int) -> float:
            c = seen.get(width)
            if c is None:
                c = seen[width] = self.cost(num_reqs, ctx, width)
            return c

        return cost

    def observe(self, num_reqs: int, ctx: int, width: int, seconds: float) -> None:
        """Move the nearest grid point toward an observed step, scaled to that point's shape
        by the model's own ratio, so one observation off-grid corrects its neighbourhood."""
        if not seconds > 0 or not self.learn:
            return
        b_axis, c_axis, w_axis = self._axes
        bi, ci, wi = b_axis.nearest(num_reqs), c_axis.nearest(ctx), w_axis.nearest(width)
        here = self.cost(num_reqs, ctx, width)
        at_point = self.seconds[bi][ci][wi]
        target = seconds * at_point / here
        self.seconds[bi][ci][wi] = max(self.MIN_COST, at_point + self.alpha * (target - at_point))
        self.num_observations += 1

    def to_json(self) -> dict:
        g = self.grid
        return {"batches": list(g.batches), "contexts": list(g.contexts), "widths": list(g.widths),
                "seconds": self.seconds, "source": self.source, "learn": self.learn,
                "draft_seconds_per_token": self.draft_seconds_per_token}

    @staticmethod
    def from_json(d: dict, alpha: float = 0.1) -> StepCostModel:
        try:
            grid = CostGrid(tuple(d["batches"]), tuple(d["contexts"]), tuple(d["widths"]))
            return StepCostModel(grid, d["seconds"], alpha, d.get("source", "cached"),
                                 bool(d.get("learn", True)), d.get("draft_seconds_per_token"))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"cost table is missing or has a malformed field: {exc}") from exc

    @staticmethod
    def injected(value: str | dict) -> StepCostModel:
        """A table given by the user or a test (``SpecConfig.cost_table``): JSON text, a path
        to a JSON file, or the dict itself. Fixed unless it says ``"learn": true``."""
        if isinstance(value, str):
            text = Path(value).read_text() if os.path.isfile(value) else value
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--cost-table is neither a JSON file nor JSON text: {exc}"
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"a cost table is a JSON object, got {type(value).__name__}")
        model = StepCostModel.from_json({"learn": False, **value})
        model.source = "injected"
        return model

    def monotone_problems(self, tolerance: float = 0.2, floor_s: float = 5e-4) -> list[str]:
        """Where a wider step or a bigger batch costs less than `tolerance` (and `floor_s`,
        below which a tiny model's steps are timer noise) below its smaller neighbour: not a
        shape a real machine has (a step does strictly more work), so a sign the cells were
        measured under changing load."""
        g, s, bad = self.grid, self.seconds, []

        def below(a: float, b: float) -> bool:  # a reads cheaper than b beyond the tolerance
            return a < (1 - tolerance) * b and b - a > floor_s

        for bi, b in enumerate(g.batches):
            for ci, c in enumerate(g.contexts):
                for wi, w in enumerate(g.widths):
                    here = s[bi][ci][wi]
                    if wi and below(here, s[bi][ci][wi - 1]):
                        bad.append(f"batch {b} ctx {c}: width {w} {1e3 * here:.2f} ms < width "
                                   f"{g.widths[wi - 1]} {1e3 * s[bi][ci][wi - 1]:.2f} ms")
                    if bi and below(here, s[bi - 1][ci][wi]):
                        bad.append(f"ctx {c} width {w}: batch {b} {1e3 * here:.2f} ms < batch "
                                   f"{g.batches[bi - 1]} {1e3 * s[bi - 1][ci][wi]:.2f} ms")
        return bad

    def describe(self) -> list[str]:
        """Rows for logs and ``schedule explain``: ms per step by (batch, ctx) across widths."""
        g = self.grid
        lines = [f"step cost (ms), {self.source}; widths {'/'.join(map(str, g.widths))}:"]
        for bi, b in enumerate(g.batches):
            for ci, c in enumerate(g.contexts):
                cells = " ".join(f"{1e3 * s:7.2f}" for s in self.seconds[bi][ci])
                lines.append(f"  batch {b:>3} ctx {c:>5}: {cells}")
        return lines


def cpu_model() -> str:
    return cpu_model_name() or platform.processor() or platform.machine()


def cache_dir() -> Path:
    for env in (CACHE_ENV, ROOT_ENV):
        if os.environ.get(env):
            return Path(os.environ[env])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dynaspec"
