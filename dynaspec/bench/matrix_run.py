"""Running the support matrix (bench/matrix.py has its axes and rules): the plain arm for the
whole matrix, then one drafter and its oracle at a time over every concurrency and workload, so
at most three engines are loaded. Each cell is a `bench compare` run of its arms (bench/compare.py:
the same engine arms, alternating passes, identity checks) with pairs added by the stopping rule.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from dynaspec.bench.compare import (
    Arm,
    EngineArm,
    IdentityViolation,
    RunRecord,
    make_params,
    oracle_arm,
    recording_of,
    run_pairs,
)
from dynaspec.bench.compare_report import gain_capture, same_outputs
from dynaspec.bench.matrix import (
    MATRIX_WORKLOADS,
    CellResult,
    MatrixSettings,
    enough_pairs,
    verdict,
)
from dynaspec.bench.stats import RatioEstimate, paired_ratio
from dynaspec.bench.workloads import WORKLOADS, WorkItem, WorkloadUnavailable, load_workload
from dynaspec.extras import MissingExtraError
from dynaspec.sampling_params import SamplingParams

BuildArm = Callable[[str, str], Arm]  # (label, engine flag string) -> arm
LoadItems = Callable[[str, object, int, int], list[WorkItem]]  # (workload, tokenizer, n, seed)


def _engine_kwargs(label: str, flags: str) -> dict:
    from dynaspec.engine_flags import parse_engine_args
    try:
        return parse_engine_args(shlex.split(flags))
    except SystemExit:  # argparse already printed what is wrong with the flags
        raise ValueError(f"{label}: not valid engine flags: {flags!r}") from None


def build_engine_arm(label: str, flags: str) -> Arm:
    """An engine arm from a flag string, prefix caching off (as in bench compare)."""
    return EngineArm(flags, {**_engine_kwargs(label, flags), "enable_prefix_caching": False})


def oracle_of(arm: Arm, recording: dict) -> Arm:
    """The replay oracle with the drafter arm's flags and K (bench/compare.py)."""
    if not isinstance(arm, EngineArm):
        raise ValueError(f"arm {arm.label!r} is not an engine arm: no oracle can stand in for it")
    return oracle_arm(arm, recording, f"oracle of {arm.label}")


@dataclass
class _Workload:
    items: list[WorkItem]
    params: list[SamplingParams]
    greedy: bool


