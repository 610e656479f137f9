"""The execution plan (docs/design.md §6): which step shapes exist, and which path each one runs.

Two decisions, kept apart:
- **shape safety**, from the SpecPlan alone: the grid of fixed shapes is the padded request
  counts (1, 2, 4, ..., 64, capped by max_num_seqs) times every verify width the plan can
  produce (`plan.widths`: one for constant(k), one per K for variable, width 1 for always_zero
  and off). Only a decode-only step whose width is in the grid can take a fixed-shape path;
  mixed prefill+decode steps and batches above the largest bucket run eager.
- **performance admission**, measured: under ``--execution auto`` a grid shape runs compiled only
  if the admission table (`dynaspec bench admission`) measured compiled faster than eager for it;
  an unmeasured shape runs eager on the CPU (fail closed) and CUDA graphs on CUDA (a whole-step
  graph against hundreds of kernel launches; a measured table still overrides it).
  ``--execution compiled`` runs every grid shape compiled; ``eager`` runs nothing compiled.

`descriptor()` turns one formed batch into the `BatchDescriptor` the runner executes, before the
forward: the width is planned here, never measured from the inputs afterwards.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field

from dynaspec.spec_decode.plan.plan import SpecPlan
from dynaspec.step_plan import BatchDescriptor

MODES = ("eager", "compiled", "auto")
MAX_BUCKET = 64


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded request counts: powers of two up to 64, capped by max_num_seqs (which is itself a
    bucket when it is not a power of two, so every batch size up to it has a bucket)."""
    top = min(max_num_seqs, MAX_BUCKET)
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    out.append(top)
    return tuple(out)


@dataclass(frozen=True)
class AdmissionEntry:
    """One measured (bucket, width): compiled time / eager time, paired, with its 95% CI."""

    num_reqs_padded: int
    width: int
    ratio: float  # compiled / eager step time (< 1: compiled faster)
    ci_low: float
    ci_high: float
    eager_ms: float
    compiled_ms: float

    @property
    def compiled_wins(self) -> bool:
        # The whole CI below 1: a tie or a noisy measurement stays eager (fail closed).
        return self.ci_high < 1.0


@dataclass(frozen=True)
class AdmissionTable:
    entries: tuple[AdmissionEntry, ...]
    source: str = ""
    meta: dict = field(default_factory=dict)

    def get(self, num_reqs_padded: int, width: int) -> AdmissionEntry | None:
        for e in self.entries:
            if (e.num_reqs_padded, e.width) == (num_reqs_padded, width):
                return e
        return None

    def to_json(self) -> dict:
        return {"meta": self.meta, "entries": [
            {"num_reqs_padded": e.num_reqs_padded, "width": e.width, "ratio": e.ratio,
             "ci": [e.ci_low, e.ci_high], "eager_ms": e.eager_ms, "compiled_ms": e.compiled_ms,
             "winner": "compiled" if e.compiled_wins else "eager"} for e in self.entries]}

    @staticmethod
    def load(path: str) -> AdmissionTable:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            entries = tuple(AdmissionEntry(int(e["num_reqs_padded"]), int(e["width"]),
                                           float(e["ratio"]), float(e["ci"][0]), float(e["ci"][1]),
                                           float(e["eager_ms"]), float(e["compiled_ms"]))
                            for e in data["entries"])
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"admission table {path!r} is unreadable: {exc}") from exc
        return AdmissionTable(entries, path, dict(data.get("meta", {})))


def bucket_ks(plan: SpecPlan, buckets: tuple[int, ...]) -> list[tuple[int, tuple[int, int], int]]:
    """(bucket, (first, last) requests it covers, K) for every K the plan's table gives in a
    bucket's batch range (any context range)."""
    out: list[tuple[int, tuple[int, int], int]] = []
    prev = 0
    for b in buckets:
        ks = sorted({r.k for r in plan.table
                     if r.batch_lo <= b and (r.batch_hi is None or r.batch_hi > prev)})
        out.extend((b, (prev + 1, b), k) for k in ks)
        prev = b
    return out


