"""Bounded load test against a running `dynaspec serve` (or any OpenAI-compatible server).

    python -m dynaspec.bench.load_test --url http://127.0.0.1:8000 \\
        --concurrency 32 --num-requests 300 --max-tokens 16

`concurrency` workers send streamed /v1/completions requests until `num-requests` have been sent,
then it stops by itself (also after --max-duration seconds: unsent requests count as errors).
Reports errors, p50/p99 time to first token, inter-token latency (gaps between streamed chunks)
and time per output token (per request), and token throughput. Exit status 1 if any request
failed. Needs only httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynaspec.extras import require

if TYPE_CHECKING:
    import httpx
else:
    httpx = require("httpx", "bench", "the load test")

PROMPTS = [
    "Write a haiku about the sea.", "The capital of France is", "List three prime numbers:",
    "Once upon a time, in a small village,", "def fibonacci(n):", "Explain photosynthesis in",
    "The quick brown fox", "My favourite programming language is", "In 1969, humans first",
    "A good breakfast includes", "The three laws of motion are", "To bake bread you need",
    "The best way to learn is", "Tokyo is a city that", "Rain falls when", "Dear diary, today",
]


@dataclass
class Result:
    ok: bool
    error: str = ""
    ttft_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    e2e_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1)


async def one_request(http: httpx.AsyncClient, args: argparse.Namespace, i: int) -> Result:
    body = {"model": args.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res, last, done = Result(ok=False), t0, False  # last: the previous chunk's time
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return Result(False, f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event, now = json.loads(line[6:]), time.perf_counter()
                if "error" in event:
                    return Result(False, f"stream error: {event['error'].get('message')}")
                if event.get("usage"):
                    res.num_tokens = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices", ())):
                    if res.ttft_s is None:
                        res.ttft_s = now - t0
                    else:
                        res.chunk_gaps_s.append(now - last)
                    last = now
    except (httpx.HTTPError, ValueError) as exc:
        return Result(False, f"{type(exc).__name__}: {exc}")
    res.e2e_s = time.perf_counter() - t0
    res.ok = done
    res.error = "" if done else "stream ended without [DONE]"
    return res


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    results: list[Result] = []
    next_i = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal next_i
        while next_i < args.num_requests:
            i, next_i = next_i, next_i + 1
            results.append(await one_request(http, args, i))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=args.timeout) as http:
        tasks = [asyncio.ensure_future(worker(http)) for _ in range(args.concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=args.max_duration)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    missing = args.num_requests - len(results)
    results += [Result(False, "not completed within --max-duration")] * missing
    return results, wall


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(results: list[Result], wall: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    tokens = sum(r.num_tokens for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "url": args.url, "concurrency": args.concurrency, "num_requests": len(results),
        "max_tokens": args.max_tokens, "ok": len(ok), "errors": len(errors),
        "error_samples": sorted(set(errors))[:5], "wall_s": round(wall, 2),
        "ttft_ms": {"p50": ms(_pct(ttft, 50)), "p99": ms(_pct(ttft, 99))},
        "itl_ms": {"p50": ms(_pct(gaps, 50)), "p99": ms(_pct(gaps, 99))},
        "tpot_ms": {"p50": ms(_pct(tpot, 50)), "p99": ms(_pct(tpot, 99))},
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 2) if wall > 0 else None,
    }


def print_report(s: dict) -> None:
    print(f"requests: {s['num_requests']} ({s['ok']} ok, {s['errors']} errors) at concurrency "
          f"{s['concurrency']}, max_tokens {s['max_tokens']}, in {s['wall_s']} s")
    for msg in s["error_samples"]:
        print(f"  error: {msg}")
    for key, name in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"),
                      ("tpot_ms", "time per output token")):
        print(f"{name:>22}: p50 {s[key]['p50']} ms, p99 {s[key]['p99']} ms")
    print(f"{'throughput':>22}: {s['output_tokens_per_s']} output tok/s, "
          f"{s['requests_per_s']} req/s ({s['output_tokens']} tokens)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dynaspec.bench.load_test", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=1800.0, help="stop after this many s")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.num_requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --num-requests and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, wall = asyncio.run(run(args))
    summary = summarize(results, wall, args)
    print(json.dumps(summary)) if args.json else print_report(summary)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