class MatrixRun:
    """Runs the cells of `settings` in memory-saving order and returns them in table order.
    `build`, `load` and `oracle` make the arms, the prompts and a drafter's oracle arm."""

    def __init__(self, settings: MatrixSettings, build: BuildArm = build_engine_arm,
                 load: LoadItems = load_workload,
                 oracle: Callable[[Arm, dict], Arm] = oracle_of,
                 say: Callable[[str], None] = print,
                 on_cell: Callable[[CellResult], None] = lambda cell: None) -> None:
        """`on_cell`: called with each cell as it finishes (a part's JSON is written as it
        goes, so a run cut short keeps the cells it measured)."""
        self.s, self.build, self.load, self.make_oracle = settings, build, load, oracle
        self.say, self.on_cell = say, on_cell
        self.plain: Arm | None = None
        self.workloads: dict[str, _Workload | str] = {}  # name -> its items, or why n/a
        # Every workload's plain outputs, keyed by prompt: one oracle per drafter serves all.
        self.recording: dict = {"requests": []}

    def run(self) -> list[CellResult]:
        s = self.s
        if any(w in WORKLOADS for w in s.workloads):
            self.plain = self.build("plain", s.engine_flags)
        for name in s.workloads:
            self.workloads[name] = self._workload(name)
        cells: dict[tuple[int, str, str], CellResult] = {}
        for drafter in s.drafters:
            for cell in self._drafter_cells(drafter):
                cells[(cell.concurrency, cell.workload, cell.drafter)] = cell
                self.on_cell(cell)
        return [cells[(c, w, d)] for c in s.concurrencies for w in s.workloads
                for d in s.drafters]

    def _workload(self, name: str) -> _Workload | str:
        if name not in WORKLOADS or self.plain is None:  # plain is built where one exists
            return f"no {name} workload yet (bench/workloads.py)"
        s, temperature = self.s, MATRIX_WORKLOADS[name]
        try:
            items = self.load(name, getattr(self.plain, "tokenizer", None),
                              max(s.num_prompts, *s.concurrencies), s.seed)
        except WorkloadUnavailable as exc:
            return str(exc)
        w = _Workload(items, make_params(items, s.max_tokens, temperature, s.seed),
                      temperature == 0.0)
        if s.oracle:
            self.say(f"recording plain outputs of {name} for the oracle")
            rec = self.plain.run(w.items, w.params, s.concurrencies[0], f"plain-record-{name}")
            _check(rec, "plain recording pass")
            self.recording["requests"] += recording_of(w.items, rec)["requests"]
        return w

    def _drafter_cells(self, drafter: str) -> list[CellResult]:
        s = self.s
        grid = [(c, w) for c in s.concurrencies for w in s.workloads]
        arm, why = self._drafter_arm(drafter)
        if arm is None:  # a missing workload is the first reason, the drafter's the next
            return [CellResult(c, w, drafter, "n/a", wl if isinstance(wl, str) else why)
                    for c, w in grid for wl in (self.workloads[w],)]
        oracle: Arm | str | None = None
        if s.oracle:
            try:
                oracle = self.make_oracle(arm, self.recording)
            except (ValueError, FileNotFoundError) as exc:
                oracle = f"no oracle: {exc}"
        out = []
        for c, w in grid:
            wl = self.workloads[w]
            out.append(CellResult(c, w, drafter, "n/a", wl) if isinstance(wl, str)
                       else self._cell(c, w, drafter, arm, wl, oracle))
        return out

    def _drafter_arm(self, drafter: str) -> tuple[Arm | None, str]:
        """The drafter's arm, or None and why not ("" when no workload can run anyway)."""
        if all(isinstance(w, str) for w in self.workloads.values()):
            return None, ""
        flags = f"{self.s.engine_flags} {self.s.drafter_flags[drafter]}".strip()
        try:
            if _engine_kwargs(drafter, flags)["speculator"] == "none":
                return None, "default flags do not speculate (--speculator none)"
            self.say(f"loading drafter {drafter}: {flags}")
            return self.build(drafter, flags), ""
        except (ValueError, FileNotFoundError, MissingExtraError) as exc:
            return None, f"cannot build: {exc}"

    def _cell(self, c: int, workload: str, drafter: str, arm: Arm, wl: _Workload,
              oracle: Arm | str | None) -> CellResult:
        s = self.s
        assert self.plain is not None
        arms: dict[str, Arm] = {"plain": self.plain, "drafter": arm}
        if oracle is not None and not isinstance(oracle, str):
            arms["oracle"] = oracle
        self.say(f"cell c={c} {workload} {drafter}")
        # At least as many prompts as the concurrency: fewer never fill the batch it names.
        n = max(s.num_prompts, c)
        wl = _Workload(wl.items[:n], wl.params[:n], wl.greedy)
        try:
            self._warm_up(arms, wl, c)
            recs = run_pairs(arms, wl.items, wl.params, c, s.min_pairs, on_record=self._said)
            est = _ratio(recs, "drafter")
            while not enough_pairs(est, s.min_pairs, s.max_pairs, s.half_width):
                for r in run_pairs(arms, wl.items, wl.params, c, 1, on_record=self._said):
                    r.pair = est.n  # numbered on from the pairs before
                    recs.append(r)
                est = _ratio(recs, "drafter")
        except IdentityViolation as exc:
            return CellResult(c, workload, drafter, "fail", f"metric identities: {exc}")
        by = {n: [r for r in recs if r.arm == n] for n in arms}
        same = _identical(by, "drafter", wl.greedy)
        ora = _ratio(recs, "oracle") if "oracle" in arms else None
        status, reason = verdict(est, same, _identical(by, "oracle", wl.greedy))
        if isinstance(oracle, str):
            reason = f"{reason}; {oracle}" if reason else oracle
        return CellResult(c, workload, drafter, status, reason, est, ora,
                          gain_capture(est.ratio, ora.ratio if ora else None), same)

    def _said(self, rec: RunRecord) -> None:
        """Each pass in the log, with its CPU per wall second: a cell whose interval is wide
        shows whether one pass ran beside another process (CPU/wall well under the others')."""
        busy = rec.cpu_s / rec.elapsed_s if rec.elapsed_s > 0 else 0.0
        self.say(f"  {rec.arm}: {rec.tokens} tokens in {rec.elapsed_s:.2f} s = "
                 f"{rec.tokens_per_s:.1f} tok/s, CPU/wall {busy:.2f}")

    def _warm_up(self, arms: Mapping[str, Arm], wl: _Workload, c: int) -> None:
        n = min(self.s.warmup, len(wl.items))
        if n < 1:
            return
        params = [replace(p, max_tokens=min(8, p.max_tokens)) for p in wl.params[:n]]
        for name, arm in arms.items():
            _check(arm.run(wl.items[:n], params, c, f"{name}-warm"), f"{name} warm-up")


def _check(rec: RunRecord, what: str) -> None:
    if rec.identity_violations:
        raise IdentityViolation(f"{what}: " + "; ".join(rec.identity_violations))


def _ratio(recs: Sequence[RunRecord], arm: str) -> RatioEstimate:
    base = [r.tokens_per_s for r in recs if r.arm == "plain"]
    return paired_ratio(base, [r.tokens_per_s for r in recs if r.arm == arm])


def _identical(by: Mapping[str, list[RunRecord]], arm: str,
               greedy: bool) -> tuple[int, int] | None:
    if not greedy or arm not in by:
        return None
    o = same_outputs(by[arm], by["plain"])
    return o["identical"], o["total"]

