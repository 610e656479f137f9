"""`bench decode --widths`: the widths take turns step by step, each ratio to width 1 is formed
round by round with its spread, and the JSON names the machine and build the numbers came from."""

from __future__ import annotations

import json
import subprocess

import pytest

from dynaspec import cpu_features, cpu_kernels
from dynaspec.bench.decode import interleaved_times, load_warnings, width_ratio
from dynaspec.bench.machine import LoadMeter, git_commit, machine_record
from dynaspec.cli.main import main


class FakeClock:
    """Each step advances time by its width's next duration; the clock reads it back."""

    def __init__(self, durations: dict[int, list[float]]) -> None:
        self.now = 0.0
        self.durations = {w: iter(d) for w, d in durations.items()}
        self.order: list[int] = []

    def __call__(self) -> float:
        return self.now

    def step(self, width: int):
        def run() -> None:
            self.order.append(width)
            self.now += next(self.durations[width])

        return run


def test_widths_take_turns_step_by_step_in_every_round():
    clock = FakeClock({w: [0.001] * 6 for w in (1, 5, 9)})
    interleaved_times({w: clock.step(w) for w in (1, 5, 9)}, rounds=2, steps=3, clock=clock)
    assert clock.order == [1, 5, 9] * 6


def test_a_width_sample_is_the_median_of_its_steps_in_that_round():
    # Round 1: width 1 takes 1, 9, 2 ms (median 2), width 5 takes 3, 3, 30 ms (median 3).
    clock = FakeClock({1: [1e-3, 9e-3, 2e-3, 4e-3, 4e-3, 4e-3],
                       5: [3e-3, 3e-3, 30e-3, 5e-3, 6e-3, 7e-3]})
    got = interleaved_times({w: clock.step(w) for w in (1, 5)}, rounds=2, steps=3, clock=clock)
    assert got[1] == pytest.approx([2.0, 4.0]) and got[5] == pytest.approx([3.0, 6.0])
    with pytest.raises(ValueError, match="rounds and steps must be >= 1"):
        interleaved_times({1: clock.step(1)}, rounds=0, steps=3, clock=clock)


def test_the_ratio_is_formed_round_by_round_from_that_rounds_width_1():
    # The machine slowed down across rounds: width 1 took 10, 20, 40 ms. Per round the ratios
    # are 1.2, 1.5, 1.1 (median 1.2); the ratio of the medians (30 / 20 = 1.5) would be wrong.
    r = width_ratio([12.0, 30.0, 44.0], [10.0, 20.0, 40.0])
    assert r.median == pytest.approx(1.2) and r.n == 3
    assert (r.q1, r.q3) == (pytest.approx(1.15), pytest.approx(1.35))
    assert r.geomean == pytest.approx((1.2 * 1.5 * 1.1) ** (1 / 3))
    assert r.ci_lo < r.geomean < r.ci_hi


def test_drift_that_scales_every_width_alike_leaves_no_spread():
    r = width_ratio([15.0, 30.0, 60.0, 18.0], [10.0, 20.0, 40.0, 12.0])
    assert r.median == r.q1 == r.q3 == pytest.approx(1.5)
    assert r.ci_lo == pytest.approx(1.5) and r.ci_hi == pytest.approx(1.5)
    one = width_ratio([15.0], [10.0])  # one round: a ratio, no interval
    assert one.median == pytest.approx(1.5) and one.ci_lo is None and "CI" not in one.fmt()


def test_the_machine_record_names_cpu_flags_kernel_paths_commit_and_torch():
    import torch

    rec = json.loads(json.dumps(machine_record()))  # JSON-ready as it is
    assert rec["cpu_flags"] == sorted(cpu_features.cpu_flags())
    assert rec["kernel_paths"] == cpu_kernels.selection().chosen
    assert set(rec["kernel_paths"]) == set(cpu_features.KERNELS)
    assert rec["cpu_model"] == (cpu_features.cpu_model_name() or rec["cpu_model"])
    assert rec["torch"] == torch.__version__ and rec["threads"] == torch.get_num_threads()
    assert "gpu" not in rec
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # the suite runs in a checkout
        assert rec["git"]["commit"] == head.stdout.strip()
        assert isinstance(rec["git"]["dirty"], bool)


