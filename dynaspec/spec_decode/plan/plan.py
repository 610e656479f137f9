"""The speculation plan (docs/design.md §2): resolved once at start-up, read everywhere.

Scheduler (KV lookahead = ``max_k``, the step's planned width), runner (padding to that width),
metrics (per-position vectors of length ``max_k``), the execution plan (``widths``: the compile
grid) and the server card all read one ``SpecPlan``; none of them reads the raw configured K, so
they cannot disagree about the width
(the vLLM bug class where CUDA-graph sizes are derived from the configured K, not the K that runs).

Clamping: every entry becomes ``min(K, ceiling)`` where the ceiling is ``--num-spec-tokens``
(when > 0; with 0 a schedule sets its own maximum) and the drafter's limit ``drafter_max_k``.

Classification after clamping:
- ``off``: ``--speculator none``. A schedule or ``--num-spec-tokens`` given with it is an error
  naming the conflict: a user who wrote a schedule expects speculation, and silently running
  without it would hide the mistake until a benchmark shows no gain.
- ``always_zero``: every entry is 0; the drafter is not loaded and the engine runs the
  no-speculation path.
- ``constant``: every entry is the same k > 0; ``max_k`` becomes k and the width is ``1+k``
  everywhere, even when the raw table was non-uniform (``--num-spec-tokens 3`` with
  ``[[1,8,5],[9,16,4]]`` is constant(3)).
- ``variable``: widths differ by bucket.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

from dynaspec.config import SpecConfig
from dynaspec.spec_decode.plan.k_schedule import ParsedSchedule, ScheduleError, parse_schedule

__all__ = ["ScheduleError", "SpecPlan", "build_spec_plan", "plan_for_policy", "plan_from_config"]

KINDS = ("off", "always_zero", "constant", "variable")


class Row(NamedTuple):
    """One entry of the K table: K for batches in [batch_lo, batch_hi) and contexts in
    [ctx_lo, ctx_hi); None = open-ended. A tuple, so it reads and writes as a JSON list."""

    batch_lo: int
    batch_hi: int | None
    ctx_lo: int
    ctx_hi: int | None
    k: int


@dataclass(frozen=True)
class SpecPlan:
    kind: str
    max_k: int
    widths: tuple[int, ...]
    table: tuple[Row, ...]
    clamped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # informational: open-ended ranges, tuned-table measurements
    # Lookup index derived from `table` (rows are ordered by batch range, then ctx range).
    _batch_los: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _ctx_los: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown plan kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not self.table:
            raise ValueError("a SpecPlan needs at least one table row")
        object.__setattr__(self, "table", tuple(Row(*r) for r in self.table))
        batch_los = tuple(sorted({r.batch_lo for r in self.table}))
        ctx_los = tuple(sorted({r.ctx_lo for r in self.table}))
        # k_for indexes the table as row-major (batch, ctx), so the order is part of the contract.
        if ([(r.batch_lo, r.ctx_lo) for r in self.table]
                != [(b, c) for b in batch_los for c in ctx_los]):
            raise ValueError("SpecPlan table must be a rectangular grid ordered by batch, then ctx")
        ks = {r.k for r in self.table}
        if self.max_k != max(ks) or (self.kind != "variable" and len(ks) != 1):
            raise ValueError(
                f"SpecPlan {self.kind} max_k {self.max_k} disagrees with its table K values "
                f"{sorted(ks)}"
            )
        object.__setattr__(self, "_batch_los", batch_los)
        object.__setattr__(self, "_ctx_los", ctx_los)

    # Factories for code (and tests) that need a plan without a schedule.
    @staticmethod
    def off() -> SpecPlan:
        return SpecPlan("off", 0, (1,), (Row(1, None, 1, None, 0),))

    @staticmethod
    def constant(k: int) -> SpecPlan:
        return build_spec_plan("ngram", k, None)

    @property
    def speculating(self) -> bool:
        """True when a drafter is loaded (and drafter KV reserved)."""
        return self.kind in ("constant", "variable")

    @property
    def uniform_width(self) -> int | None:
        """Verify width every decode step has: 1+k for constant, 1 without drafts, None if
        variable."""
        if self.kind == "variable":
            return None
        return 1 + self.max_k

    @property
    def max_width(self) -> int:
        return 1 + self.max_k

    @property
    def policy_widths(self) -> tuple[int, ...]:
        """The widths a K policy may choose: the plan's and plain decode (K=0). The execution
        plan's grid, the metrics and the buffers are sized for them."""
        return tuple(sorted({1, *self.widths}))

    def k_for(self, num_reqs: int, ctx_len: int) -> int:
        """The table's K for a step; values below 1 are looked up as 1, values above the last
        range use the last (open-ended) range."""
        bi = bisect.bisect_right(self._batch_los, max(1, num_reqs)) - 1
        ci = bisect.bisect_right(self._ctx_los, max(1, ctx_len)) - 1
        return self.table[bi * len(self._ctx_los) + ci].k

    def summary(self) -> str:
        """One line for logs: ``variable (max_k 4, widths 1/3/5)``."""
        head = f"constant({self.max_k})" if self.kind == "constant" else self.kind
        return f"{head} (max_k {self.max_k}, widths {'/'.join(map(str, self.widths))})"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "max_k": self.max_k,
            "widths": list(self.widths),
            "uniform_width": self.uniform_width,
            "speculating": self.speculating,
            "table": [list(r) for r in self.table],
            "clamped": list(self.clamped),
            "notes": list(self.notes),
        }


