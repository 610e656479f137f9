"""Statistics for paired A/B benchmarks (docs/design.md §8): the paired ratio B/A with a t interval.

Why log ratios: throughput ratios compose multiplicatively and machine drift (another job, thermal
state) scales both arms of a pair alike, so log(b_i / a_i) cancels it pair by pair. The mean of
the log ratios back-transformed is the geometric mean of the per-pair ratios; a t interval on the
logs, back-transformed, is asymmetric around it as a ratio's interval should be.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np


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
    half = t_quantile((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
    return RatioEstimate(
        math.exp(mean), math.exp(mean - half), math.exp(mean + half), n, confidence, sd
    )


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom (what scipy's t.ppf returns).

    Computed here so the bench needs only numpy: bisection on the CDF, whose tail is
    0.5 * I_{df/(df+t^2)}(df/2, 1/2) (the regularized incomplete beta, below), to 1e-12.
    """
    if not 0 < p < 1:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if p == 0.5:
        return 0.0
    target = max(p, 1 - p)  # solve in the upper half, mirror for the lower
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < target else (lo, mid)
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    t = (lo + hi) / 2
    return t if p > 0.5 else -t


def _t_cdf(t: float, df: int) -> float:
    """P(T <= t) for t >= 0."""
    return 1.0 - 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point
        return 1.0 - _betainc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - math.log(a) - _log_beta(a, b)
    tiny, c, d = 1e-300, 1.0, 0.0
    f: float | None = None
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f = c * d if f is None else f * c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    assert f is not None  # the loop ran
    return math.exp(log_front) * (f - 1.0)


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


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


def run_order(
    pairs: int, arms: Sequence[str] = ("a", "b"), scheme: str = "alternate"
) -> list[tuple[int, str]]:
    """The (pair index, arm) run order.

    ``alternate``: A B A B ... (every pair in the same order; docs/design.md §8).
    ``abba``: A B, B A, A B, ...: a linear drift over the session then biases neither arm.
    """
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    if scheme not in ("alternate", "abba"):
        raise ValueError(f"unknown order scheme {scheme!r}: choose alternate or abba")
    order: list[tuple[int, str]] = []
    for i in range(pairs):
        seq = list(arms) if scheme == "alternate" or i % 2 == 0 else list(reversed(arms))
        order.extend((i, arm) for arm in seq)
    return order
