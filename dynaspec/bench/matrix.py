"""The support matrix (docs/design.md §8): concurrency x workload x drafter, each cell the
drafter paired against its own plain decode, so "never below plain" is a table, not an anecdote.

A cell runs as `bench compare` runs two arms (bench/compare.py: the same engine arms, the same
alternating passes over the same prompts and seeds, the same identity checks), plus the replay
oracle with the drafter's flags as a third arm of each pair for the gain capture. Pairs are added
until the 95% interval of plain-vs-drafter is within `half_width` of its point (at least
`min_pairs`, at most `max_pairs`). A cell passes at a point >= 0.98x with its lower bound >=
0.95x and, when greedy, the drafter's and the oracle's outputs identical to plain's.

This module holds the axes, the settings and the rules (pure, no torch: the CLI reads its
defaults); bench/matrix_run.py runs the cells, bench/matrix_report.py writes the Markdown.

Workloads and drafters that cannot run here (a workload not written yet, default flags that do
not speculate, a head with no checkpoint) are cells marked n/a with the reason, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dynaspec.bench.stats import RatioEstimate

CONCURRENCIES = (1, 4, 16, 64)
# Workload -> the temperature its cells sample at (creative writing is sampled, the rest greedy).
MATRIX_WORKLOADS = {"chat": 0.0, "code_edit": 0.0, "agentic": 0.0, "summarize": 0.0,
                    "json_extract": 0.0, "creative": 1.0}
# Drafter -> its flags on top of the common engine flags; "default" is what no flag gives.
DRAFTER_FLAGS = {"default": "", "ngram": "--speculator ngram --num-spec-tokens 4",
                 "suffix": "--speculator suffix --num-spec-tokens 8", "head": "--speculator eagle"}
PASS_POINT, PASS_LOWER = 0.98, 0.95


@dataclass(frozen=True)
class MatrixSettings:
    concurrencies: tuple[int, ...] = CONCURRENCIES
    workloads: tuple[str, ...] = tuple(MATRIX_WORKLOADS)
    drafters: tuple[str, ...] = tuple(DRAFTER_FLAGS)
    engine_flags: str = ""  # given to every arm (--model, --dtype, ...)
    drafter_flags: Mapping[str, str] = field(default_factory=lambda: dict(DRAFTER_FLAGS))
    num_prompts: int = 8
    max_tokens: int | None = None
    seed: int = 0
    min_pairs: int = 5
    max_pairs: int = 20
    half_width: float = 0.03  # stop once the CI is within this share of its point
    oracle: bool = True
    warmup: int = 1  # unmeasured short requests per arm and cell

    def __post_init__(self) -> None:
        if not 2 <= self.min_pairs <= self.max_pairs:
            raise ValueError(f"need 2 <= --min-pairs <= --max-pairs (an interval needs two "
                             f"pairs), got {self.min_pairs} and {self.max_pairs}")
        if any(c < 1 for c in self.concurrencies) or not self.concurrencies:
            raise ValueError(f"--concurrency takes values >= 1, got {self.concurrencies}")
        if not 0 < self.half_width < 1:
            raise ValueError(f"--half-width must be in (0, 1), got {self.half_width}")
        for name in self.workloads:
            if name not in MATRIX_WORKLOADS:
                raise ValueError(f"unknown matrix workload {name!r}: choose from "
                                 f"{', '.join(MATRIX_WORKLOADS)}")
        for name in self.drafters:
            if name not in self.drafter_flags:
                raise ValueError(f"unknown matrix drafter {name!r}: choose from "
                                 f"{', '.join(self.drafter_flags)}")

    def to_json(self) -> dict:
        return {**asdict(self), "drafter_flags": dict(self.drafter_flags)}

    @classmethod
    def from_json(cls, d: Mapping) -> MatrixSettings:
        axes = ("concurrencies", "workloads", "drafters")
        fields: dict[str, Any] = {k: tuple(v) if k in axes else v for k, v in d.items()}
        return cls(**fields)


@dataclass(frozen=True)
class CellResult:
    concurrency: int
    workload: str
    drafter: str
    status: str  # "pass", "fail" or "n/a"
    reason: str = ""  # why n/a, or why it failed
    ratio: RatioEstimate | None = None  # drafter / plain
    oracle: RatioEstimate | None = None  # oracle / plain
    gain_capture: float | None = None
    identical: tuple[int, int] | None = None  # (equal, compared) outputs; None when sampled

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "workload": self.workload,
                "drafter": self.drafter, "status": self.status, "reason": self.reason,
                "ratio": self.ratio.to_dict() if self.ratio else None,
                "oracle": self.oracle.to_dict() if self.oracle else None,
                "gain_capture": self.gain_capture, "identical": self.identical}

    @classmethod
    def from_json(cls, d: Mapping) -> CellResult:
        est = lambda x: None if x is None else RatioEstimate(**x)  # noqa: E731
        same = d.get("identical")
        return cls(d["concurrency"], d["workload"], d["drafter"], d["status"], d["reason"],
                   est(d["ratio"]), est(d["oracle"]), d["gain_capture"],
                   None if same is None else (same[0], same[1]))


# ---- the rules ------------------------------------------------------------------------------
def half_width(est: RatioEstimate) -> float | None:
    """The interval's wider side as a share of its point (the log interval is asymmetric)."""
    if est.lo is None or est.hi is None:
        return None
    return max(est.hi / est.ratio - 1.0, 1.0 - est.lo / est.ratio)


def enough_pairs(est: RatioEstimate, min_pairs: int, max_pairs: int, target: float) -> bool:
    """Stop adding pairs: at the cap, or from min_pairs on once the CI is within target."""
    if est.n >= max_pairs:
        return True
    hw = half_width(est)
    return est.n >= min_pairs and hw is not None and hw <= target


def verdict(est: RatioEstimate, identical: tuple[int, int] | None,
            oracle_identical: tuple[int, int] | None = None) -> tuple[str, str]:
    """(status, reason): pass at a point >= 0.98x with the lower bound >= 0.95x and greedy
    outputs identical to plain (identical None: sampled, not compared)."""
    for who, same in (("the drafter's", identical), ("the oracle's", oracle_identical)):
        if same is not None and same[0] != same[1]:
            return "fail", f"{who} greedy output differs from plain on {same[1] - same[0]} " \
                           f"of {same[1]} requests"
    if est.lo is None:
        return "fail", "one pair: no interval"
    if est.ratio < PASS_POINT or est.lo < PASS_LOWER:
        return "fail", f"below plain: {est.ratio:.3f}x, lower bound {est.lo:.3f}x (needs >= " \
                       f"{PASS_POINT}x and >= {PASS_LOWER}x)"
    return "pass", ""


def summary_counts(cells: Sequence[CellResult]) -> dict[str, int]:
    out = {"pass": 0, "fail": 0, "n/a": 0}
    for cell in cells:
        out[cell.status] += 1
    return out