def test_the_load_meter_counts_steal_and_others_work_but_not_its_own():
    # /proc/stat's (all, idle, steal) ticks of both CPUs, and this process's ticks, at the
    # start and at the read: 1,000 ticks passed, 500 idle, 20 stolen, 300 this process's own.
    ticks = iter([(10_000, 4_000, 100), (11_000, 4_500, 120)])
    own = iter([50.0, 350.0])
    load = LoadMeter(ticks=lambda: next(ticks), own=lambda: next(own)).read()
    assert load == {"steal_pct": 2.0, "others_busy_pct": 18.0}
    assert LoadMeter(ticks=lambda: None, own=lambda: 0.0).read() is None  # not Linux


def test_a_run_beside_others_work_is_flagged_and_an_idle_one_is_not():
    def row(width: int, busy: float, steal: float = 0.0) -> dict:
        return {"batch": 1, "context_len": 128, "width": width,
                "load": {"others_busy_pct": busy, "steal_pct": steal}}

    assert load_warnings([row(1, 1.0), row(9, 1.0)]) == []
    warned = load_warnings([row(1, 12.5), row(9, 12.5)])  # one line per shape, not per width
    assert len(warned) == 1 and "other processes ran 12.5%" in warned[0]
    assert len(load_warnings([row(1, 0.0, steal=3.0)])) == 1
    assert load_warnings([{**row(1, 0.0), "load": None}]) == []  # no /proc/stat: no claim


def test_outside_a_checkout_there_is_no_commit(tmp_path):
    assert git_commit(str(tmp_path)) is None


def _bench(model: str, *extra: str) -> list[str]:
    return ["bench", "decode", "--model", model, "--dtype", "float32", "--num-kv-blocks", "32",
            "--batch-sizes", "1", "--context-lens", "8", "--rounds", "2", "--steps", "1", *extra]


def test_bench_decode_widths_reports_ratios_with_spread_and_the_machine(tiny_llama_dir, capsys):
    assert main(_bench(tiny_llama_dir, "--widths", "3", "--json")) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = data["results"]
    assert [r["width"] for r in rows] == [1, 3]  # width 1 is always timed: ratios are to it
    assert all(len(r["samples_ms"]) == 2 for r in rows) and data["rounds"] == 2
    r3 = rows[1]["ratio"]
    assert r3["n"] == 2 and r3["q1"] <= r3["median"] <= r3["q3"]
    assert rows[0]["ratio"]["median"] == pytest.approx(1.0)
    assert data["machine"]["kernel_paths"] == cpu_kernels.selection().chosen
    assert data["machine"]["cpu_flags"] == sorted(cpu_features.cpu_flags())
    load = rows[0]["load"]  # the machine's load by others while the shape ran (Linux)
    assert load is None or 0 <= load["others_busy_pct"] <= 100 and load["steal_pct"] >= 0

    assert main(_bench(tiny_llama_dir, "--widths", "1,2")) == 0
    text = capsys.readouterr().out
    assert "| / width 1 | ratio IQR | ratio 95% CI |" in text and "kernel paths: build=" in text


@pytest.mark.parametrize("flags, message", [
    (["--widths", "1,x"], "--widths takes comma-separated integers"),
    (["--widths", "0,5"], "--widths takes widths >= 1"),
    (["--widths", "5", "--steps", "0"], "--rounds and --steps must be >= 1"),
])
def test_bad_widths_are_refused_before_the_model_loads(flags, message, capsys):
    assert main(_bench("/nonexistent/model", *flags)) == 2
    assert message in capsys.readouterr().err
