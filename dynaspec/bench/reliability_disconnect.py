"""The disconnect scenario (see reliability.py): nothing lost under load when clients leave.

`requests` streamed completions at `concurrency`; a share of the clients (5% by default) close
their connection mid-stream, after a few chunks. Every other request must complete with all its
tokens, the pool must be whole afterwards, and `/metrics` must account for every request: the
ended-requests counter (server/request_outcomes.py) grows by exactly the number sent, its abort
count is the number of clients that left before their request finished, the generated-token
counter covers every streamed token, and the running/waiting gauges and KV usage are back at 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from dynaspec.bench.local_server import LocalServer, client, prompt_text
from dynaspec.bench.served_probe import family, scrape


async def _stream(http: Any, url: str, body: dict, cut_after: int | None) -> dict:
    """One streamed completion; leaves (closes the connection) after `cut_after` text chunks."""
    chunks, tokens, finish = 0, None, None
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "error": (await resp.aread())[:300].decode()}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"status": 200, "error": obj["error"]["message"]}
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices", ()):
                chunks += bool(choice.get("text"))
                finish = choice.get("finish_reason") or finish
            if cut_after is not None and chunks >= cut_after:
                return {"status": 200, "cut": True, "chunks": chunks}
    return {"status": 200, "chunks": chunks, "tokens": tokens, "finish": finish}


def run_disconnect(server: LocalServer, num_requests: int, concurrency: int, seed: int,
                   cut_share: float = 0.05, max_tokens: int = 32, scale: float = 1.0) -> dict:
    rng = random.Random(seed)
    words = (max(1, round(40 * scale)), max(2, round(160 * scale)))
    bodies = [{"model": server.model_name, "prompt": prompt_text(rng, rng.randint(*words)),
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for _ in range(num_requests)]
    cut_ids = set(rng.sample(range(num_requests), round(num_requests * cut_share)))
    # Mid-stream: after 1 to half of max_tokens chunks (a chunk carries >= 1 token).
    cuts = {i: rng.randint(1, max(1, max_tokens // 2)) for i in cut_ids}
    before = scrape(server.url)
    aborted_before = server.on_engine(lambda e: server.async_engine.num_aborted)
    t0 = time.monotonic()

    async def go() -> list:
        sem = asyncio.Semaphore(concurrency)
        async with client(concurrency, 900) as http:
            async def one(i: int) -> dict:
                async with sem:
                    return await _stream(http, server.url, bodies[i], cuts.get(i))
            return await asyncio.gather(*(one(i) for i in range(num_requests)))

    results = asyncio.run(go())
    seconds = time.monotonic() - t0
    leaks = server.leak_report()
    after = scrape(server.url)
    aborted = server.on_engine(lambda e: server.async_engine.num_aborted) - aborted_before
    return _judge(results, cuts, before, after, aborted, leaks, max_tokens, seconds)


def _judge(results: list[dict], cuts: dict[int, int], before: dict, after: dict, aborted: int,
           leaks: dict, max_tokens: int, seconds: float) -> dict:
    kept = [r for i, r in enumerate(results) if i not in cuts]
    incomplete = [r for r in kept if r.get("tokens") != max_tokens or r.get("finish") != "length"]
    left = sum(1 for i in cuts if results[i].get("cut"))
    ended = {k: v - family(before, "request_success_total", "finished_reason").get(k, 0.0)
             for k, v in family(after, "request_success_total", "finished_reason").items()}
    gen = sum(family(after, "generation_tokens_total").values()) - \
        sum(family(before, "generation_tokens_total").values())
    streamed = sum(r["tokens"] for r in kept if r.get("tokens"))
    gauges = {name: sum(family(after, name).values()) for name in
              ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
    checks = {
        "every request not cut completed with all its tokens": not incomplete,
        "every cut client left mid-stream": left == len(cuts),
        "0 leaked blocks": leaks["held"]["kv_blocks_held"] == 0,
        "0 leaked per-request state": leaks["leaks"] == {},
        "/metrics: ended requests = requests sent": sum(ended.values()) == len(results),
        "/metrics: aborts = requests aborted in the engine": ended.get("abort", 0) == aborted,
        "/metrics: stop+length = requests that finished": (
            ended.get("length", 0) + ended.get("stop", 0) == len(results) - aborted),
        "/metrics: generated tokens cover every streamed token": gen >= streamed,
        "/metrics: running, waiting and KV usage back at 0": not any(gauges.values()),
    }
    return {"requests": len(results), "cut_by_client": left, "aborted_in_engine": aborted,
            "completed": len(kept) - len(incomplete), "incomplete": len(incomplete),
            "incomplete_examples": [str(r)[:300] for r in incomplete[:3]],
            "metrics_ended_by_reason": {k: int(v) for k, v in ended.items() if v},
            "metrics_generation_tokens": int(gen), "streamed_tokens": streamed,
            "gauges_after": gauges, "seconds": round(seconds, 1), **leaks, "checks": checks}
