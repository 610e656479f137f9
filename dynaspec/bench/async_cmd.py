"""`dynaspec bench async`: --async-scheduling vs the sync step, paired A/B (docs/design.md §8).

For each speculation mode (`none`: no drafter; `ngram`: the `--spec` flags) arm A runs the
engine flags as given (sync step) and arm B the same flags plus `--async-scheduling`; at each
concurrency the arms alternate over `--pairs` pairs on the same prompts and seeds (greedy,
every request decoding `--max-tokens`: the same work in both arms). Per bucket the report gives
the paired tokens/s ratio B/A with its 95% CI, and the sync arm's **time outside the forward**:
wall time minus the forward and verification (`forward` + `sample` phases), i.e. the Python
work (schedule, drafting, inputs, update, detokenize, records) async can overlap. The recovered
share is, pair by pair, (sync wall - async wall) / sync time outside the forward, with a 95% t
interval. On a CPU the forward already uses every core (torch threads), so the overlap competes
with it for cores and for the GIL: the recovered share measures what is left.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from statistics import mean
from typing import Any

_MODES = ("none", "ngram")


def register(bsub) -> None:
    p = bsub.add_parser(
        "async",
        help="--async-scheduling vs sync: paired A/B, time outside the forward",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine", default="--model default", help="engine flags both arms share, in quotes"
    )
    p.add_argument("--spec", default="--speculator ngram --num-spec-tokens 4 --prompt-lookup-min 2",
                   help="speculation flags of the ngram mode, in quotes")
    p.add_argument("--modes", default="none,ngram", help="comma-separated: none, ngram")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--workload", default="chat", help="chat: short prompts, decode-bound")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per run (default: max(8, concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="folder for async.json (every run) and async.md")
    p.set_defaults(func=run_async_cmd)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def outside_forward(phase_s: dict, elapsed_s: float) -> float:
    """Wall time of a run not spent in the target forward and verification."""
    return max(0.0, elapsed_s - phase_s.get("forward", 0.0) - phase_s.get("sample", 0.0))


def recovered_share(sync_runs, async_runs) -> dict:
    """Per pair (sync wall - async wall) / sync time outside the forward; mean and 95% t CI."""
    from dynaspec.bench.stats import t_quantile

    outside = [outside_forward(s.phase_s, s.elapsed_s) for s in sync_runs]
    shares = [
        (s.elapsed_s - a.elapsed_s) / o for s, a, o in zip(sync_runs, async_runs, outside) if o > 0
    ]
    out: dict[str, Any] = {"sync_outside_forward_s": outside,
           "sync_outside_share": [o / s.elapsed_s for o, s in zip(outside, sync_runs)],
           "recovered": shares, "recovered_mean": mean(shares) if shares else None, "ci95": None}
    if len(shares) >= 2:
        sd = math.sqrt(sum((x - out["recovered_mean"]) ** 2 for x in shares) / (len(shares) - 1))
        half = t_quantile(0.975, len(shares) - 1) * sd / math.sqrt(len(shares))
        out["ci95"] = [out["recovered_mean"] - half, out["recovered_mean"] + half]
    return out


def _arms(args: argparse.Namespace, mode: str) -> dict:
    from dynaspec.bench.compare import EngineArm
    from dynaspec.engine_flags import parse_engine_args

    flags = args.engine + (" " + args.spec if mode == "ngram" else "")
    kw = parse_engine_args(shlex.split(flags))
    kw["enable_prefix_caching"] = False  # repeated prompts would be cached from run 2 on
    _say(f"loading arms ({mode}): {flags} [sync | async]")
    return {"a": EngineArm(flags, kw),
            "b": EngineArm(flags + " --async-scheduling", {**kw, "async_scheduling": True})}


def _bucket(args, arms, items_all, mode: str, c: int) -> dict:
    from dataclasses import replace

    from dynaspec.bench.compare import make_params, run_pairs
    from dynaspec.bench.compare_report import build_report

    n = args.num_prompts or max(8, c)
    items = [items_all[i % len(items_all)] for i in range(n)]
    # ignore_eos: every request decodes max_tokens, so both arms do the same work every pair.
    params = make_params(items, args.max_tokens, 0.0, args.seed, ignore_eos=True)
    for name, arm in arms.items():  # warm-up (unmeasured): kernels, allocator, the worker
        arm.run(items[:c], [replace(p, max_tokens=8) for p in params[:c]], c, f"{name}-warm")
    records = run_pairs(arms, items, params, c, args.pairs, "alternate",
                        lambda r: _say(f"{mode} c={c} pair {r.pair} arm {r.arm}: "
                                       f"{r.tokens_per_s:.2f} tok/s"))
    settings = {
        "workload": args.workload,
        "num_prompts": n,
        "max_tokens": args.max_tokens,
        "concurrency": c,
        "pairs": args.pairs,
        "order": "alternate",
        "temperature": 0.0,
        "seed": args.seed,
        "mode": mode,
        "ignore_eos": True,
        "command": "dynaspec " + shlex.join(sys.argv[1:]),
    }
    report = build_report(arms, records, settings, None)
    sync = [r for r in records if r.arm == "a"]
    asyn = [r for r in records if r.arm == "b"]
    report["outside_forward"] = recovered_share(sync, asyn)
    return report


def run_async_cmd(args: argparse.Namespace) -> int:
    from dynaspec.bench.workloads import load_workload

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in _MODES]
    if bad or args.pairs < 1:
        raise ValueError(f"--modes takes {', '.join(_MODES)} (got {bad}); --pairs must be >= 1")
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    out: dict = {"results": {}}
    rows = []
    for mode in modes:
        arms = _arms(args, mode)
        items_all = load_workload(args.workload, arms["a"].tokenizer,
                                  args.num_prompts or max(8, *concurrencies), args.seed, False)
        for c in concurrencies:
            report = _bucket(args, arms, items_all, mode, c)
            out["results"][f"{mode}/c{c}"] = report
            rows.append((mode, c, report))
        for arm in arms.values():  # free the model before the next mode loads its arms
            arm.engine.driver.close()
        del arms
    md = markdown(rows)
    if args.out:
        import os
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "async.json"), "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        with open(os.path.join(args.out, "async.md"), "w", encoding="utf-8") as fh:
            fh.write(md + "\n")
    print(json.dumps(out) if args.json else md)
    return 0


def markdown(rows) -> str:
    def num(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    lines = [
        "| mode | concurrency | sync tok/s | async tok/s | async/sync (95% CI) | "
        "sync time outside forward (share) | recovered by async (95% CI) | outputs identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, c, r in rows:
        o, ratio = r["outside_forward"], r["ratios"]["b"]
        ci = "-" if ratio["lo"] is None else f"[{ratio['lo']:.3f}, {ratio['hi']:.3f}]"
        rci = "-" if o["ci95"] is None else f"[{o['ci95'][0]:.1%}, {o['ci95'][1]:.1%}]"
        same = ratio["outputs_vs_a"]
        lines.append(
            f"| {mode} | {c} | {r['a']['tokens_per_s_mean']:.1f} | "
            f"{r['b']['tokens_per_s_mean']:.1f} | {ratio['ratio']:.3f}x {ci} | "
            f"{mean(o['sync_outside_forward_s']):.2f} s "
            f"({mean(o['sync_outside_share']):.1%}) | {num(o['recovered_mean'], '.1%')} {rci} | "
            f"{same['identical']}/{same['total']} |"
        )
    return "\n".join(lines)
