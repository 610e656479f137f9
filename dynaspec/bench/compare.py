"""Paired A/B comparison of engine configurations (docs/design.md §8).

Each arm is built once (one model load) and runs the whole workload once per pair, closed-loop at
a fixed concurrency: C requests stay in flight, a new one is added as soon as one finishes. Arms
run in the order of `stats.run_order` (A B A B ...), with the same prompts and per-request seeds.
The headline number is the paired ratio of tokens/s, B over A, with a 95% t interval.

Every engine run is checked: the run's counter delta and the engine's running totals must satisfy
`SpecCounters.check_identities()`, and the tokens the client received must equal the tokens the
engine says it emitted; a violation raises `IdentityViolation` and stops the benchmark, because a
throughput number from an engine whose books do not balance is not a number to publish.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from dynaspec.bench.stats import latency_summary, paired_ratio, run_order
from dynaspec.bench.workloads import WorkItem
from dynaspec.outputs import RequestTimings
from dynaspec.sampling_params import SamplingParams

log = logging.getLogger("dynaspec.bench")


class IdentityViolation(RuntimeError):
    """The engine's metric identities failed during a benchmark run."""


@dataclass
class RunRecord:
    """One arm's pass over the workload."""

    arm: str
    pair: int
    tokens: int  # generated tokens received by the client
    elapsed_s: float
    ttft_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)  # per request: (e2e - ttft) / (n - 1)
    e2e_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # token ids per work item
    spec: dict | None = None  # SpecCounters delta (to_dict), engine arms only
    census: dict = field(default_factory=dict)  # steps_by_k, draft_skips, preemptions, steps
    phase_s: dict = field(default_factory=dict)  # engine StepTimes delta
    identity_violations: list[str] = field(default_factory=list)
    # Was the machine shared during the run? Load average before/after and this process's CPU
    # seconds: a run whose CPU time per wall second drops far below its arm's usual was slowed
    # by another process, and the runs table shows it so a reader can judge the pair.
    load_avg: tuple[float, float] = (0.0, 0.0)
    cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Arm(Protocol):
    label: str

    def run(self, items: Sequence[WorkItem], params: Sequence[SamplingParams], concurrency: int,
            tag: str) -> RunRecord: ...

    def describe(self) -> dict: ...


def make_params(items: Sequence[WorkItem], max_tokens: int | None, temperature: float,
                seed: int, ignore_eos: bool = False) -> list[SamplingParams]:
    """Per item params; item i gets seed + i in every arm and every pair (same seeds)."""
    return [
        SamplingParams(
            temperature=temperature,
            seed=seed + i,
            ignore_eos=ignore_eos,
            max_tokens=min(it.max_tokens, max_tokens) if max_tokens else it.max_tokens,
        )
        for i, it in enumerate(items)
    ]


def request_latencies(rec: RunRecord, timings: RequestTimings | None, num_tokens: int) -> None:
    """Append one finished request's latencies to `rec`."""
    if timings is None:
        return
    ttft, e2e = timings.ttft_s, timings.e2e_s
    if ttft is not None:
        rec.ttft_s.append(ttft)
    if e2e is not None:
        rec.e2e_s.append(e2e)
    rec.inter_token_s.extend(timings.inter_token_s)
    if ttft is not None and e2e is not None and num_tokens > 1:
        rec.tpot_s.append((e2e - ttft) / (num_tokens - 1))


def run_closed_loop(engine, items: Sequence[WorkItem], params: Sequence[SamplingParams],
                    concurrency: int, rec: RunRecord, tag: str) -> int:
    """Keep `concurrency` requests in the engine until all items finish; fills rec; returns the
    tokens seen in streamed outputs (checked against the engine's own count by the caller)."""
    pending, inflight = deque(range(len(items))), dict[str, int]()
    outputs: dict[int, list[int]] = {}
    streamed = 0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            i = pending.popleft()
            rid = engine.add_request(items[i].prompt_ids, params[i], request_id=f"{tag}-{i}")
            inflight[rid] = i
        outs = engine.step()
        for o in outs:
            streamed += len(o.new_token_ids)
            if not o.finished:
                continue
            if o.finish_reason == "error":
                raise RuntimeError(f"request {o.request_id} failed in the engine: {o.error}")
            i = inflight.pop(o.request_id)
            outputs[i] = list(o.token_ids)
            request_latencies(rec, o.timings, len(o.token_ids))
        if inflight and not outs and not engine.has_unfinished_requests():
            raise RuntimeError(f"engine dropped requests {sorted(inflight)}")
    rec.elapsed_s = time.perf_counter() - t0
    rec.outputs = [outputs[i] for i in range(len(items))]
    rec.tokens = sum(len(o) for o in rec.outputs)
    return streamed


