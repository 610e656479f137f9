"""`dynaspec bench reliability --scenario {fuzz,overload,abort,soak,rank-kill,rank-stop}`.

Each scenario starts the server in this process on 127.0.0.1 (a free port; no traffic leaves
the host), drives it over HTTP with bounded loops (a request count and a time limit), and ends
with the checks it exists for; the exit status is 1 when any check fails.
- fuzz (reliability_fuzz.py): schemathesis from /openapi.json, 0 5xx, OpenAI-shaped 4xx.
- overload: a pool of a few hundred blocks, many concurrent long prompts: preemptions happen,
  nothing is lost or fails, every output equals an unloaded greedy run (a near tie at the first
  divergence is reported, docs/design.md §9), the pool is whole afterwards.
- abort: requests cut by their clients at random points (queued, in prefill, mid-stream,
  between verify steps): 0 leaked blocks and 0 leaked per-request state.
- soak: fixed concurrency for a duration, mixed lengths, n-gram with a variable schedule:
  0 errors, RSS sampled every 10 s (slope reported), latency percentiles.
- rank-kill / rank-stop (reliability_dp.py): 2 data-parallel ranks under streaming load, rank 1
  killed (SIGKILL) or stopped (SIGSTOP) a third of the way in: completed / re-queued / failed,
  the survivor's longest inter-token gap, the time to full strength (§7d).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
import time
from typing import Any

SCENARIOS = ("fuzz", "overload", "abort", "soak", "rank-kill", "rank-stop")
# Engine flags each scenario sets unless given on the command line (a flag left at its global
# default counts as not given).
SCENARIO_ENGINE: dict[str, dict[str, Any]] = {
    "fuzz": {"max_model_len": 64, "num_kv_blocks": 512},
    "overload": {"num_kv_blocks": 256, "max_model_len": 1024, "dtype": "float32"},
    "abort": {"speculator": "ngram", "num_spec_tokens": 4, "max_num_batched_tokens": 256,
              "max_num_seqs": 16, "num_kv_blocks": 512, "max_model_len": 2048},
    "soak": {"speculator": "ngram", "k_schedule": "[[1, 8, 4], [9, 32, 2], [33, null, 1]]",
             "num_kv_blocks": 2048, "max_model_len": 2048},
    "rank-kill": {"data_parallel_size": 2, "speculator": "ngram", "num_spec_tokens": 3,
                  "num_kv_blocks": 1024, "max_model_len": 1024},
    # Declared stopped when its heartbeat goes silent (--dp-heartbeat-timeout); the exchange
    # timeout stays at its default, a backstop that would take seconds longer.
    "rank-stop": {"data_parallel_size": 2, "speculator": "ngram", "num_spec_tokens": 3,
                  "num_kv_blocks": 1024, "max_model_len": 1024},
}
_WORDS = ("the river carries light past the old mill while children count the boats and "
          "a baker sings about bread that rises slowly in the morning heat of summer").split()


def prompt_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


class LocalServer:
    """The OpenAI server in a background thread of this process, on 127.0.0.1."""

    def __init__(self, engine_kwargs: dict, model_name: str = "dynaspec") -> None:
        from dynaspec.server.api_server import build_app, build_async_engine
        from dynaspec.server.launch import make_server

        self.model_name = model_name
        self.async_engine = build_async_engine(model_name, **engine_kwargs)
        app = build_app(self.async_engine, model_name)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = make_server(app, self.async_engine, drain_s=0.0, log_level="warning")
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    def __enter__(self) -> LocalServer:
        self._thread.start()
        deadline = time.monotonic() + 120
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def on_engine(self, fn: Any, timeout: float = 120) -> Any:
        return self.async_engine.call(fn).result(timeout)

    def wait_idle(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished_requests()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine still busy after {timeout}s")
            time.sleep(0.05)

    def leak_report(self) -> dict:
        """After the traffic: what the engine still holds. `leaks` lists every non-zero count."""
        self.wait_idle()
        held = self.on_engine(engine_state)
        held["num_streams"] = self.async_engine.state.get("num_streams", 0)
        return {"held": held, "leaks": {k: v for k, v in held.items() if v}}

    def normal_request(self) -> str:
        import httpx

        body = {"model": self.model_name, "prompt": "Hello, my name is", "max_tokens": 4,
                "temperature": 0}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        return "ok" if ok else f"{r.status_code} {r.text[:200]}"


def engine_state(engine: Any) -> dict:
    """Per-request state left in the engine (engine thread only); all 0 when nothing leaked."""
    from dynaspec.spec_decode.drafters.draft_model import DraftModelProposer

    engine.check_integrity()  # raises on a broken pool
    kv, sched, runner = engine.kv, engine.scheduler, engine.runner
    prop = runner.proposer
    state = {
        "kv_blocks_held": kv.num_blocks - kv.num_free_blocks(),
        "scheduler_requests": len(sched.requests) + len(sched.waiting) + len(sched.running),
        "policy_requests": sched.policy.num_cached() if sched.policy is not None else 0,
        "generators": len(runner.generators),
        "metric_records": engine.recorder.num_tracked(),
        "output_states": len(engine.outputs.states),
        "drafter_requests": prop.num_cached() if prop is not None else 0,
    }
    if isinstance(prop, DraftModelProposer):
        state["drafter_kv_blocks_held"] = prop.kv.num_blocks - prop.kv.num_free_blocks()
    return state


async def _complete(http: Any, url: str, body: dict, cut_after_chunks: int | None = None) -> dict:
    """One completion over HTTP (streamed when body says so); `cut_after_chunks` leaves early."""
    t0 = time.monotonic()
    if not body.get("stream"):
        r = await http.post(url + "/v1/completions", json=body)
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.text[:300]}
        out = r.json()
        return {
            "status": 200,
            "text": out["choices"][0]["text"],
            "latency_s": time.monotonic() - t0,
            "finish": out["choices"][0]["finish_reason"],
        }
    chunks, parts, finish = 0, [], None
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "error": (await resp.aread())[:300].decode()}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"status": 200, "error": obj["error"]["message"]}
            parts.append(obj["choices"][0]["text"])
            finish = obj["choices"][0]["finish_reason"] or finish
            chunks += 1
            if cut_after_chunks is not None and chunks >= cut_after_chunks:
                return {"status": 200, "cut": True}
    return {
        "status": 200,
        "text": "".join(parts),
        "latency_s": time.monotonic() - t0,
        "finish": finish,
    }


def _client(concurrency: int, timeout_s: float) -> Any:
    from dynaspec.extras import require

    httpx = require("httpx", "bench", "the reliability scenarios")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)


# ---- command line ------------------------------------------------------------------------------
def register(bsub: Any) -> None:
    from dynaspec.engine_flags import add_engine_args

    p = bsub.add_parser("reliability", help="correctness under fuzzing, overload, aborts, soak",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=SCENARIOS, required=True)
    p.add_argument("--requests", type=int, default=None,
                   help="fuzz: least requests reaching the engine (2000); overload: concurrent "
                        "requests (300); abort: requests aborted (1000); rank-kill/rank-stop: "
                        "streamed requests (240)")
    p.add_argument("--duration", type=float, default=600.0, help="soak: seconds (default 600)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="soak, rank-kill, rank-stop: concurrent clients")
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

    default_n = {"fuzz": 2000, "overload": 300, "abort": 1000, "soak": 0, "rank-kill": 240,
                 "rank-stop": 240}[scenario]
    n = default_n if requests is None else requests
    with LocalServer(engine_kwargs) as server:
        if scenario == "fuzz":
            result = run_fuzz(server, n, seed)
        elif scenario == "overload":
            result = load.run_overload(server, engine_kwargs, n, seed, scale)
        elif scenario == "abort":
            result = load.run_abort(server, n, seed, scale=scale)
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
