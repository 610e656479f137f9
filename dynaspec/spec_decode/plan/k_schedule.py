"""Parse and validate a K schedule (docs/design.md §2) into one normalised rectangular grid.

Accepted forms (JSON text, or a path to a JSON file holding the same):
- a constant ``K``: ``4``;
- batch rows ``[[batch_lo, batch_hi, K], ...]``, keyed on the number of requests in the step;
- grid rows ``[[batch_lo, batch_hi, ctx_lo, ctx_hi, K], ...]``: every batch range has the same
  contiguous context ranges;
- the tuned-table object ``{"grid": [rows...], ...}`` that ``dynaspec tune`` writes; keys other
  than ``grid`` are the measurements behind it and do not change the plan.

Rules: every field is an integer (JSON ``true``/``false`` and ``4.0`` are not), ranges are
inclusive and start at 1, do not overlap and leave no gap (a gap is an error, never vLLM's
silent carry-forward), K >= 0, and the two row forms are not mixed. Rows may come in any order.

Open-ended last range: the last range of each axis covers everything above its ``lo``, whatever
``hi`` it states (a table measured up to batch 64 must still answer batch 65), so the effective
grid records ``None`` for it; ``null`` is accepted as that ``hi`` and nowhere else, so the table
``schedule explain --json`` prints can be fed back as a schedule. Entries are numbered from 0,
as in the JSON list, and every error names the entry (index and value) and the rule it broke.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# A speculation depth beyond this is a typo, not a drafter setting; rejecting it keeps a
# mistyped schedule from sizing buffers and KV lookahead for thousands of tokens.
MAX_SCHEDULE_K = 256

_BATCH_FIELDS = "[batch_lo, batch_hi, K]"
_GRID_FIELDS = "[batch_lo, batch_hi, ctx_lo, ctx_hi, K]"


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the entry (index and value) and the rule."""


Range = tuple[int, "int | None"]  # inclusive; hi None = open-ended


@dataclass(frozen=True)
class ParsedSchedule:
    """A validated schedule as a rectangular grid, before any clamping.

    ``ks[i][j]`` is the K for batch range ``batch_ranges[i]`` and context range
    ``ctx_ranges[j]``; ``sources[i][j]`` is the index of the entry that gave it (-1 for a
    constant) so clamping notes can name the user's entry.
    """

    form: str  # "constant" | "batch" | "grid" | "tuned"
    batch_ranges: tuple[Range, ...]
    ctx_ranges: tuple[Range, ...]
    ks: tuple[tuple[int, ...], ...]
    sources: tuple[tuple[int, ...], ...]
    entries: tuple  # the entries as written, for messages
    notes: tuple[str, ...] = ()

    @staticmethod
    def constant(k: int) -> ParsedSchedule:
        _check_k(k, "constant K", k)
        return ParsedSchedule("constant", ((1, None),), ((1, None),), ((k,),), ((-1,),), (k,))

    def describe_entry(self, index: int) -> str:
        if index < 0:
            return f"constant K {self.entries[0]}"
        label = "grid entry" if self.form == "tuned" else "entry"
        return f"{label} {index} {_fmt(self.entries[index])}"


