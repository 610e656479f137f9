"""`dynaspec tune`: measure this machine's cost of a verify step and the workload's acceptance,
then choose K per (batch, context) bucket by goodput and write a tuned K schedule.

Goodput of K in a bucket = expected emitted tokens per step / step time
    = batch * (1 + sum_{i<K} prod_{j<=i} alpha_j) / t(batch, ctx, K)
where alpha_j is the conditional acceptance rate at draft position j and t includes drafting.
K = 0 is always a candidate; a bucket gets K > 0 only when its goodput beats K = 0's by more
than `margin`, so the table says 0 wherever speculation does not pay (docs/design.md §3).

The decision (`make_buckets`, `choose_k`, `schedule_object`) is pure, apart from the measuring,
so it can be tested on a synthetic cost model without a model load.

Measuring:
- step time: the engine's real runner (`ModelRunner.execute`: drafting, input preparation, the
  target forward over 1+K rows per request, rejection sampling) on synthetic uniform batches of
  `batch` requests with `ctx` tokens of context each. The context is a repeated random block so
  the n-gram drafter always finds a K-token match (full width, the cost upper bound). Scheduler
  and output-processing time, the same for every K, is left out (so gains are slightly
  understated). A draft model is warmed on each batch first so the timed call drafts K tokens
  from a caught-up drafter, as in steady state.
- acceptance: the workload run once at K = max(k_values); e_i = accepted_per_pos[i] / decode
  request-steps (request-steps that had a chance to draft: drafts plus drafter-caused skips), so
  no-match steps and short drafts count as the zero-acceptance opportunities they are; then
  alpha_i = e_i / e_{i-1}. Greedy acceptance at position i does not depend on K, so one run at
  the largest K gives the curve for every smaller K.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

StepTimeFn = Callable[[int, int, int], float]  # (batch, ctx, K) -> seconds per step

# Skips that say the schedule or the step, not the drafter, kept a request from drafting.
_NOT_OPPORTUNITIES = ("prefill", "token_budget", "schedule_zero", "adaptive")


@dataclass(frozen=True)
class Bucket:
    batch: tuple[int, int | None]  # inclusive range; None = open-ended
    ctx: tuple[int, int | None]
    batch_at: int  # where the bucket was measured
    ctx_at: int


def _ranges(values: Sequence[int]) -> list[tuple[int, int | None]]:
    """Ranges around sorted measured points, split at geometric midpoints; last open-ended.

    1,4,16,64 -> [1,2] [3,8] [9,32] [33,inf): each measured point lies inside its own range.
    """
    vs = sorted(set(values))
    if not vs or vs[0] < 1:
        raise ValueError(f"bucket values must be integers >= 1, got {list(values)}")
    out: list[tuple[int, int | None]] = []
    lo = 1
    for v, nxt in zip(vs, vs[1:]):
        hi = max(v, int(math.sqrt(v * nxt)))
        out.append((lo, hi))
        lo = hi + 1
    out.append((lo, None))
    return out


def make_buckets(batch_values: Sequence[int], ctx_values: Sequence[int]) -> list[Bucket]:
    """Row-major (batch, then ctx) grid of buckets, the order the schedule grid uses."""
    bv, cv = sorted(set(batch_values)), sorted(set(ctx_values))
    return [
        Bucket(br, cr, b, c) for br, b in zip(_ranges(bv), bv) for cr, c in zip(_ranges(cv), cv)
    ]


def survival(alpha: Sequence[float]) -> list[float]:
    """P(the first i+1 drafts are all accepted) = prod_{j<=i} alpha_j."""
    out, p = [], 1.0
    for a in alpha:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance rates must be in [0, 1], got {a}")
        p *= a
        out.append(p)
    return out


def expected_tokens(alpha: Sequence[float], k: int) -> float:
    """Tokens one request emits per step at K = k. Positions beyond the measured ones count as
    never accepted: the tuner does not extrapolate acceptance it has not seen."""
    return 1.0 + sum(survival(alpha)[:k])


def goodput(
    step_time_fn: StepTimeFn, alpha: Sequence[float], batch: int, ctx: int, k: int
) -> float:
    t = step_time_fn(batch, ctx, k)
    if not t > 0:
        raise ValueError(f"step time must be > 0, got {t} at batch {batch}, ctx {ctx}, K {k}")
    return batch * expected_tokens(alpha, k) / t


def choose_k(step_time_fn: StepTimeFn, acceptance: Sequence[float], buckets: Sequence[Bucket],
             k_values: Sequence[int], margin: float = 0.0) -> list[dict]:
    """Per bucket: goodput of every K and the chosen K (0 unless some K > 0 beats K = 0 by more
    than `margin`, e.g. 0.02 = 2%). `acceptance` holds the conditional rates alpha_j."""
    ks = sorted(set(k_values) | {0})
    if ks[0] < 0:
        raise ValueError(f"K values must be >= 0, got {list(k_values)}")
    choices = []
    for bk in buckets:
        g = {k: goodput(step_time_fn, acceptance, bk.batch_at, bk.ctx_at, k) for k in ks}
        best = max(ks, key=lambda k: (g[k], -k))  # ties go to the smaller K
        if g[best] <= g[0] * (1.0 + margin):
            best = 0
        choices.append(
            {
                "batch": list(bk.batch),
                "ctx": list(bk.ctx),
                "batch_at": bk.batch_at,
                "ctx_at": bk.ctx_at,
                "k": best,
                "goodput": {str(k): v for k, v in g.items()},
                "gain": g[best] / g[0],
            }
        )
    return choices


def schedule_object(choices: Sequence[dict], measurements: dict) -> dict:
    """The tuned-table object `--k-schedule` accepts: {"grid": rows, "measurements": {...}}."""
    rows = [[c["batch"][0], c["batch"][1], c["ctx"][0], c["ctx"][1], c["k"]] for c in choices]
    return {"grid": rows, "measurements": {**measurements, "choices": list(choices)}}


def write_schedule(choices: Sequence[dict], measurements: dict, path: str) -> dict:
    obj = schedule_object(choices, measurements)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
    return obj


def table_step_time(times: dict[tuple[int, int, int], float]) -> StepTimeFn:
    """A StepTimeFn reading measured (batch, ctx, K) points."""
    def fn(batch: int, ctx: int, k: int) -> float:
        return times[(batch, ctx, k)]
    return fn


# ---- measuring ------------------------------------------------------------------------------

def acceptance_from_spec(spec: dict) -> tuple[list[float], list[float], int]:
    """(alpha, e, decode request-steps) from a SpecCounters.to_dict() of a run at K = max."""
    skips = spec.get("draft_skips", {})
    opportunities = spec["num_spec_request_steps"] - sum(
        skips.get(r, 0) for r in _NOT_OPPORTUNITIES
    )
    if opportunities <= 0:
        raise ValueError("the acceptance run had no decode steps that could draft")
    e = [a / opportunities for a in spec["accepted_per_pos"]]
    alpha, prev = [], 1.0
    for x in e:
        alpha.append(min(1.0, x / prev) if prev > 0 else 0.0)
        prev = x
    return alpha, e, opportunities


def measure_acceptance(engine, items, params) -> dict:
    """Run the workload closed-loop at concurrency 1 on a K = max engine; counters -> alpha."""
    from dynaspec.bench.compare import RunRecord, run_closed_loop
    c0 = engine.counters
    rec = RunRecord("tune", 0, 0, 0.0)
    run_closed_loop(engine, items, params, 1, rec, "tune-acc")
    delta = engine.counters - c0
    if bad := delta.check_identities():
        raise RuntimeError(f"metric identities failed during the acceptance run: {bad}")
    spec = delta.to_dict()
    alpha, e, n = acceptance_from_spec(spec)
    busy = max(delta.num_spec_request_steps, 1)
    return {
        "alpha": alpha,
        "accepted_run_prob": e,
        "decode_request_steps": n,
        "acceptance_rate": spec["acceptance_rate"],
        "mean_acceptance_length": spec["mean_acceptance_length"],
        "draft_seconds_per_request_step": delta.draft_seconds / busy,
        "tokens": rec.tokens,
        "elapsed_s": rec.elapsed_s,
        "draft_skips": spec["draft_skips"],
    }


def _synthetic_batch(engine, batch: int, ctx: int, k: int, tag: str):
    """`batch` requests with `ctx` computed tokens each, each about to verify up to k drafts."""
    from dynaspec.request import Request, RequestStatus
    from dynaspec.sampling_params import SamplingParams
    from dynaspec.step_plan import BatchDescriptor, ScheduledRequest, StepPlan
    bs, nblocks, vocab = engine.kv.block_size, engine.kv.num_blocks, engine.parts.vocab_size
    per = -(-(ctx + 1 + k) // bs)
    period = min(64, max(k + 2, ctx // 2))  # the n-gram drafter matches one period back
    rng = random.Random(batch * 100003 + ctx)
    sp = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    scheduled = []
    for i in range(batch):
        block = [rng.randrange(100, vocab - 100) for _ in range(period)]
        req = Request(f"{tag}-{i}", (block * (ctx // period + 2))[: ctx + 1], sp)
        req.num_computed_tokens, req.status = ctx, RequestStatus.RUNNING
        # Distinct blocks while the pool lasts, then wrap (aliasing only changes what is read).
        table = [(i * per + j) % nblocks for j in range(per)]
        scheduled.append(ScheduledRequest(request=req, num_new_tokens=1, draft_budget=k,
                                          skip_reason=None if k else "schedule_zero",
                                          block_table=table, sampling=True, num_lookahead=k))
    step_k = k if engine.plan.speculating else None
    eager = BatchDescriptor("eager", batch, 1 + k, batch * (1 + k))
    return StepPlan(scheduled=tuple(scheduled), step_k=step_k, num_batched_tokens=batch,
                    batch=eager), per * batch > nblocks


def time_bucket(engine, batch: int, ctx: int, ks: Sequence[int], repeats: int) -> dict[int, dict]:
    """Seconds of ModelRunner.execute on synthetic uniform batches, one per K, after a warm call.

    The K values are timed round-robin (K0 K2 K4, K0 K2 K4, ...) so a burst of load from another
    process hits every K of the bucket alike instead of one K's whole series; each K keeps its
    fastest call, because on a shared machine noise only ever adds time (the median is kept to
    show the noise).
    """
    runner = engine.runner
    batches = {k: _synthetic_batch(engine, batch, ctx, k, f"tune-b{batch}-c{ctx}-k{k}") for k in ks}
    times: dict[int, list[float]] = {k: [] for k in ks}
    drafted = {k: k for k in ks}
    try:
        for k in ks:
            runner.execute(
                batches[k][0]
            )  # warm: allocator; a draft model catches up on the context
        for _ in range(repeats):
            for k in ks:
                t0 = time.perf_counter()
                res = runner.execute(batches[k][0])
                times[k].append(time.perf_counter() - t0)
                drafted[k] = min(drafted[k], min(r.num_draft_tokens for r in res.results))
    finally:
        for out, _ in batches.values():
            for s in out.scheduled:
                runner.forget(s.request.request_id)
    return {k: {"seconds": min(times[k]), "median_s": statistics.median(times[k]),
                "min_drafted": drafted[k], "kv_wrapped": batches[k][1]} for k in ks}


def measure_step_times(
    engine,
    batch_values: Sequence[int],
    ctx_values: Sequence[int],
    k_values: Sequence[int],
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[tuple[int, int, int], dict]:
    ks = sorted(set(k_values) | {0})
    out = {}
    for b in sorted(set(batch_values)):
        for c in sorted(set(ctx_values)):
            for k, m in time_bucket(engine, b, c, ks, repeats).items():
                out[(b, c, k)] = m
                if progress is not None:
                    note = (
                        ""
                        if m["min_drafted"] >= k
                        else f" (only {m['min_drafted']} drafts verified)"
                    )
                    progress(f"batch {b} ctx {c} K {k}: {m['seconds'] * 1e3:.1f} ms "
                             f"(median {m['median_s'] * 1e3:.1f}){note}")
    return out
