"""`dynaspec bench reliability --scenario S`: correctness under faults and load.

Each scenario starts the server in this process on 127.0.0.1 (a free port; no traffic leaves
the host), drives it over HTTP with bounded loops (a request count and a time limit), and ends
with the checks it exists for; the exit status is 1 when any check fails.
- fuzz (reliability_fuzz.py): schemathesis from /openapi.json, 0 5xx, OpenAI-shaped 4xx.
- overload: a pool of a few hundred blocks, many concurrent long prompts: preemptions happen,
  nothing is lost or fails, every output equals an unloaded greedy run (a near tie at the first
  divergence is reported, docs/design.md §9), the pool is whole afterwards.
- abort: requests cut by their clients at random points (queued, in prefill, mid-stream,
  between verify steps): 0 leaked blocks and 0 leaked per-request state.
- disconnect (reliability_disconnect.py): 500 streamed requests at c64, 5% of the clients leave
  mid-stream: every other request completes, the pool is whole, /metrics accounts for all.
- soak: fixed concurrency for a duration, mixed lengths, n-gram with a variable schedule:
  0 errors, RSS sampled every 10 s (slope reported), latency percentiles.
- rank-kill / rank-stop (reliability_dp.py): 2 data-parallel ranks under streaming load, rank 1
  killed (SIGKILL) or stopped (SIGSTOP) a third of the way in: completed / re-queued / failed,
  the survivor's longest inter-token gap, the time to full strength (§7d).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dynaspec.bench.local_server import LocalServer

SCENARIOS = ("fuzz", "overload", "abort", "disconnect", "soak", "rank-kill", "rank-stop")
# Engine flags each scenario sets unless given on the command line (a flag left at its global
# default counts as not given).
SCENARIO_ENGINE: dict[str, dict[str, Any]] = {
    "fuzz": {"max_model_len": 64, "num_kv_blocks": 512},
    "overload": {"num_kv_blocks": 256, "max_model_len": 1024, "dtype": "float32"},
    "abort": {"speculator": "ngram", "num_spec_tokens": 4, "max_num_batched_tokens": 256,
              "max_num_seqs": 16, "num_kv_blocks": 512, "max_model_len": 2048},
    "disconnect": {"num_kv_blocks": 2048, "max_model_len": 2048},
    "soak": {"speculator": "ngram", "k_schedule": "[[1, 8, 4], [9, 32, 2], [33, null, 1]]",
             "num_kv_blocks": 2048, "max_model_len": 2048},
    "rank-kill": {"data_parallel_size": 2, "speculator": "ngram", "num_spec_tokens": 3,
                  "num_kv_blocks": 1024, "max_model_len": 1024},
    # Declared stopped when its heartbeat goes silent (--dp-heartbeat-timeout); the exchange
    # timeout stays at its default, a backstop that would take seconds longer.
    "rank-stop": {"data_parallel_size": 2, "speculator": "ngram", "num_spec_tokens": 3,
                  "num_kv_blocks": 1024, "max_model_len": 1024},
}


# ---- command line ------------------------------------------------------------------------------
def register(bsub: Any) -> None:
    from dynaspec.engine_flags import add_engine_args

    p = bsub.add_parser("reliability", help="correctness under fuzzing, overload, aborts, soak",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--requests", type=int, default=None,
                   help="fuzz: least requests reaching the engine (2000); overload: concurrent "
                        "requests (300); abort: requests aborted (1000); disconnect: streamed "
                        "requests (500); rank-kill/rank-stop: streamed requests (240)")
    p.add_argument("--duration", type=float, default=600.0, help="soak: seconds (default 600)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="soak, disconnect, rank-kill, rank-stop: concurrent clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_engine_args(p)
    p.set_defaults(func=run_cmd)


def scenario_engine_kwargs(scenario: str, given: dict) -> dict:
    """The scenario's engine flags under the ones given (a flag at its global default is unset)."""
    from dynaspec.engine_flags import parse_engine_args

    defaults = parse_engine_args([])
    out = dict(given)
    for key, value in SCENARIO_ENGINE[scenario].items():
        if given.get(key) == defaults.get(key):
            out[key] = value
    return out


def run_scenario(scenario: str, engine_kwargs: dict, requests: int | None = None,
                 duration_s: float = 600.0, concurrency: int = 64, seed: int = 0,
                 scale: float = 1.0) -> dict:
    """Run one scenario; `scale` shortens prompts and outputs (tests on tiny models)."""
    from dynaspec.extras import require, require_extra

    require_extra("server", "bench reliability")
    require("httpx", "bench", "bench reliability")
    if scenario == "fuzz":
        require("schemathesis", "bench", "the fuzz scenario")
    from dynaspec.bench import reliability_load as load
    from dynaspec.bench.reliability_fuzz import run_fuzz

    default_n = {"fuzz": 2000, "overload": 300, "abort": 1000, "disconnect": 500, "soak": 0,
                 "rank-kill": 240, "rank-stop": 240}[scenario]
    n = default_n if requests is None else requests
    with LocalServer(engine_kwargs) as server:
        if scenario == "fuzz":
            result = run_fuzz(server, n, seed)
        elif scenario == "overload":
            result = load.run_overload(server, engine_kwargs, n, seed, scale)
        elif scenario == "abort":
            result = load.run_abort(server, n, seed, scale=scale)
        elif scenario == "disconnect":
            from dynaspec.bench.reliability_disconnect import run_disconnect

            result = run_disconnect(server, n, concurrency, seed, scale=scale)
        elif scenario in ("rank-kill", "rank-stop"):
            from dynaspec.bench.reliability_dp import run_rank_loss

            result = run_rank_loss(server, n, concurrency, seed, scenario.split("-")[1], scale)
        else:
            result = load.run_soak(server, duration_s, concurrency, seed,
                                   sample_every_s=min(10.0, duration_s / 2), scale=scale)
    result["scenario"] = scenario
    result["ok"] = all(result["checks"].values())
    return result


def run_cmd(args: argparse.Namespace) -> int:
    from dynaspec.engine_flags import engine_kwargs

    kwargs = scenario_engine_kwargs(args.scenario, engine_kwargs(args))
    result = run_scenario(args.scenario, kwargs, args.requests, args.duration, args.concurrency,
                          args.seed)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(report(result))
    return 0 if result["ok"] else 1


def report(result: dict) -> str:
    skip = {"checks", "ok", "held", "scenario"}
    lines = [f"reliability {result['scenario']}: {'PASS' if result['ok'] else 'FAIL'}"]
    lines += [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in result["checks"].items()]
    lines += [f"  {k}: {v}" for k, v in result.items() if k not in skip and v not in ([], {}, None)]
    return "\n".join(lines)
