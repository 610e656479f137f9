"""Bounded data-parallel stress on loopback: DP=N beside DP=1, same prompts, greedy.

    python -m dynaspec.bench.dp_stress --model default --dtype float32 --speculator ngram \\
        --num-spec-tokens 3 --data-parallel-size 2 --concurrency 7,16 --rounds 3 \\
        --requests-per-round 340 --max-tokens 8

Starts two servers in this process on 127.0.0.1 (one with ``--data-parallel-size 1``, one with
N ranks), then for each round and each concurrency runs the same requests against both, the
arms alternating (A B A B, docs/design.md §8). Every request is a non-streamed greedy completion of
one
of a fixed set of prompts, so each request's text must equal the DP=1 text for the same prompt.
Prints one JSON line per (round, concurrency, arm) and a summary: requests, failures, output
mismatches, throughput per arm and the DP/DP=1 ratio. Exit status 1 on any failure or mismatch.
On a machine with few cores data parallelism is about semantics, not speed: the ranks share
the cores one engine would use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from typing import Any

import httpx

from dynaspec.bench.load_test import PROMPTS
from dynaspec.engine_flags import add_engine_args, engine_kwargs

NUM_PROMPTS = 64  # distinct prompts; request i uses prompt i % NUM_PROMPTS


def _prompt(i: int) -> str:
    return f"{PROMPTS[i % len(PROMPTS)]} (variant {i % NUM_PROMPTS // len(PROMPTS)})"


class _Server:
    def __init__(self, name: str, **kwargs) -> None:
        from dynaspec.server.api_server import build_app, build_async_engine
        from dynaspec.server.launch import make_server

        self.async_engine = build_async_engine(name, **kwargs)
        app = build_app(self.async_engine, name)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(app, self.async_engine, drain_s=1.0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        stop = getattr(self.async_engine.engine, "shutdown", None)
        if stop is not None:
            stop()


async def _round(url: str, model: str, n: int, concurrency: int, max_tokens: int, offset: int):
    texts: dict[int, str] = {}
    failures: list[str] = []
    tokens = 0
    next_i = iter(range(n))

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for i in next_i:
            j = offset + i
            body = {"model": model, "prompt": _prompt(j), "max_tokens": max_tokens,
                    "temperature": 0}
            try:
                r = await http.post("/v1/completions", json=body)
                data = r.json()
                if r.status_code != 200:
                    failures.append(f"HTTP {r.status_code}: {data}")
                    continue
                texts[j] = data["choices"][0]["text"]
                tokens += data["usage"]["completion_tokens"]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return texts, failures, tokens, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynaspec.bench.dp_stress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="7,16", help="comma-separated concurrencies")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests-per-round", type=int, default=340,
                   help="requests per (round, concurrency) per arm")
    p.add_argument("--max-tokens", type=int, default=8)
    add_engine_args(p)
    args = p.parse_args(argv)
    kwargs = engine_kwargs(args)
    dp = kwargs["data_parallel_size"]
    if dp < 2:
        p.error("--data-parallel-size must be >= 2 (the DP=1 arm is always run beside it)")
    concs = [int(c) for c in args.concurrency.split(",")]
    name = "stress"
    arms = {1: _Server(name, **{**kwargs, "data_parallel_size": 1}), dp: _Server(name, **kwargs)}
    reference: dict[int, str] = {}  # prompt index -> DP=1 text
    totals: dict[int, dict[str, Any]] = {
        a: {"requests": 0, "failed": 0, "mismatched": 0, "tps": []} for a in arms}
    try:
        offset = 0
        for rnd in range(args.rounds):
            for conc in concs:
                for arm, server in arms.items():
                    texts, failures, tokens, wall = asyncio.run(_round(
                        server.url, name, args.requests_per_round, conc, args.max_tokens, offset))
                    mism = 0
                    for j, text in texts.items():
                        ref = reference.setdefault(j % NUM_PROMPTS, text)
                        mism += text != ref
                    t = totals[arm]
                    t["requests"] += args.requests_per_round
                    t["failed"] += len(failures)
                    t["mismatched"] += mism
                    t["tps"].append(tokens / wall)
                    print(json.dumps({"round": rnd, "concurrency": conc, "data_parallel_size": arm,
                                      "requests": args.requests_per_round, "failed": len(failures),
                                      "mismatched": mism, "output_tokens_per_s": tokens / wall,
                                      "first_failure": failures[0] if failures else None}),
                          flush=True)
                offset += args.requests_per_round
    finally:
        for server in arms.values():
            server.stop()
    ratios = [b / a for a, b in zip(totals[1]["tps"], totals[dp]["tps"])]
    summary = {a: {k: (statistics.mean(v) if k == "tps" else v) for k, v in t.items()}
               for a, t in totals.items()}
    print(json.dumps({"summary": summary, "dp_over_dp1_throughput": statistics.mean(ratios),
                      "note": "paired by (round, concurrency); DP on few cores shares them"}))
    bad = any(t["failed"] or t["mismatched"] for t in totals.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
