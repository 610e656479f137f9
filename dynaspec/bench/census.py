"""`dynaspec bench census`: where a drafter's acceptance goes between the verifier and the clock.

One engine, one workload (held-out by default: a seed the schedule was never tuned on), closed
loop at --concurrency (1 by default). The loop drives the engine's phases itself
(`schedule -> launch -> land -> emit`) so each step is seen with what its plan and its result
said, and with what the K policy's cost table predicted for the width that ran, read *before*
the step's own timing refreshes that cell. It reports:

- steps by K, and K=0 steps by why (every request a prefill, or no request allowed to draft and
  the reasons it was not: `adaptive` = the policy priced drafting below plain, `max_tokens`...);
- per verified width (1 = a plain step): steps, median seconds as run (target forward +
  sampling + input prep, what the cost model learns from) against the table's prediction;
- drafting seconds on steps that drafted and on steps that did not (a K=0 step must cost what
  a plain step costs, so any draft time there is a tax), scheduling seconds per step;
- drafts: request-steps that drafted, tokens drafted and accepted, tree steps and nodes.
Only pure decode steps (every request decoding one token) enter the width table: a prefill
chunk is not the shape the cost model prices.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from dynaspec.sampling_params import SamplingParams


@dataclass
class StepSample:
    k: int | None
    width: int  # the widest sampling row verified (1 = plain)
    decode_only: bool
    num_reqs: int
    ctx: int
    target_s: float  # forward + sample + prepare: the cost model's own measure
    predicted_s: float | None  # the policy's table at (num_reqs, ctx, width) before this step
    draft_s: float
    schedule_s: float
    skips: tuple[str, ...]  # per request that verified no draft: why


@dataclass
class Census:
    samples: list[StepSample] = field(default_factory=list)
    tokens: int = 0
    elapsed_s: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_request_steps: int = 0
    tree_request_steps: int = 0
    tree_nodes: int = 0
    tree_accepted: int = 0
    # The goodput policy's learned per-depth, per-branch acceptance after the run
    # (spec_decode/tree_pricing.BranchRates.table(): "d<depth>b<rank>" -> rate).
    branch_rates: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        by_k = Counter("off" if s.k is None else s.k for s in self.samples)
        zero = Counter(_zero_reason(s) for s in self.samples if s.k == 0)
        widths: dict[int, list[StepSample]] = defaultdict(list)
        for s in self.samples:
            if s.decode_only:
                widths[s.width].append(s)
        drafted = [s.draft_s for s in self.samples if s.k]
        undrafted = [s.draft_s for s in self.samples if not s.k]
        return {
            "tokens": self.tokens, "elapsed_s": self.elapsed_s,
            "tokens_per_s": self.tokens / self.elapsed_s if self.elapsed_s else None,
            "steps": len(self.samples),
            "steps_by_k": {str(k): n for k, n in sorted(by_k.items(), key=str)},
            "k0_steps_by_reason": dict(zero.most_common()),
            "widths": {str(w): _width_row(ss) for w, ss in sorted(widths.items())},
            "draft_s_total": sum(s.draft_s for s in self.samples),
            "draft_s_per_k_step": _median(drafted), "draft_s_per_k0_step": _median(undrafted),
            "draft_s_on_k0_steps_total": sum(undrafted),
            "schedule_s_per_step": _median([s.schedule_s for s in self.samples]),
            "draft_request_steps": self.draft_request_steps,
            "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
            "tree_request_steps": self.tree_request_steps, "tree_nodes": self.tree_nodes,
            "tree_accepted_tokens": self.tree_accepted, "branch_rates": self.branch_rates,
        }


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _width_row(ss: list[StepSample]) -> dict:
    run = _median([s.target_s for s in ss])
    pred = [s.predicted_s for s in ss if s.predicted_s is not None]
    p = _median(pred)
    return {"steps": len(ss), "median_run_s": run, "median_table_s": p,
            "run_over_table": run / p if run and p else None,
            "median_batch": _median([s.num_reqs for s in ss]),
            "median_ctx": _median([s.ctx for s in ss])}


def _zero_reason(s: StepSample) -> str:
    if not s.decode_only and not s.skips:
        return "prefill"
    common = Counter(s.skips).most_common(1)
    return common[0][0] if common else "unknown"


def _predicted(engine, num_reqs: int, ctx: int, width: int) -> float | None:
    policy = engine.scheduler.policy
    model = getattr(policy, "cost_model", None)
    return None if model is None else model.cost(num_reqs, ctx, width)


def run_census(engine, items, params: Sequence[SamplingParams], concurrency: int,
               tag: str = "census") -> Census:
    """Closed loop over `items` at `concurrency`, one StepSample per engine step."""
    from dynaspec.engine.sync_driver import SyncDriver

    if not isinstance(engine.driver, SyncDriver):
        raise ValueError("bench census drives the synchronous step; drop --async-scheduling")
    c = Census()
    pending, inflight = list(range(len(items)))[::-1], set[str]()
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < concurrency:
            i = pending.pop()
            inflight.add(engine.add_request(items[i].prompt_ids, params[i],
                                            request_id=f"{tag}-{i}"))
        plan = engine.schedule()
        if not plan.scheduled:
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"engine dropped requests {sorted(inflight)}")
            continue
        launched = engine.launch(plan)
        res = launched.future.result() if launched.future.exception() is None else None
        c.samples.append(_sample(engine, plan, res))
        for out in engine.emit(engine.land(launched)):
            c.tokens += len(out.new_token_ids)
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                inflight.discard(out.request_id)
        if res is not None:
            _count_drafts(c, res)
    c.elapsed_s = time.perf_counter() - t0
    rates = getattr(engine.scheduler.policy, "branch_rates", None)
    c.branch_rates = rates.table() if rates is not None else {}
    return c


def _sample(engine, plan, res) -> StepSample:
    decode = all(s.sampling and s.num_new_tokens == 1 for s in plan.scheduled)
    n = len(plan.scheduled)
    ctx = -(-sum(s.request.num_tokens for s in plan.scheduled) // max(n, 1))
    width = res.verified_width if res is not None else 1
    target = (res.forward_seconds + res.sample_seconds + res.prepare_seconds) if res else 0.0
    skips = tuple(r.skip_reason or "no_match" for r in (res.results if res else [])
                  if r.num_draft_tokens == 0 and r.token_ids)
    return StepSample(plan.step_k, width, decode, n, ctx, target,
                      _predicted(engine, n, ctx, width) if decode else None,
                      res.draft_seconds if res else 0.0, plan.schedule_seconds, skips)


def _count_drafts(c: Census, res) -> None:
    for r in res.results:
        if r.num_draft_tokens:
            c.draft_request_steps += 1
            c.drafted_tokens += r.num_draft_tokens
            c.accepted_tokens += r.num_accepted_tokens
            nodes = getattr(r, "num_tree_nodes", 0)
            if nodes:
                c.tree_request_steps += 1
                c.tree_nodes += nodes
                c.tree_accepted += r.num_accepted_tokens


def markdown(report: dict, settings: dict) -> str:
    lines = [f"census: {settings['flags'] or '(plain)'} on {settings['workload']} seed "
             f"{settings['seed']}, {settings['num_prompts']} prompts, c{settings['concurrency']}",
             f"tokens {report['tokens']} in {report['elapsed_s']:.2f} s = "
             f"{report['tokens_per_s'] or 0:.2f} tok/s over {report['steps']} steps",
             f"steps by K: {report['steps_by_k']}",
             f"K=0 steps by reason: {report['k0_steps_by_reason'] or '-'}",
             "", "| width | steps | median run ms | table ms | run/table | batch | ctx |",
             "|---|---|---|---|---|---|---|"]
    for w, row in report["widths"].items():
        lines.append(f"| {w} | {row['steps']} | {_ms(row['median_run_s'])} | "
                     f"{_ms(row['median_table_s'])} | {_num(row['run_over_table'])} | "
                     f"{_num(row['median_batch'], '.0f')} | {_num(row['median_ctx'], '.0f')} |")
    lines += ["",
              f"draft seconds: total {report['draft_s_total']:.3f}, per K>0 step "
              f"{_ms(report['draft_s_per_k_step'])} ms, per K=0 step "
              f"{_ms(report['draft_s_per_k0_step'])} ms (K=0 total "
              f"{report['draft_s_on_k0_steps_total']:.4f} s)",
              f"schedule ms per step (median): {_ms(report['schedule_s_per_step'])}",
              f"drafts: {report['draft_request_steps']} request-steps, "
              f"{report['drafted_tokens']} drafted, {report['accepted_tokens']} accepted; "
              f"tree request-steps {report['tree_request_steps']} ({report['tree_nodes']} nodes, "
              f"{report['tree_accepted_tokens']} accepted); branch acceptance by depth and rank "
              f"(goodput policy): {report['branch_rates'] or '-'}"]
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def register(bsub) -> None:
    from dynaspec.bench.workloads import WORKLOADS
    from dynaspec.engine_flags import add_engine_args

    p = bsub.add_parser("census", help="step census of one engine on held-out prompts",
                        description=__doc__)
    p.add_argument("--workload", default="code_edit", choices=WORKLOADS)
    p.add_argument("--seed", type=int, default=1234,
                   help="workload choice and per-request seeds (default 1234: not the seed 0 the "
                   "project's benchmarks and tables were tuned on)")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up requests")
    p.add_argument("--json", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run_census_cmd)


def run_census_cmd(args) -> int:
    import json
    import shlex
    import sys
    from dataclasses import replace

    from dynaspec.bench.compare import make_params
    from dynaspec.bench.workloads import load_workload
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine
    from dynaspec.engine_flags import engine_kwargs

    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    kw = {**engine_kwargs(args), "enable_prefix_caching": False}
    engine = LLMEngine(EngineConfig.from_kwargs(**kw))
    items = load_workload(args.workload, engine.tokenizer, args.num_prompts, args.seed)
    params = make_params(items, args.max_tokens, args.temperature, args.seed)
    if args.warmup:
        n = min(args.warmup, len(items))
        run_census(engine, items[:n], [replace(p, max_tokens=min(8, p.max_tokens))
                                       for p in params[:n]], 1, "warm")
    engine.reset_drafter_cache()
    report = run_census(engine, items, params, args.concurrency).to_json()
    flags = [a for a in sys.argv[1:] if a not in ("bench", "census")]
    settings = {"workload": args.workload, "seed": args.seed, "num_prompts": len(items),
                "concurrency": args.concurrency, "flags": shlex.join(flags)}
    print(json.dumps({"settings": settings, **report}) if args.json
          else markdown(report, settings))
    return 0
