"""Statistics for paired A/B benchmarks (DESIGN §8): the paired ratio B/A with a t interval.

Why log ratios: throughput ratios compose multiplicatively and machine drift (another job, thermal
state) scales both arms of a pair alike, so log(b_i / a_i) cancels it pair by pair. The mean of
the log ratios back-transformed is the geometric mean of the per-pair ratios; a t interval on the
logs, back-transformed, is asymmetric around it as a ratio's interval should be.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np
from scipy import stats as _st


@dataclass(frozen=True)
class RatioEstimate:
    ratio: float  # geometric mean of b_i / a_i
    lo: float | None  # lower end of the confidence interval; None with fewer than 2 pairs
    hi: float | None
    n: int
    confidence: float
    log_sd: float | None  # sample sd of the log ratios

    @property
    def ci(self) -> tuple[float | None, float | None]:
        return self.lo, self.hi

    def to_dict(self) -> dict:
        return asdict(self)

    def fmt(self) -> str:
        if self.lo is None:
            return f"{self.ratio:.3f}x (n={self.n}, no CI)"
        pct = round(self.confidence * 100)
        return f"{self.ratio:.3f}x [{self.lo:.3f}, {self.hi:.3f}] ({pct}% CI, n={self.n})"


def paired_ratio(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> RatioEstimate:
    """Ratio B/A over pairs (a_i, b_i) of positive values (throughputs), with a t interval.

    The interval is exp(mean ± t_{n-1, (1+c)/2} * sd / sqrt(n)) over d_i = log(b_i / a_i).
    """
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if not a:
        raise ValueError("need at least one pair")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(x > 0) and np.all(y > 0)):
        raise ValueError("paired ratio needs finite positive values")
    d = np.log(y / x)
    n, mean = len(d), float(d.mean())
    if n < 2:
        return RatioEstimate(math.exp(mean), None, None, n, confidence, None)
    sd = float(d.std(ddof=1))
    half = float(_st.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return RatioEstimate(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n, confidence, sd)


def percentile(values: Iterable[float], q: float) -> float | None:
    """q-th percentile (0..100, linear interpolation); None for no values."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(v), q))


def latency_summary(values: Iterable[float]) -> dict:
    """p50 / p90 / p99 / mean / n of latencies in seconds (None where there are none)."""
    v = [float(x) for x in values if x is not None]
    return {"p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99),
            "mean": float(np.mean(v)) if v else None, "n": len(v)}


def run_order(pairs: int, arms: Sequence[str] = ("a", "b"), scheme: str = "alternate") -> list[tuple[int, str]]:
    """The (pair index, arm) run order.

    ``alternate``: A B A B ... (every pair in the same order; DESIGN §8).
    ``abba``: A B, B A, A B, ...: a linear drift over the session then biases neither arm.
    """
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    if scheme not in ("alternate", "abba"):
        raise ValueError(f"unknown order scheme {scheme!r}: choose alternate or abba")
    order = []
    for i in range(pairs):
        seq = list(arms) if scheme == "alternate" or i % 2 == 0 else list(reversed(arms))
        order.extend((i, arm) for arm in seq)
    return order