def _fmt(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _fmt_range(r: Range) -> str:
    return f"{r[0]}-{'inf' if r[1] is None else r[1]}"


def _fmt_span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def load_schedule_json(spec: str) -> object:
    """Decode ``spec`` as JSON text; if it is not JSON, read it as the path of a JSON file."""
    text = spec.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if os.path.isfile(spec):
            return _load_file(spec)
        raise ScheduleError(
            f"k_schedule {spec!r} is neither valid JSON ({exc}) nor an existing file"
        ) from None


def _load_file(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"k_schedule file {path!r} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ScheduleError(f"cannot read k_schedule file {path!r}: {exc}") from None


def parse_schedule(spec: str | int | list | dict) -> ParsedSchedule:
    """Parse JSON text / a file path (or an already-decoded value) into a ParsedSchedule."""
    value = load_schedule_json(spec) if isinstance(spec, str) else spec
    return parse_schedule_value(value)


def parse_schedule_value(value: object) -> ParsedSchedule:
    if _is_int(value):
        return ParsedSchedule.constant(value)  # type: ignore[arg-type]
    if isinstance(value, dict):
        return _parse_tuned(value)
    if isinstance(value, list):
        return _parse_rows(value, "entry")
    raise ScheduleError(
        f"k_schedule {_fmt(value)}: expected an integer K, a list of rows {_BATCH_FIELDS} or "
        f"{_GRID_FIELDS}, or a tuned-table object with a \"grid\" key"
    )


def _parse_tuned(value: dict) -> ParsedSchedule:
    if "grid" not in value:
        raise ScheduleError(
            f'k_schedule object has keys {sorted(value)}: a tuned table needs a "grid" list of rows'
        )
    rows = value["grid"]
    if not isinstance(rows, list):
        raise ScheduleError(f"tuned table \"grid\" is {_fmt(rows)}: it must be a list of rows")
    parsed = _parse_rows(rows, "grid entry")
    extra = sorted(k for k in value if k != "grid")
    notes = parsed.notes
    if extra:
        notes += (f"tuned table: {', '.join(extra)} are measurements; the plan uses the grid",)
    return ParsedSchedule("tuned", parsed.batch_ranges, parsed.ctx_ranges, parsed.ks,
                          parsed.sources, parsed.entries, notes)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_k(k: object, where: str, entry: object) -> None:
    if not _is_int(k):
        raise ScheduleError(f"{where} {_fmt(entry)}: K must be an integer, got {_fmt(k)}")
    if k < 0:  # type: ignore[operator]
        raise ScheduleError(f"{where} {_fmt(entry)}: K must be >= 0, got {k}")
    if k > MAX_SCHEDULE_K:  # type: ignore[operator]
        raise ScheduleError(f"{where} {_fmt(entry)}: K must be <= {MAX_SCHEDULE_K}, got {k}")


def _check_entry(label: str, i: int, entry: object, width: int | None) -> None:
    """Shape and field rules for one row; ``width`` is the row form fixed by entry 0."""
    where = f"{label} {i}"
    if not isinstance(entry, list):
        raise ScheduleError(
            f"{where} {_fmt(entry)}: a row must be a list {_BATCH_FIELDS} or {_GRID_FIELDS}"
        )
    if len(entry) not in (3, 5):
        raise ScheduleError(
            f"{where} {_fmt(entry)}: has {len(entry)} fields; a batch row has 3 {_BATCH_FIELDS}, "
            f"a grid row 5 {_GRID_FIELDS}"
        )
    if width is not None and len(entry) != width:
        raise ScheduleError(
            f"{where} {_fmt(entry)}: mixes row forms: {label} 0 has {width} fields and this one "
            f"{len(entry)}; use batch rows or grid rows, not both"
        )
    names = ("batch", "ctx")
    for axis in range(len(entry) // 2):
        lo, hi = entry[2 * axis], entry[2 * axis + 1]
        name = names[axis]
        if not _is_int(lo):
            raise ScheduleError(
                f"{where} {_fmt(entry)}: {name}_lo must be an integer, got {_fmt(lo)}"
            )
        if hi is not None and not _is_int(hi):
            raise ScheduleError(
                f"{where} {_fmt(entry)}: {name}_hi must be an integer (or null when open-ended), "
                f"got {_fmt(hi)}"
            )
        if lo < 1:
            raise ScheduleError(f"{where} {_fmt(entry)}: {name}_lo must be >= 1, got {lo}")
        if hi is not None and hi < lo:
            raise ScheduleError(f"{where} {_fmt(entry)}: {name}_hi {hi} is below {name}_lo {lo}")
    _check_k(entry[-1], where, entry)


def _parse_rows(rows: list, label: str) -> ParsedSchedule:
    if not rows:
        where = "tuned table \"grid\"" if label != "entry" else "k_schedule"
        raise ScheduleError(f"{where} is an empty list: give at least one row")
    first = rows[0]
    # Entry 0 fixes the row form; if it is malformed, its own check below reports it first.
    width = len(first) if isinstance(first, list) and len(first) in (3, 5) else None
    for i, entry in enumerate(rows):
        _check_entry(label, i, entry, width)
    if width == 3:
        rows5 = [[e[0], e[1], 1, None, e[2]] for e in rows]
        form = "batch"
    else:
        rows5, form = rows, "grid"
    return _build_grid(rows5, rows, label, form)


def _axis(
    ranges: list[tuple[Range, int]], name: str, label: str, rows: list
) -> tuple[tuple[Range, ...], list[str]]:
    """Check one axis: starts at 1, contiguous, no overlap. Returns ranges with the last made
    open-ended, plus a note when the stated last ``hi`` was extended."""
    ranges = sorted(ranges, key=lambda r: (r[0][0], -1 if r[0][1] is None else r[0][1]))
    (first, idx) = ranges[0]
    if first[0] != 1:
        raise ScheduleError(
            f"{label} {idx} {_fmt(rows[idx])}: {name} ranges must start at 1; the lowest starts at "
            f"{first[0]}"
        )
    for (prev, pidx), (cur, cidx) in zip(ranges, ranges[1:]):
        where = f"{label} {cidx} {_fmt(rows[cidx])}"
        if prev[1] is None or cur[0] <= prev[1]:
            raise ScheduleError(
                f"{where}: {name} range {_fmt_range(cur)} overlaps {name} range {_fmt_range(prev)} "
                f"of {label} {pidx} {_fmt(rows[pidx])}"
            )
        if cur[0] > prev[1] + 1:
            raise ScheduleError(
                f"{where}: gap: {name} {_fmt_span(prev[1] + 1, cur[0] - 1)} is not covered between "
                f"{label} {pidx} and this entry (a gap is an error, not a carry-forward)"
            )
    last, lidx = ranges[-1]
    notes = []
    if last[1] is not None:
        notes.append(
            f"{name} range {_fmt_range(last)} is the last: {name} above {last[1]} uses it too"
        )
    out = tuple(r for r, _ in ranges[:-1]) + ((last[0], None),)
    return out, notes


def _build_grid(rows5: list, rows: list, label: str, form: str) -> ParsedSchedule:
    groups: dict[Range, dict[Range, int]] = {}  # batch range -> ctx range -> entry index
    for i, e in enumerate(rows5):
        cells = groups.setdefault((e[0], e[1]), {})
        c = (e[2], e[3])
        if c in cells:
            j = cells[c]
            raise ScheduleError(
                f"{label} {i} {_fmt(rows[i])}: duplicate cell: same batch and context range as "
                f"{label} {j} {_fmt(rows[j])}"
            )
        cells[c] = i
    batch, notes = _axis(
        [(b, min(cells.values())) for b, cells in groups.items()], "batch", label, rows
    )
    ref_ctx: tuple[Range, ...] | None = None
    ks, sources = [], []
    batch_keys = sorted(groups, key=lambda b: b[0])
    for b in batch_keys:
        cells = groups[b]
        ctx, ctx_notes = _axis(list(cells.items()), "ctx", label, rows)
        ordered = sorted(cells.items(), key=lambda kv: kv[0][0])
        if ref_ctx is None:
            ref_ctx, ref_b, ref_notes = ctx, b, ctx_notes
        elif [c[0] for c in ctx] != [c[0] for c in ref_ctx]:
            _not_rectangular(label, rows, b, ref_b, ctx, ref_ctx, ordered)
        sources.append(tuple(i for _, i in ordered))
        ks.append(tuple(rows5[i][4] for _, i in ordered))
    assert ref_ctx is not None
    if form != "batch":
        notes += ref_notes
    return ParsedSchedule(
        form, batch, ref_ctx, tuple(ks), tuple(sources), tuple(rows), tuple(notes)
    )


def _not_rectangular(label: str, rows: list, b: Range, ref_b: Range, ctx: tuple, ref_ctx: tuple,
                     ordered: list) -> None:
    # Both axes are already contiguous from 1, so comparing the lower bounds finds the first
    # cell that differs; raw ranges are shown because the last one was made open-ended.
    ref_los = {c[0] for c in ref_ctx}
    for raw, i in ordered:
        if raw[0] not in ref_los:
            raise ScheduleError(
                f"{label} {i} {_fmt(rows[i])}: grid is not rectangular: batch range "
                f"{_fmt_range(b)} "
                f"has ctx range {_fmt_range(raw)}, but batch range {_fmt_range(ref_b)} has ctx "
                f"ranges "
                f"{', '.join(map(_fmt_range, ref_ctx))} (every batch range needs the same ctx "
                f"ranges)"
            )
    los = {c[0] for c in ctx}
    missing = next(c for c in ref_ctx if c[0] not in los)
    i = ordered[-1][1]
    raise ScheduleError(
        f"{label} {i} {_fmt(rows[i])}: grid is not rectangular: batch range {_fmt_range(b)} lacks "
        f"ctx range {_fmt_range(missing)}, which batch range {_fmt_range(ref_b)} has"
    )