class EngineArm:
    """A dynaspec engine built once from engine kwargs and reused for every run."""

    def __init__(self, label: str, engine_kwargs: dict, engine=None) -> None:
        self.label, self.kwargs = label, dict(engine_kwargs)
        if engine is None:
            from dynaspec.config import EngineConfig
            from dynaspec.engine.llm_engine import LLMEngine
            engine = LLMEngine(EngineConfig.from_kwargs(**self.kwargs))
        self.engine = engine
        # The torch threads this engine left the calling thread with: its configured count for
        # the sync driver, 1 for the pipelined one (its forward runs on a worker of its own).
        # Arms share the process, so each run restores its own: built after a sync arm, an
        # async arm's 1 ran the sync arm's steps on one core (CPU/wall 1.00 in both arms of
        # the c8 async-vs-sync compare, docs/benchmarks.md).
        self.main_threads = torch.get_num_threads()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def describe(self) -> dict:
        e = self.engine
        return {
            "kind": "engine",
            "label": self.label,
            "pool": e.pool_report().to_json(),
            "plan": e.plan.summary(),
            "weight_bytes_per_step": e.parts.model.weight_bytes_per_step(),
            "dtype": str(e.parts.model.dtype),
            "prefix_caching": self.kwargs.get("enable_prefix_caching"),
            "execution": e.exec_plan.mode,
            "build_seconds": {
                f"{b}x{w}": round(t, 2)
                for (b, w), t in getattr(e.runner.executor, "build_seconds", {}).items()
            },
        }

    def run(self, items: Sequence[WorkItem], params: Sequence[SamplingParams], concurrency: int,
            tag: str) -> RunRecord:
        e = self.engine
        torch.set_num_threads(self.main_threads)
        # Every pass starts with an empty suffix cache: one holding the previous pass's outputs
        # of these same prompts would draft them almost perfectly, which no real traffic sees.
        getattr(e, "reset_drafter_cache", lambda: None)()
        c0, p0, t0 = e.counters, e.scheduler.num_preemptions, asdict(e.times)
        steps_now = lambda: dict(e.recorder.execution_steps)  # noqa: E731
        x0 = steps_now()
        rec = RunRecord(tag.split("-")[0], -1, 0, 0.0)
        streamed = run_closed_loop(e, items, params, concurrency, rec, tag)
        delta = e.counters - c0
        rec.spec = delta.to_dict()
        rec.census = {"steps": delta.num_steps, "steps_by_k": rec.spec["steps_by_k"],
                      "draft_skips": rec.spec["draft_skips"],
                      "preemptions": e.scheduler.num_preemptions - p0,
                      "execution": {f"{p}/{w}": n - x0.get((p, w), 0)
                                    for (p, w), n in steps_now().items() if n > x0.get((p, w), 0)}}
        rec.phase_s = {k: v - t0[k] for k, v in asdict(e.times).items()}
        rec.identity_violations = _violations(e, delta, streamed, rec.tokens)
        e.take_finished_times()  # the server drains these; nothing does here
        return rec


def _violations(engine, delta, streamed: int, final_tokens: int) -> list[str]:
    bad = [f"run: {m}" for m in delta.check_identities()]
    bad += [f"engine total: {m}" for m in engine.counters.check_identities()]
    if delta.num_emitted_tokens != streamed:
        bad.append(f"client streamed {streamed} tokens but the engine counted "
                   f"{delta.num_emitted_tokens} emitted")
    if streamed != final_tokens:
        bad.append(f"streamed {streamed} tokens but the final outputs hold {final_tokens}")
    return bad


def run_pairs(arms: Mapping[str, Arm], items: Sequence[WorkItem], params: Sequence[SamplingParams],
              concurrency: int, pairs: int, order: str = "alternate",
              on_record: Callable[[RunRecord], None] | None = None) -> list[RunRecord]:
    """Run every arm once per pair, in `run_order`; identity violations stop the benchmark."""
    records = []
    for pair, name in run_order(pairs, tuple(arms), order):
        load0, cpu0 = _load1(), time.process_time()
        rec = arms[name].run(items, params, concurrency, f"{name}-p{pair}")
        rec.arm, rec.pair = name, pair
        rec.load_avg, rec.cpu_s = (load0, _load1()), time.process_time() - cpu0
        if rec.identity_violations:
            raise IdentityViolation(
                f"arm {name} ({arms[name].label}), pair {pair}: metric identities "
                "failed:\n  " + "\n  ".join(rec.identity_violations)
            )
        if on_record is not None:
            on_record(rec)
        records.append(rec)
    return records