def default_admission_path(k_schedule: object) -> str | None:
    """Next to the K table when the schedule is a file (tuned.json -> tuned.admission.json);
    an inline schedule (a list of entries, as `LLM(k_schedule=[...])` takes) has no file."""
    if isinstance(k_schedule, (str, os.PathLike)) and k_schedule and os.path.isfile(k_schedule):
        return os.path.splitext(k_schedule)[0] + ".admission.json"
    return None


@dataclass(frozen=True)
class ExecutionPlan:
    mode: str  # eager | compiled | auto
    graph_path: str  # the fixed-shape path on this device: "compiled" (CPU) or "cuda_graph"
    buckets: tuple[int, ...]
    widths: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]  # (bucket, width) pairs the plan can produce
    admission: AdmissionTable | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown execution mode {self.mode!r}: choose {', '.join(MODES)}")

    @staticmethod
    def build(plan: SpecPlan, max_num_seqs: int, mode: str = "eager", device_type: str = "cpu",
              admission: AdmissionTable | None = None) -> ExecutionPlan:
        path = "cuda_graph" if device_type == "cuda" else "compiled"
        buckets = batch_buckets(max_num_seqs)
        shapes = tuple((b, 1 + k) for b, _, k in bucket_ks(plan, buckets))
        return ExecutionPlan(mode, path, buckets, tuple(plan.widths), shapes, admission)

    @property
    def grid(self) -> tuple[tuple[int, int], ...]:
        """Every (padded request count, width) a fixed-shape step can have: per bucket, the
        widths of the K values the table gives anywhere in the bucket's batch range."""
        return self.shapes

    @property
    def fixed_shapes(self) -> tuple[tuple[int, int], ...]:
        """The grid shapes that run fixed-shape (compiled or CUDA graphs), not eager."""
        return tuple(s for s in self.shapes if self.path_for(*s)[0] != "eager")

    def bucket_for(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_reqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def path_for(self, num_reqs_padded: int, width: int) -> tuple[str, str]:
        """(path, why) for a grid shape."""
        if self.mode == "eager":
            return "eager", "--execution eager"
        if self.mode == "compiled":
            return self.graph_path, "--execution compiled"
        entry = self.admission.get(num_reqs_padded, width) if self.admission else None
        if entry is None and self.graph_path == "cuda_graph":
            # A whole-step graph replaces hundreds of launches: on CUDA graphs are the default
            # for every decode/verify shape an admission table does not say otherwise about.
            return self.graph_path, "unmeasured on CUDA -> graphs (default)"
        if entry is None:
            return "eager", "unmeasured -> eager"
        ratio = f"measured {entry.ratio:.3f} [{entry.ci_low:.3f}, {entry.ci_high:.3f}]"
        return (self.graph_path if entry.compiled_wins else "eager"), ratio

    def descriptor(self, num_reqs: int, width: int | None, num_tokens: int) -> BatchDescriptor:
        """`width` is the step's planned verify width for a decode-only step, None for a mixed
        one; `num_tokens` the step's planned token count on the eager path (drafts included)."""
        # Width 1 is plain decode, which a policy may choose (K=0) under any plan.
        if width is not None and width != 1 and width not in self.widths:
            raise ValueError(f"step width {width} is not one the plan produces {self.widths}")
        bucket = self.bucket_for(num_reqs) if width is not None else None
        if bucket is None or width is None or (bucket, width) not in self.shapes:
            return BatchDescriptor("eager", num_reqs, width, num_tokens)
        path, _ = self.path_for(bucket, width)
        if path == "eager":
            return BatchDescriptor("eager", num_reqs, width, num_tokens)
        return BatchDescriptor(path, bucket, width, bucket * width)

    def to_json(self) -> dict:
        return {"mode": self.mode, "graph_path": self.graph_path, "buckets": list(self.buckets),
                "widths": list(self.widths),
                "shapes": [{"num_reqs_padded": b, "width": w, "path": self.path_for(b, w)[0]}
                           for b, w in self.shapes],
                "admission": self.admission.source if self.admission else None}
