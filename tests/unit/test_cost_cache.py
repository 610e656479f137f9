"""The step-cost cache and the start-up table checks: merge by cell, concurrent writers, a
poisoned table refused, a busy-start table replaced on an idle start. A scripted prober stands
in for the model, so nothing here depends on this machine's timing."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from dynaspec.spec_decode.policy import cost_cache
from dynaspec.spec_decode.policy.cost_cache import Cell
from dynaspec.spec_decode.policy.cost_model import CACHE_ENV, CostGrid
from dynaspec.spec_decode.policy.cost_profile import (
    ProfileSettings,
    essential_shapes,
    startup_cost_model,
)

GRID = CostGrid((1, 4, 16, 64), (128, 1024), (1, 2, 3, 5))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))


def idle(b: int, c: int, w: int) -> float:
    """A plausible machine: cost grows with batch, context and width."""
    return 1e-3 * (10 + b * w * 0.5 + c / 256 * (1 + 0.1 * b))


class Prober:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, b: int, c: int, w: int) -> Cell:
        self.calls.append((b, c, w))
        return Cell(self.fn(b, c, w), 1.0, 0.5, 0.01, 2)


def _seed(key: str, fn) -> None:
    cost_cache.merge_save(key, {s: Cell(fn(*s)) for s in essential_shapes(GRID)})


def test_merge_by_cell_keeps_other_runs_cells():
    cost_cache.merge_save("k", {(1, 128, w): Cell(0.01 * w) for w in (1, 2, 5, 9)})
    cost_cache.merge_save("k", {(1, 128, w): Cell(0.02 * w) for w in (1, 2, 4)})
    cells = cost_cache.load_cells("k")
    assert sorted(w for _, _, w in cells) == [1, 2, 4, 5, 9]
    assert cells[(1, 128, 5)].seconds == pytest.approx(0.05)  # only the first run had width 5
    assert cells[(1, 128, 2)].seconds == pytest.approx(0.04)  # the newer measurement wins
    assert cost_cache.load_cells("other") == {}


def test_a_corrupt_or_old_format_file_is_ignored_then_replaced():
    path = cost_cache.cache_path("k")
    path.parent.mkdir(parents=True)
    for text in ("{not json", json.dumps({"batches": [1], "seconds": [[[1.0]]]})):
        path.write_text(text)
        assert cost_cache.load_cells("k") == {}
    cost_cache.merge_save("k", {(1, 1, 1): Cell(0.1)})
    assert list(cost_cache.load_cells("k")) == [(1, 1, 1)]


def _writer(args) -> None:
    cache, who = args
    import os
    os.environ[CACHE_ENV] = cache
    for i in range(15):
        cost_cache.merge_save("shared", {(who, 128, i + 1): Cell(0.001 * (i + 1))})


def test_concurrent_writers_lose_no_cell(tmp_path):
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), who) for who in (1, 2, 3, 4)])
    cells = cost_cache.load_cells("shared")  # the file parses ...
    assert len(cells) == 4 * 15  # ... and holds every writer's every cell
    assert not list(tmp_path.glob("cost/*.tmp"))  # no temp file left behind


def test_estimate_fills_the_grid_from_the_essential_cells():
    known = {s: idle(*s) for s in essential_shapes(GRID)}
    assert len(known) < len(GRID.batches) * len(GRID.contexts) * len(GRID.widths)
    est = cost_cache.estimate(GRID, known)
    assert est[0][0][0] == pytest.approx(idle(1, 128, 1))  # measured cells as they are
    # batch 64 extrapolates linearly in the batch through batches 1 and 16
    b1, b16 = idle(1, 128, 3), idle(16, 128, 3)
    assert est[3][0][2] == pytest.approx(b1 + (b16 - b1) * 63 / 15)
    assert all(v is not None and v > 0 for r in est for c in r for v in c)


def test_first_start_measures_only_the_essential_cells_and_saves_them():
    prober = Prober(idle)
    table = startup_cost_model(prober, GRID, "k")
    ess = essential_shapes(GRID)
    assert table.model is not None and table.source == "measured at start-up"
    assert table.num_measured == len(ess) == 12
    assert len(prober.calls) == len(ess) + ProfileSettings.num_reprobe  # + the re-probe
    assert set(cost_cache.load_cells("k")) == set(ess)
    assert table.cache_file == str(cost_cache.cache_path("k"))


def test_a_clean_cached_table_is_used_after_a_short_reprobe():
    _seed("k", idle)
    prober = Prober(idle)
    table = startup_cost_model(prober, GRID, "k")
    assert table.source == "cached" and len(prober.calls) == ProfileSettings.num_reprobe


def test_a_table_measured_under_load_is_replaced_on_an_idle_start():
    _seed("k", lambda b, c, w: 3 * idle(b, c, w))  # a busy first start: every cell 3x slow
    prober = Prober(idle)
    table = startup_cost_model(prober, GRID, "k")
    assert table.source == "measured at start-up"
    assert table.model.cost(1, 128, 5) == pytest.approx(idle(1, 128, 5))
    assert cost_cache.load_cells("k")[(1, 128, 5)].seconds == pytest.approx(idle(1, 128, 5))


def test_a_cached_table_is_kept_when_the_machine_is_busier_now():
    _seed("k", idle)
    table = startup_cost_model(Prober(lambda b, c, w: 2 * idle(b, c, w)), GRID, "k")
    assert table.source == "cached"
    assert table.model.cost(1, 128, 5) == pytest.approx(idle(1, 128, 5))


def test_a_non_monotone_cached_table_is_refused_and_remeasured():
    poisoned = lambda b, c, w: idle(b, c, w) * (20 if (b, w) == (16, 1) else 1)  # noqa: E731
    _seed("k", poisoned)
    table = startup_cost_model(Prober(idle), GRID, "k")
    assert table.source == "measured at start-up"
    assert cost_cache.load_cells("k")[(16, 128, 1)].seconds == pytest.approx(idle(16, 128, 1))


def test_a_table_that_keeps_failing_is_refused_and_never_saved():
    n = [0]

    def noisy(b, c, w):  # every call 4x off the previous one: no re-probe agrees
        n[0] += 1
        return idle(b, c, w) * (4 if n[0] % 2 else 1)

    table = startup_cost_model(Prober(noisy), GRID, "k")
    assert table.model is None and table.source == "refused" and table.problems
    assert not cost_cache.cache_path("k").exists()


def test_reprofile_ignores_the_cache():
    _seed("k", idle)
    prober = Prober(idle)
    table = startup_cost_model(prober, GRID, "k", reprofile=True)
    assert table.source == "measured at start-up" and table.num_measured == 12


def test_schedule_explain_shows_the_cached_width_curve():
    import io

    from dynaspec.cli.main import build_parser
    from dynaspec.cli.schedule_cmd import explain

    key = cost_cache.cache_key(model="curve-test")
    cells = {
        (1, 128, w): cost_cache.Cell(seconds=ms / 1e3) for w, ms in ((1, 4.0), (5, 6.0), (9, 8.0))
    }
    assert cost_cache.merge_save(key, cells) is not None
    args = build_parser().parse_args(
        ["schedule", "explain", "--speculator", "ngram", "--num-spec-tokens", "8"]
    )
    out = io.StringIO()
    assert explain(args, out, io.StringIO()) == 0
    line = next(x for x in out.getvalue().splitlines() if key[:12] in x)
    assert "batch 1 ctx 128: w1 4.00 ms (1.00x), w5 6.00 ms (1.50x), w9 8.00 ms (2.00x)" in line


def test_a_slow_failed_attempt_is_not_measured_again():
    """A busy machine: the first attempt failed and took longer than retry_within_s, so the
    start falls back at once instead of measuring every essential cell a second time."""
    def run(settings):
        n = [0]

        def noisy(b, c, w):  # every call 4x off the previous one: no re-probe agrees
            n[0] += 1
            return idle(b, c, w) * (4 if n[0] % 2 else 1)

        prober = Prober(noisy)
        table = startup_cost_model(prober, GRID, "k", settings=settings)
        assert table.model is None and table.source == "refused"
        return len(prober.calls)

    once, twice = run(ProfileSettings(retry_within_s=0.0)), run(ProfileSettings())
    ess = len(essential_shapes(GRID))
    assert ess <= once < 2 * ess <= twice