def _load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 0.0


def _sum_maps(maps: list[dict]) -> dict:
    out: dict = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _spec_total(recs: list[RunRecord]) -> dict | None:
    """Sum the runs' counters and re-derive the rates (per-run rates cannot be averaged)."""
    specs = [r.spec for r in recs if r.spec is not None]
    if not specs or not any(s["num_steps"] for s in specs):
        return None  # a peer arm: no counters
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
            "num_spec_request_steps", "draft_seconds", "verify_seconds", "scheduler_seconds")
    tot = {k: sum(s[k] for s in specs) for k in keys}
    width = max(len(s["drafted_per_pos"]) for s in specs)
    for name in ("accepted_per_pos", "drafted_per_pos"):
        tot[name] = [sum(s[name][i] for s in specs if i < len(s[name])) for i in range(width)]
    dt, nd = tot["num_draft_tokens"], tot["num_drafts"]
    tot["acceptance_rate"] = tot["num_accepted_tokens"] / dt if dt else None
    tot["mean_acceptance_length"] = 1 + tot["num_accepted_tokens"] / nd if nd else None
    tot["acceptance_rate_per_pos"] = [
        a / d if d else None for a, d in zip(tot["accepted_per_pos"], tot["drafted_per_pos"])
    ]
    busy = tot["draft_seconds"] + tot["verify_seconds"]
    tot["draft_share"] = tot["draft_seconds"] / busy if busy else None
    return tot


def summarize_arm(recs: list[RunRecord], describe: dict) -> dict:
    tps = [r.tokens_per_s for r in recs]
    census = {"steps": sum(r.census.get("steps", 0) for r in recs),
              "steps_by_k": _sum_maps([r.census.get("steps_by_k", {}) for r in recs]),
              "draft_skips": _sum_maps([r.census.get("draft_skips", {}) for r in recs]),
              "preemptions": sum(r.census.get("preemptions", 0) for r in recs),
              "execution": _sum_maps([r.census.get("execution", {}) for r in recs])}
    phases = _sum_maps([r.phase_s for r in recs]) if recs[0].phase_s else {}
    return {**describe, "tokens_per_s": tps,
            "tokens_per_s_mean": sum(tps) / len(tps),
            "tokens": [r.tokens for r in recs], "elapsed_s": [r.elapsed_s for r in recs],
            "ttft_s": latency_summary(x for r in recs for x in r.ttft_s),
            "inter_token_s": latency_summary(x for r in recs for x in r.inter_token_s),
            "tpot_s": latency_summary(x for r in recs for x in r.tpot_s),
            "census": census, "phase_s": phases, "spec": _spec_total(recs)}


def same_outputs(recs: list[RunRecord], base: list[RunRecord]) -> dict:
    """How many work items produced the same tokens as the base arm in the same pair."""
    same = total = 0
    for r, b in zip(recs, base):
        for x, y in zip(r.outputs, b.outputs):
            same, total = same + (x == y), total + 1
    return {"identical": same, "total": total}


