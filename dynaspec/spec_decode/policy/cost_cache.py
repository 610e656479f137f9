"""The on-disk cache of measured step costs: one file per key, merged cell by cell.

The key names everything that changes a step's seconds (CPU model, torch version, model,
dtype, quantization, attention kernel path, execution path, thread count, block size), so two
configurations never read each other's numbers. Inside a file the unit is the *cell*
(batch, context, width), not the grid: a run that profiled widths {1, 2, 5, 9} at batch 1 adds
those cells and keeps every other cell already there, so runs with different
``--num-spec-tokens`` or ``--max-num-seqs`` fill one table instead of replacing each other's.

Every cell records when and how it was measured (wall time, 1-minute load average, the spread
of its repeats), so a table measured under load can be recognised later.

Writers read, merge and replace under an exclusive lock (``fcntl.flock`` on a side file) and
replace the file atomically (a unique temp file in the same folder, then ``os.replace``): a
concurrent writer never loses another's cells and a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel, cache_dir, cpu_model

FORMAT_VERSION = 2
Shape = tuple[int, int, int]  # (batch, ctx, width)


@dataclass(frozen=True)
class Cell:
    """One measured step cost and how it was measured."""

    seconds: float  # best of the repeats
    measured_at: float = 0.0  # unix time
    loadavg: float = 0.0  # os.getloadavg()[0] just before measuring
    spread: float = 0.0  # (slowest - fastest) / fastest over the repeats
    reps: int = 0

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"a cell's seconds must be > 0, got {self.seconds}")


def cache_key(**parts: object) -> str:
    """Stable key from the machine and the settings a step's cost depends on."""
    import torch  # the torch version changes kernels, so it is part of the key

    fields = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        **{k: str(v) for k, v in parts.items()},
    }
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    return cache_dir() / "cost" / f"{key}.json"


def _parse(text: str) -> dict[Shape, Cell]:
    d = json.loads(text)
    if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION:
        raise ValueError("not a version-2 cost cache file")
    cells = {}
    for name, fields in d["cells"].items():
        b, c, w = (int(x) for x in name.split(","))
        cells[(b, c, w)] = Cell(**fields)
    return cells


def load_cells(key: str) -> dict[Shape, Cell]:
    """Every cell cached under this key; {} when none (or the file is unreadable: a corrupt or
    old-format file is ignored, never fatal, and replaced on the next save)."""
    try:
        return _parse(cache_path(key).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return {}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def merge_save(key: str, cells: dict[Shape, Cell]) -> Path | None:
    """Add `cells` to the cached file (a new cell replaces the same shape, others are kept).
    Returns the path, or None when the cache folder is not writable (the engine then profiles
    again next launch; it never fails to start over a cache)."""
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            merged = load_cells(key)
            merged.update(cells)
            body = {"version": FORMAT_VERSION,
                    "cells": {f"{b},{c},{w}": asdict(cell)
                              for (b, c, w), cell in sorted(merged.items())}}
            fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(body, f)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
    except OSError:
        return None
    return path


def estimate(grid: CostGrid, known: dict[Shape, float]) -> list[list[list[float | None]]]:
    """The grid's seconds: known cells as they are, the rest estimated from them.

    A missing cell takes its width's cost at the nearest known batch row of its own context,
    scaled linearly in the batch between the two known batches around it (a step's work grows
    with its rows), and failing that the batch-1 cost at the first context scaled by the
    context ratio seen at batch 1. None where nothing supports an estimate."""
    out: list[list[list[float | None]]] = []
    for b in grid.batches:
        out.append([[_estimate_cell(grid, known, b, c, w) for w in grid.widths]
                    for c in grid.contexts])
    return out


def _estimate_cell(
    grid: CostGrid, known: dict[Shape, float], b: int, c: int, w: int
) -> float | None:
    if (b, c, w) in known:
        return known[(b, c, w)]
    row = _along_batch(known, b, c, w)
    if row is not None:
        return row
    c0 = grid.contexts[0]
    base, at1, at1c0 = _along_batch(known, b, c0, w), known.get((1, c, w)), known.get((1, c0, w))
    if base is not None and at1 is not None and at1c0:
        return base * at1 / at1c0
    same = [s for (kb, kc, kw), s in known.items() if kc == c and kw == w]
    return max(same) if same else None  # one batch known: flat (learned online from there)


def _along_batch(known: dict[Shape, float], b: int, c: int, w: int) -> float | None:
    """Linear in the batch through the two known batches of (c, w) around it (the outermost
    pair outside them), never below the smaller of that pair."""
    pts = sorted((kb, s) for (kb, kc, kw), s in known.items() if kc == c and kw == w)
    if len(pts) < 2:  # one point gives no slope: the caller scales another context's instead
        return None
    lo, hi = pts[0], pts[1]
    for p, q in zip(pts, pts[1:]):
        lo, hi = p, q
        if b <= q[0]:
            break
    slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
    return max(min(lo[1], hi[1]), lo[1] + slope * (b - lo[0]))


def model_from_cells(grid: CostGrid, cells: dict[Shape, Cell], source: str) -> StepCostModel | None:
    """A cost model over `grid` from measured cells (estimating the rest); None if a cell
    cannot be estimated from them."""
    seconds = estimate(grid, {shape: cell.seconds for shape, cell in cells.items()})
    if any(s is None for r in seconds for col in r for s in col):
        return None
    return StepCostModel(grid, seconds, source=source)  # type: ignore[arg-type]