def _check_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _ceiling(num_spec_tokens: int, drafter_max_k: int | None) -> tuple[int | None, str]:
    """The runtime maximum every entry is clamped to, and its source for the notes."""
    limits = []
    if num_spec_tokens > 0:
        limits.append((num_spec_tokens, f"--num-spec-tokens {num_spec_tokens}"))
    if drafter_max_k is not None:
        limits.append((drafter_max_k, f"drafter limit {drafter_max_k}"))
    if not limits:
        return None, ""
    return min(limits)


def _off_plan(speculator: str, num_spec_tokens: int, k_schedule: object) -> SpecPlan:
    if k_schedule is not None:
        raise ScheduleError(
            f"--k-schedule is set but --speculator is {speculator!r}: a schedule needs a drafter "
            "(choose --speculator ngram, draft or suffix, or drop --k-schedule)"
        )
    if num_spec_tokens > 0:
        raise ScheduleError(
            f"--num-spec-tokens {num_spec_tokens} is set but --speculator is {speculator!r}: "
            "choose a speculator or drop --num-spec-tokens"
        )
    return SpecPlan.off()


def build_spec_plan(
    speculator: str,
    num_spec_tokens: int,
    k_schedule: str | int | list | dict | None,
    drafter_max_k: int | None = None,
) -> SpecPlan:
    """Parse, validate, clamp and classify. Raises ScheduleError for a schedule that cannot run."""
    _check_int("num_spec_tokens", num_spec_tokens)
    _check_int("drafter_max_k", drafter_max_k, allow_none=True)
    if speculator == "none":
        return _off_plan(speculator, num_spec_tokens, k_schedule)
    parsed = (
        parse_schedule(k_schedule)
        if k_schedule is not None
        else ParsedSchedule.constant(num_spec_tokens)
    )
    ceiling, why = _ceiling(num_spec_tokens, drafter_max_k)
    table, clamped = _clamp(parsed, ceiling, why)
    ks = {row.k for row in table}
    notes = list(parsed.notes)
    widths: tuple[int, ...]
    if ks == {0}:
        kind, max_k, widths = "always_zero", 0, (1,)
        notes.append("every entry resolves to K=0: drafter not loaded, no-speculation path")
    elif len(ks) == 1:
        (k,) = ks
        kind, max_k, widths = "constant", k, (1 + k,)
        if len({k for row in parsed.ks for k in row}) > 1:
            clamped.append(
                f"every entry resolves to K={k}: plan is constant({k}), verify width {1 + k} "
                f"everywhere"
            )
    else:
        kind, max_k, widths = "variable", max(ks), tuple(sorted(1 + k for k in ks))
    return SpecPlan(kind, max_k, widths, table, tuple(clamped), tuple(notes))


def _clamp(
    parsed: ParsedSchedule, ceiling: int | None, why: str
) -> tuple[tuple[Row, ...], list[str]]:
    rows: list[Row] = []
    lowered: dict[int, tuple[int, int]] = {}  # entry index -> (raw K, clamped K)
    for bi, (b_lo, b_hi) in enumerate(parsed.batch_ranges):
        for ci, (c_lo, c_hi) in enumerate(parsed.ctx_ranges):
            raw = parsed.ks[bi][ci]
            k = raw if ceiling is None else min(raw, ceiling)
            if k != raw:
                lowered[parsed.sources[bi][ci]] = (raw, k)
            rows.append(Row(b_lo, b_hi, c_lo, c_hi, k))
    notes = [
        f"{parsed.describe_entry(i)}: K {raw} -> {k} ({why})"
        for i, (raw, k) in sorted(lowered.items())
    ]
    return tuple(rows), notes


def plan_for_policy(plan: SpecPlan, policy: str | None) -> SpecPlan:
    """The plan as the running policy executes it. The goodput policy picks any K from 0 to the
    table's K on every step (the table is its ceiling), so every width from 1 to 1 + the largest
    K can run: a constant(k) table under goodput is classified ``variable`` with widths 1..1+k,
    and the scheduler, execution grid, metrics and ``schedule explain`` all read that, not the
    table's constant label. (Restricting it to {1, 1+k} made it choose between no drafts and
    all k: measured with suffix K=8 on agentic prompts, K=0 on 86% of steps, where K=2-4 pays.)"""
    if policy != "goodput" or not plan.speculating:
        return plan
    widths = tuple(range(1, plan.max_width + 1))
    if widths == tuple(plan.widths):
        return plan
    note = (
        f"K policy goodput: any K from 0 to the table's K may run on a step (the table is "
        f"each bucket's ceiling), so the plan is variable (widths {'/'.join(map(str, widths))})"
    )
    return SpecPlan("variable", plan.max_k, widths, plan.table, plan.clamped, (*plan.notes, note))


def plan_from_config(spec_config: SpecConfig, drafter_max_k: int | None = None) -> SpecPlan:
    """Build the plan from a ``dynaspec.config.SpecConfig``."""
    return build_spec_plan(
        spec_config.speculator, spec_config.num_spec_tokens, spec_config.k_schedule, drafter_max_k
    )
