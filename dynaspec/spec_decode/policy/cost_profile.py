"""Start-up step cost table: measure a few cells, check them, cache them cell by cell.

``measure_cell`` runs the real forward (metadata build, model, greedy pick of every verified
row) on a synthetic decode/verify batch. It runs before any request exists, so it may write KV
slots freely: every synthetic request aliases the same first blocks of the pool.

``startup_cost_model`` decides which table the goodput policy starts from:
- only the *essential* cells are measured (batch 1 and one mid batch at the first context, and
  batch 1 at every context, each across the widths); the other grid cells are estimated from
  them (``cost_cache.estimate``) and corrected by the served steps, so a cache miss costs a
  few seconds, not a profile of every (batch, ctx, width);
- a table is checked before it is used or saved: monotone in width and batch within a
  tolerance, and consistent with a short re-probe of a few cells. A cached table the re-probe
  finds much *slower* than now was measured under load: it is re-measured. A fresh table that
  fails is measured once more; if that fails too, no table is used (the policy falls back to
  the plan's table, with a warning) and nothing is saved.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynaspec.spec_decode.policy import cost_cache
from dynaspec.spec_decode.policy.cost_cache import Cell, Shape
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel

if TYPE_CHECKING:
    import torch

    from dynaspec.models.llama import LlamaModel

log = logging.getLogger("dynaspec")

Prober = Callable[[int, int, int], Cell]  # (batch, ctx, width) -> a measured cell


@dataclass(frozen=True)
class ProfileSettings:
    reps: int = 2  # timed repeats per cell (after one untimed warm-up run)
    monotone_tolerance: float = 0.2  # a wider/bigger step may read this much cheaper (noise)
    reprobe_tolerance: float = 1.3  # a re-probed cell must agree within this factor ...
    floor_s: float = 5e-4  # ... or this many seconds (a tiny model's steps are timer noise)
    num_reprobe: int = 2
    # A failed first attempt is measured again only if it took less than this: a first start on
    # a busy 2-core machine spent 87 s on an attempt the load had made non-monotone, then 68 s
    # on a second that failed the same way before the table fallback
    # (docs/history/benchmarks-waves-1-4.md).
    retry_within_s: float = 20.0


def gpu_profile_settings() -> ProfileSettings:
    """On a GPU a small model's step is launch-bound: widths 1..9 cost the same within noise
    (the H200 measured width 2 below width 1 at batch 64 and the table was refused). More
    repeats, and differences under 1.5 ms or 35% count as ties, not as a broken table."""
    return ProfileSettings(reps=5, monotone_tolerance=0.35, reprobe_tolerance=1.5, floor_s=1.5e-3)


@dataclass(frozen=True)
class CostTable:
    """What the builder gets: the model (None: refused) and where it came from, for the logs."""

    model: StepCostModel | None
    source: str  # "cached", "measured at start-up", "refused"
    cache_file: str | None
    problems: tuple[str, ...] = ()
    num_measured: int = 0
    seconds: float = 0.0  # spent measuring and re-probing


def synthetic_step(model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                   num_blocks: int, batch: int, ctx: int, width: int) -> Callable[[], None]:
    """A callable running one verify-shaped step: `batch` requests of `width` new tokens after
    `ctx` cached ones (every request aliases the same first blocks of the pool), logits for
    every row and their argmax, as verification reads them. Also `dynaspec bench decode
    --widths`."""
    import torch

    from dynaspec.attention.backend import AttentionBatch
    from dynaspec.sample.greedy import argmax_rows

    ctx = min(ctx, num_blocks * block_size - width)  # the pool bounds the context we can fake
    blocks = list(range(-(-(ctx + width) // block_size)))
    qlens, clens = [width] * batch, [ctx + width] * batch
    ids = torch.zeros(batch * width, dtype=torch.long, device=model.device)  # [T]
    pos = torch.arange(ctx, ctx + width, device=model.device).repeat(batch)  # [T]
    rows = torch.arange(batch * width, device=model.device)  # [T]: every verified row
    # Greedy rows, as most served steps are: only their argmax is read (see LlamaModel.head).
    only_argmax = torch.ones(batch * width, dtype=torch.bool)  # [T]

    def step() -> None:
        md = model.attn.build_metadata(AttentionBatch(qlens, clens, [blocks] * batch, block_size,
                                                      model.device))
        logits = model.forward(ids, pos, kv_caches, md, rows, argmax_rows=only_argmax)
        argmax_rows(logits).tolist()

    return step


def measure_cell(model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                 num_blocks: int, batch: int, ctx: int, width: int, reps: int) -> Cell:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    step = synthetic_step(model, kv_caches, block_size, num_blocks, batch, ctx, width)
    times = []
    for i in range(reps + 1):  # run 0 warms caches and oneDNN primitives, not timed
        t0 = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - t0)
    best = min(times)
    return Cell(best, time.time(), load, (max(times) - best) / best, reps)


def essential_shapes(grid: CostGrid) -> list[Shape]:
    """The cells a start-up measures: every width at batch 1 and at one mid batch (<= 16) at
    the first context, and every width at batch 1 at the other contexts."""
    c0 = grid.contexts[0]
    mids = [b for b in grid.batches if 1 < b <= 16]
    batches = [grid.batches[0]] + ([mids[-1]] if mids else [])
    shapes = [(b, c0, w) for b in batches for w in grid.widths]
    shapes += [(grid.batches[0], c, w) for c in grid.contexts[1:] for w in grid.widths]
    return shapes


def _reprobe_shapes(grid: CostGrid, n: int) -> list[Shape]:
    ess = essential_shapes(grid)
    picks = [(grid.batches[0], grid.contexts[0], grid.widths[-1]), ess[-1], ess[0]]
    return list(dict.fromkeys(picks))[:n]


def _measure(prober: Prober, shapes: list[Shape]) -> dict[Shape, Cell]:
    out, t0 = {}, time.perf_counter()
    for i, shape in enumerate(shapes):
        out[shape] = prober(*shape)
        if i + 1 == len(shapes) or (i + 1) % 4 == 0:
            log.info("step cost profile: %d/%d cells (%.1f s)", i + 1, len(shapes),
                     time.perf_counter() - t0)
    return out


def _disagreements(model: StepCostModel, probes: dict[Shape, Cell], tol: float,
                   slower_ok: bool, floor_s: float) -> list[str]:
    """Re-probed cells that disagree with the table beyond `tol` (a factor). With `slower_ok`
    a re-probe slower than the table is accepted: the machine is busier now than when the
    table was measured, which says nothing against the table."""
    bad = []
    for (b, c, w), cell in probes.items():
        table = model.cost(b, c, w)
        ratio = cell.seconds / table
        if abs(cell.seconds - table) <= floor_s:
            continue
        if ratio < 1 / tol or (ratio > tol and not slower_ok):
            bad.append(f"batch {b} ctx {c} width {w}: table {1e3 * table:.2f} ms, re-probe "
                       f"{1e3 * cell.seconds:.2f} ms")
    return bad


def _checked(grid: CostGrid, cells: dict[Shape, Cell], source: str, prober: Prober,
             s: ProfileSettings, slower_ok: bool) -> tuple[StepCostModel | None, list[str]]:
    model = cost_cache.model_from_cells(grid, cells, source)
    if model is None:
        return None, ["the cells do not cover the grid"]
    problems = model.monotone_problems(s.monotone_tolerance, s.floor_s)
    if problems:
        return None, problems
    probes = {shape: prober(*shape) for shape in _reprobe_shapes(grid, s.num_reprobe)}
    problems = _disagreements(model, probes, s.reprobe_tolerance, slower_ok, s.floor_s)
    return (None, problems) if problems else (model, [])


def startup_cost_model(prober: Prober, grid: CostGrid, key: str, reprofile: bool = False,
                       settings: ProfileSettings = ProfileSettings()) -> CostTable:
    """The checked table for `grid` (module docstring); measures only what it must."""
    t0, path = time.perf_counter(), str(cost_cache.cache_path(key))
    in_grid = {(b, c, w) for b in grid.batches for c in grid.contexts for w in grid.widths}
    cached = (
        {} if reprofile else {k: v for k, v in cost_cache.load_cells(key).items() if k in in_grid}
    )
    if cached and all(shape in cached for shape in essential_shapes(grid)):
        model, problems = _checked(grid, cached, f"cached {path}", prober, settings, slower_ok=True)
        if model is not None:
            return CostTable(model, "cached", path, seconds=time.perf_counter() - t0)
        log.warning(
            "step cost table in %s refused, re-measuring: %s", path, "; ".join(problems[:3])
        )
        cached = {}
    problems = []
    for attempt in range(2):
        t_attempt = time.perf_counter()
        fresh = _measure(prober, [x for x in essential_shapes(grid) if x not in cached])
        model, problems = _checked(grid, {**cached, **fresh}, "measured at start-up", prober,
                                   settings, slower_ok=False)
        if model is not None:
            saved = cost_cache.merge_save(key, fresh)
            return CostTable(model, "measured at start-up", str(saved) if saved else None,
                             num_measured=len(fresh), seconds=time.perf_counter() - t0)
        log.warning("step cost profile attempt %d failed its checks: %s", attempt + 1,
                    "; ".join(problems[:3]))
        took = time.perf_counter() - t_attempt
        if took > settings.retry_within_s:
            log.warning("step cost profile: not measuring again (the attempt took %.0f s, over "
                        "%.0f s: the machine is busy); the next start measures afresh", took,
                        settings.retry_within_s)
            break
        cached = {}  # the second attempt measures every essential cell afresh
    return CostTable(None, "refused", None, tuple(problems), seconds=time.perf_counter() - t0)


def model_prober(model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int, num_blocks: int,
                 reps: int = ProfileSettings.reps) -> Prober:
    return lambda b, c, w: measure_cell(model, kv_caches, block_size, num_blocks, b, c, w, reps)


def profile_step_costs(model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                       num_blocks: int, grid: CostGrid, reps: int = 2) -> StepCostModel:
    """Every cell of `grid` measured (``dynaspec tune`` and tests; start-up measures fewer)."""
    prober = model_prober(model, kv_caches, block_size, num_blocks, reps)
    cells = _measure(prober, [(b, c, w) for b in grid.batches for c in grid.contexts
                              for w in grid.widths])
    out = cost_cache.model_from_cells(grid, cells, "measured")
    assert out is not None  # every cell was measured, none estimated
    return out
