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

from dynaspec.bench.stats import run_order
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
            structured_output=it.structured,
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

    def __init__(self, label: str, engine_kwargs: dict, engine=None,
                 cold_prefix_cache: bool = False) -> None:
        self.label, self.kwargs = label, dict(engine_kwargs)
        # cold: every pass starts with an empty prefix cache (as with the suffix cache below).
        self.cold_prefix_cache = cold_prefix_cache
        if engine is None:
            from dynaspec.config import EngineConfig
            from dynaspec.engine.llm_engine import LLMEngine
            engine = LLMEngine(EngineConfig.from_kwargs(**self.kwargs))
        self.engine = engine
        # The torch threads this engine left the calling thread with: its configured count for
        # the sync driver, 1 for the pipelined one (its forward runs on a worker of its own).
        # Arms share the process, so each run restores its own: built after a sync arm, an
        # async arm's 1 ran the sync arm's steps on one core (CPU/wall 1.00 in both arms of
        # the c8 async-vs-sync compare, docs/history/benchmarks-waves-1-4.md).
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
            "prefix_caching": self.kwargs.get("enable_prefix_caching", True),
            "prefix_cache_cold": self.cold_prefix_cache,
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
        if self.cold_prefix_cache:
            e.kv.reset_prefix_cache()
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


def speculator_of(arm: Arm) -> str | None:
    """The engine arm's drafter ("none" for plain); None for a peer arm."""
    if getattr(arm, "engine", None) is None:
        return None
    return getattr(arm, "kwargs", {}).get("speculator", "none")


def recording_of(items: Sequence[WorkItem], rec: RunRecord) -> dict:
    """A pass's outputs as the oracle's recording (--oracle-recording's JSON object)."""
    return {"requests": [{"prompt": list(it.prompt_ids), "output": list(out)}
                         for it, out in zip(items, rec.outputs)]}


def oracle_arm(arm: EngineArm, recording: dict, label: str) -> EngineArm:
    """The replay oracle in `arm`'s place: its flags and K policy, the oracle as drafter at the K
    the arm's engine runs (eagle's implied K included). A --draft-tree arm's oracle drafts
    chains of its node budget: a perfect drafter's best tree is its chain."""
    kw = {**arm.kwargs, "speculator": "oracle", "oracle_recording": recording,
          "num_spec_tokens": arm.engine.config.spec.num_spec_tokens, "draft_tree": False,
          "eagle_lookup": "none", "draft_model": None, "draft_head": None}
    return EngineArm(label, kw, cold_prefix_cache=arm.cold_prefix_cache)


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