def build_report(arms: Mapping[str, Arm], records: list[RunRecord], settings: dict,
                 bandwidth: float | None) -> dict:
    """The JSON object: a, b (and peers), ratio and ci95 of B/A, ratios of every arm vs A."""
    by_arm = {name: [r for r in records if r.arm == name] for name in arms}
    summary = {
        name: summarize_arm(recs, arms[name].describe()) for name, recs in by_arm.items() if recs
    }
    base = by_arm["a"]
    ratios = {}
    for name, recs in by_arm.items():
        if name != "a" and recs:
            est = paired_ratio([r.tokens_per_s for r in base], [r.tokens_per_s for r in recs])
            ratios[name] = {**est.to_dict(), "ci95": [est.lo, est.hi], "text": est.fmt(),
                            "outputs_vs_a": same_outputs(recs, base)}
    for s in summary.values():
        wb = s.get("weight_bytes_per_step")
        if bandwidth and wb:
            # A step that reads every weight once emits at most C tokens without speculation.
            s["bandwidth_limit_tokens_per_s"] = settings["concurrency"] * bandwidth / wb
            s["bandwidth_limit_step_s"] = wb / bandwidth
    head = ratios.get("b", {})
    return {
        "settings": settings,
        "bandwidth_bytes_per_s": bandwidth,
        **summary,
        "ratio": head.get("ratio"),
        "ci95": head.get("ci95"),
        "ratios": ratios,
        "runs": [
            {
                "arm": r.arm,
                "pair": r.pair,
                "tokens": r.tokens,
                "elapsed_s": r.elapsed_s,
                "tokens_per_s": r.tokens_per_s,
                "load_avg_1m": list(r.load_avg),
                "cpu_s": r.cpu_s,
            }
            for r in records
        ],
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown_report(report: dict, arm_names: Sequence[str]) -> str:
    """Markdown tables: per-arm speed and latency, speculation, census, and the paired ratios."""
    st = report["settings"]
    lines = [
        f"workload `{st['workload']}`{' (long)' if st.get('long') else ''}, {st['num_prompts']} "
        f"prompts, "
        f"max_tokens {st['max_tokens']}, concurrency {st['concurrency']}, {st['pairs']} pairs "
        f"({st['order']}), temperature {st['temperature']}, prefix caching "
        f"{'on (warm pass first)' if st.get('prefix_caching') else 'off'}",
        "",
    ]
    bw = report.get("bandwidth_bytes_per_s")
    if bw:
        lines += [
            f"read bandwidth {bw / 1e9:.1f} GB/s; the bandwidth limit is the no-speculation decode "
            "ceiling at this concurrency: C tokens per step that reads every weight once",
            "",
        ]
    lines += [
        "| arm | config | tok/s (mean) | limit tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | TPOT "
        "mean ms | KV pool tokens (target / drafter) | preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in arm_names:
        s = report.get(n)
        if s is None:
            continue
        pool = s.get("pool") or {}
        pool_txt = (
            f"{pool.get('num_tokens', '-')} / {pool.get('drafter_num_tokens', '-')}"
            if pool
            else "-"
        )
        lim = s.get("bandwidth_limit_tokens_per_s")
        lines.append(
            f"| {n} | `{s['label']}` | {s['tokens_per_s_mean']:.2f} | {_num(lim, '.1f')} | "
            f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} | "
            f"{_ms(s['inter_token_s']['p50'])} / {_ms(s['inter_token_s']['p99'])} | "
            f"{_ms(s['tpot_s']['mean'])} | {pool_txt} | {s['census']['preemptions']} |"
        )
    lines += [
        "",
        "| arm | acceptance rate | mean acceptance length | per-position rate | draft s / verify s "
        "(draft share) | steps by K | draft skips |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in arm_names:
        s = report.get(n)
        if s is None:
            continue
        sp, c = s.get("spec"), s["census"]
        if sp is None:
            lines.append(f"| {n} | - | - | - | - | - | - |")
            continue
        pos = ", ".join(_num(x, ".2f") for x in sp["acceptance_rate_per_pos"]) or "-"
        by_k = c["steps_by_k"] or f"{c['steps']} steps, spec off"
        lines.append(
            f"| {n} | {_num(sp['acceptance_rate'])} | {_num(sp['mean_acceptance_length'])} | "
            f"{pos} | {sp['draft_seconds']:.2f} / {sp['verify_seconds']:.2f} "
            f"({_num(sp['draft_share'], '.1%')}) | {by_k} | "
            f"{c['draft_skips'] or '-'} |"
        )
    lines += [
        "",
        "| arm | steps by execution path/width | compile/capture s per shape |",
        "|---|---|---|",
    ]
    for n in arm_names:
        s = report.get(n)
        if s is not None and "census" in s:
            lines.append(
                f"| {n} | {s['census'].get('execution') or '-'} | {s.get('build_seconds') or '-'} |"
            )
    lines += [
        "",
        "| ratio (tok/s) | paired geometric mean | 95% CI | outputs identical to A |",
        "|---|---|---|---|",
    ]
    for n, r in report["ratios"].items():
        o = r["outputs_vs_a"]
        ci = "-" if r["lo"] is None else f"[{r['lo']:.3f}, {r['hi']:.3f}]"
        lines.append(f"| {n}/a | {r['ratio']:.3f}x | {ci} | {o['identical']}/{o['total']} |")
    lines += [
        "",
        f"runs (load = 1-minute load average before / after, on {os.cpu_count()} CPUs; "
        "CPU/wall = this process's CPU seconds per wall second; a run slowed by another "
        "process shows a high load and a low CPU/wall):",
        "",
        "| run | arm | pair | tokens | seconds | tok/s | load | CPU/wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(report["runs"]):
        la = r.get("load_avg_1m") or [0.0, 0.0]
        share = r.get("cpu_s", 0.0) / r["elapsed_s"] if r["elapsed_s"] else 0.0
        lines.append(f"| {i} | {r['arm']} | {r['pair']} | {r['tokens']} | {r['elapsed_s']:.2f} | "
                     f"{r['tokens_per_s']:.2f} | {la[0]:.1f} / {la[1]:.1f} | {share:.2f} |")
    return "\n".join(lines)
