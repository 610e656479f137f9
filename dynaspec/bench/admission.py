"""Performance admission (docs/design.md §6): is the compiled/graph path faster than eager, per
shape?

For every (batch bucket, width) of the engine's execution grid, the same synthetic decode step
is run through `ModelRunner.execute` on both paths as they really run: eager ragged over the
real requests, the fixed-shape path padded to the bucket. The step is measured at the bucket's
*smallest* batch (the previous bucket + 1), where padding costs the compiled path the most, so a
shape admitted there is not slower anywhere in its bucket (fail closed). Arms alternate
(E C E C ...) for `pairs` pairs; each arm's sample is the median of `steps` calls, and the
result is the paired ratio compiled / eager with its 95% CI. A shape is admitted only when the
whole CI is below 1; `auto` runs everything else eager.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from dynaspec.bench.stats import paired_ratio
from dynaspec.bench.tune import _synthetic_batch
from dynaspec.spec_decode.plan.execution_plan import AdmissionEntry, AdmissionTable
from dynaspec.step_plan import BatchDescriptor


def _time(runner, out, steps: int) -> tuple[float, str]:
    times, path = [], ""
    for _ in range(steps):
        t0 = time.perf_counter()
        res = runner.execute(out)
        times.append(time.perf_counter() - t0)
        path = res.batch.path
    return statistics.median(times), path


def measure_shape(engine, bucket: int, width: int, ctx: int, pairs: int,
                  steps: int) -> tuple[AdmissionEntry, float]:
    ep, runner = engine.exec_plan, engine.runner
    i = ep.buckets.index(bucket)
    n = ep.buckets[i - 1] + 1 if i > 0 else 1
    out, _ = _synthetic_batch(engine, n, ctx, width - 1, f"adm-b{bucket}-w{width}")
    out = dataclasses.replace(out, scheduled=tuple(dataclasses.replace(s, num_lookahead=width - 1)
                                                   for s in out.scheduled))
    eager = dataclasses.replace(out, batch=BatchDescriptor("eager", n, width, n * width))
    fixed = dataclasses.replace(
        out, batch=BatchDescriptor(ep.graph_path, bucket, width, bucket * width)
    )
    try:
        t_build = time.perf_counter()
        _, path = _time(runner, fixed, 1)  # builds the shape (compile / capture)
        build_s = time.perf_counter() - t_build
        if path != ep.graph_path:
            raise RuntimeError(f"shape ({bucket}, {width}) did not run on {ep.graph_path} "
                               f"(ran {path}): see the log for the build error")
        _time(runner, eager, 1)
        e_s, c_s = [], []
        for _ in range(pairs):
            e_s.append(_time(runner, eager, steps)[0])
            c_s.append(_time(runner, fixed, steps)[0])
    finally:
        for s in out.scheduled:
            runner.forget(s.request.request_id)
    r = paired_ratio(e_s, c_s)
    lo, hi = (r.lo, r.hi) if r.lo is not None and r.hi is not None else (r.ratio, r.ratio)
    entry = AdmissionEntry(bucket, width, r.ratio, lo, hi, statistics.median(e_s) * 1e3,
                           statistics.median(c_s) * 1e3)
    return entry, build_s


def measure_admission(engine, ctx: int = 256, pairs: int = 5, steps: int = 5,
                      progress: Callable[[str], None] | None = None) -> AdmissionTable:
    """Needs an engine built with --execution compiled (so the runner has its executor)."""
    ep = engine.exec_plan
    if engine.runner.executor is None:
        raise ValueError("bench admission needs --execution compiled (the fixed-shape executor)")
    entries, builds = [], {}
    for bucket, width in ep.grid:
        entry, build_s = measure_shape(engine, bucket, width, ctx, pairs, steps)
        entries.append(entry)
        builds[f"{bucket}x{width}"] = round(build_s, 2)
        if progress is not None:
            verdict = "compiled" if entry.compiled_wins else "eager"
            progress(
                f"requests {bucket:>3} width {width:>2}: eager {entry.eager_ms:7.2f} ms, "
                f"{ep.graph_path} {entry.compiled_ms:7.2f} ms, ratio {entry.ratio:.3f} "
                f"[{entry.ci_low:.3f}, {entry.ci_high:.3f}] -> {verdict} (build {build_s:.1f} s)"
            )
    meta = {"model": engine.parts.model_name, "plan": engine.plan.summary(), "ctx": ctx,
            "pairs": pairs, "steps_per_sample": steps, "path": ep.graph_path,
            "build_seconds": builds, "buckets": list(ep.buckets), "widths": list(ep.widths)}
    return AdmissionTable(tuple(entries), "", meta)
