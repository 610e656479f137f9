"""`dynaspec tune`: measure, choose K per (batch, context) bucket by goodput, write schedule.json.

Run the result with `--speculator S --k-schedule schedule.json` (the file is the tuned-table
object: the grid the plan uses plus the measurements behind it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dynaspec.bench.workloads import WORKLOADS
from dynaspec.engine_flags import add_engine_args, engine_kwargs

_EPILOG = """\
Example:
  dynaspec tune --model default --speculator ngram --workload code_edit --out schedule.json
  dynaspec bench compare --a "--speculator ngram --num-spec-tokens 4" \\
      --b "--speculator ngram --k-schedule schedule.json" --concurrency 16

Buckets: measured points 1,4,16,64 become ranges split at geometric midpoints
([1,2] [3,8] [9,32] [33,inf)); the same for contexts. The table's context key is the mean
context of the step's decoding requests (see dynaspec/spec/k_policy.py).
"""


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def register(sub) -> None:
    p = sub.add_parser("tune", help="measure goodput and write a tuned K schedule",
                       description=__doc__, epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", default=None, help="schedule JSON to write (required unless --reprofile)"
    )
    p.add_argument("--reprofile", action="store_true",
                   help="measure the goodput policy's step cost cells afresh for these engine "
                   "flags (as `serve` would start), check them and merge them into the cache; "
                   "without --out, only that")
    p.add_argument("--workload", default="code_edit", choices=WORKLOADS, help="for acceptance")
    p.add_argument("--long", action="store_true", help="the workload's long-context variant")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128, help="cap on each acceptance request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-buckets", type=_ints, default=[1, 4, 16, 64])
    p.add_argument("--ctx-buckets", type=_ints, default=[128, 512, 2048])
    p.add_argument("--k-values", type=_ints, default=[0, 1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per bucket (fastest kept)")
    p.add_argument("--margin", type=float, default=0.0,
                   help="K > 0 must beat K = 0's goodput by more than this fraction")
    p.add_argument("--plot", default=None, help="heatmap PNG (default: OUT with .png)")
    p.add_argument("--json", action="store_true", help="print the written object")
    add_engine_args(p)
    p.set_defaults(func=run_tune_cmd)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _engine(args: argparse.Namespace):
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine
    if args.speculator == "none":
        raise ValueError("dynaspec tune needs --speculator ngram, draft or suffix")
    kw = engine_kwargs(args)
    # K = max so one acceptance run covers every K; no schedule, no prefix cache (the timing
    # pass writes synthetic KV into the pool).
    kw.update(num_spec_tokens=max(args.k_values), k_schedule=None, k_policy="table",
              enable_prefix_caching=False)
    return LLMEngine(EngineConfig.from_kwargs(**kw))


def _check(args: argparse.Namespace, max_model_len: int) -> None:
    if max(args.k_values) < 1:
        raise ValueError("--k-values needs at least one K >= 1 to compare against 0")
    if min(args.k_values) < 0 or min(args.batch_buckets) < 1 or min(args.ctx_buckets) < 1:
        raise ValueError("K values must be >= 0, batch and context buckets >= 1")
    if max(args.ctx_buckets) + max(args.k_values) + 1 > max_model_len:
        raise ValueError(
            f"context bucket {max(args.ctx_buckets)} + K does not fit max_model_len {max_model_len}"
        )


def _reprofile(args: argparse.Namespace) -> int:
    """Refresh the cached step cost cells the engine with these flags starts from."""
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine
    if args.speculator == "none":
        raise ValueError(
            "dynaspec tune --reprofile needs a --speculator (the goodput policy's table)"
        )
    kw = engine_kwargs(args)
    kw.update(k_policy="goodput", reprofile_costs=True, cost_table=None)
    info = LLMEngine(EngineConfig.from_kwargs(**kw)).parts.policy_info
    assert info is not None  # a speculating engine reports its K policy
    _say(info.describe())
    return 0 if info.name == "goodput" else 1  # 1: the fresh table failed its checks


def run_tune_cmd(args: argparse.Namespace) -> int:
    if args.reprofile:
        code = _reprofile(args)
        if code or args.out is None:
            return code
    if args.out is None:
        raise ValueError("dynaspec tune needs --out (or --reprofile)")
    from dynaspec.bench import tune
    from dynaspec.bench.compare import make_params
    from dynaspec.bench.workloads import load_workload
    from dynaspec.spec_decode.plan.plan import build_spec_plan
    engine = _engine(args)
    _check(args, engine.max_model_len)
    items = load_workload(args.workload, engine.tokenizer, args.num_prompts, args.seed, args.long)
    params = make_params(items, args.max_tokens, 0.0, args.seed)
    _say(f"acceptance: {len(items)} {args.workload} prompts at K={max(args.k_values)}")
    acc = tune.measure_acceptance(engine, items, params)
    _say(f"  alpha {[round(a, 3) for a in acc['alpha']]}, acceptance rate {acc['acceptance_rate']}")
    _say("step times (runner.execute on synthetic uniform batches):")
    raw = tune.measure_step_times(engine, args.batch_buckets, args.ctx_buckets, args.k_values,
                                  args.repeats, progress=lambda m: _say("  " + m))
    times = {key: m["seconds"] for key, m in raw.items()}
    buckets = tune.make_buckets(args.batch_buckets, args.ctx_buckets)
    choices = tune.choose_k(
        tune.table_step_time(times), acc["alpha"], buckets, args.k_values, args.margin
    )
    measurements = {
        "model": args.model, "speculator": args.speculator, "dtype": str(engine.parts.model.dtype),
        "workload": args.workload, "long": args.long, "k_values": sorted(set(args.k_values) | {0}),
        "margin": args.margin, "acceptance": acc,
        "step_time_s": {f"{b},{c},{k}": v for (b, c, k), v in times.items()},
        "step_notes": {f"{b},{c},{k}": m for (b, c, k), m in raw.items()
                       if m["kv_wrapped"] or m["min_drafted"] < k},
        "command": "dynaspec tune " + " ".join(sys.argv[2:]),
    }
    obj = tune.write_schedule(choices, measurements, args.out)
    plan = build_spec_plan(args.speculator, 0, args.out)  # the file must load as a schedule
    _say(f"wrote {args.out}: plan {plan.summary()}")
    for c in choices:
        _say(f"  batch {c['batch']} ctx {c['ctx']}: K={c['k']} (goodput x{c['gain']:.2f} vs K=0)")
    _plot(args, choices)
    if args.json:
        print(json.dumps(obj))
    return 0


def _plot(args: argparse.Namespace, choices: list[dict]) -> None:
    path = args.plot or os.path.splitext(args.out)[0] + ".png"
    from dynaspec.extras import MissingExtraError

    try:
        from dynaspec.bench.plots import plot_heatmap
        _say(f"wrote {plot_heatmap(choices, path, f'tuned K: {args.speculator}, {args.workload}')}")
    except MissingExtraError as exc:
        _say(f"no heatmap: {exc}")
