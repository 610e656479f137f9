"""The overload, abort-storm and soak reliability scenarios (see reliability.py).

`scale` multiplies prompt lengths (in words) and, less, max_tokens, so the tests can run the same
scenario on a tiny model with a short context.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from typing import Any

from dynaspec.bench.local_server import LocalServer, client, complete, prompt_text
from dynaspec.bench.stats import latency_summary


async def _gather_bounded(coros: list, concurrency: int) -> list:
    sem = asyncio.Semaphore(concurrency)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


# ---- overload ------------------------------------------------------------------------------------
def _n(x: int, scale: float) -> int:
    return max(1, round(x * scale))


def run_overload(server: LocalServer, engine_kwargs: dict, num_requests: int, seed: int,
                 scale: float = 1.0) -> dict:
    rng = random.Random(seed)
    max_tokens = 24  # not scaled: decoding growth is what forces preemptions
    prompts = [prompt_text(rng, rng.randint(_n(120, scale), _n(220, scale)))
               for _ in range(num_requests)]
    bodies = [{"model": server.model_name, "prompt": p, "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True} for p in prompts]
    t0 = time.monotonic()

    async def go() -> list:
        async with client(num_requests, 900) as http:  # all at once: that is the overload
            return await asyncio.gather(*(complete(http, server.url, b) for b in bodies))

    results = asyncio.run(go())
    seconds = time.monotonic() - t0
    preemptions = server.on_engine(lambda e: e.scheduler.num_preemptions)
    pool = server.on_engine(lambda e: e.kv.num_blocks)
    leaks = server.leak_report()
    failed = [r for r in results if r.get("status") != 200 or "text" not in r]
    ref_engine, ref = unloaded_reference(engine_kwargs, prompts, max_tokens,
                                         server.async_engine.tokenizer)
    mismatches: list[tuple[int, float]] = []  # (request, logprob gap)
    near_ties: list[tuple[int, float]] = []
    for i, (r, out) in enumerate(zip(results, ref)):
        if "text" in r and r["text"] != out.text:
            gap = divergence_gap(ref_engine, out.prompt_token_ids, out.token_ids, r["text"])
            (near_ties if gap < NEAR_TIE else mismatches).append((i, round(gap, 6)))
    checks = {"preemptions happened": preemptions > 0,
              "0 requests lost or failed": not failed and len(results) == num_requests,
              "outputs equal the unloaded greedy run (near ties excepted)": not mismatches,
              "pool whole, no leaked state": leaks["leaks"] == {}}
    return {"requests": num_requests, "kv_blocks": pool, "preemptions": preemptions,
            "failed": len(failed), "failed_examples": [str(f)[:300] for f in failed[:3]],
            "mismatches": len(mismatches), "mismatch_examples": mismatches[:5],
            "near_ties": near_ties, "reference_preemptions": ref_engine.scheduler.num_preemptions,
            "seconds": round(seconds, 1), **leaks, "checks": checks}


NEAR_TIE = 1e-4  # docs/design.md §9: a divergence where the reference's top-2 logits are this close


def unloaded_reference(engine_kwargs: dict, prompts: list[str], max_tokens: int,
                       tokenizer: Any) -> tuple:
    """(engine, greedy outputs) with a pool large enough that nothing is preempted, 16 at a
    time. The engine is left idle, with prefix caching off, for divergence_gap."""
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine
    from dynaspec.engine.sync_driver import generate
    from dynaspec.sampling_params import SamplingParams

    bs = engine_kwargs.get("block_size", 16)
    longest = max(len(tokenizer.encode(p)) for p in prompts) + max_tokens + bs
    kw = {**engine_kwargs, "num_kv_blocks": 16 * math.ceil(longest / bs) + 1, "max_num_seqs": 16,
          "enable_prefix_caching": False}
    engine = LLMEngine(EngineConfig.from_kwargs(**kw))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return engine, generate(engine, prompts, [params] * len(prompts))


def divergence_gap(engine: Any, prompt_ids: list[int], ref_ids: list[int], text: str) -> float:
    """Top-2 logit gap of the reference at the first output token the server's text leaves."""
    import torch

    from dynaspec.attention.paged import build_metadata

    tok = engine.tokenizer
    i = next((j for j in range(len(ref_ids)) if not text.startswith(tok.decode(ref_ids[: j + 1]))),
             len(ref_ids) - 1)
    ids = prompt_ids + ref_ids[:i]
    n, bs, dev = len(ids), engine.kv.block_size, engine.parts.model.device
    # The engine is idle: its first blocks are free scratch space for one plain prefill.
    md = build_metadata([n], [n], [list(range(-(-n // bs)))], bs, dev)
    logits = engine.parts.model.forward(
        torch.tensor(ids, device=dev),
        torch.arange(n, device=dev),
        engine.runner.kv_caches,
        md,
        torch.tensor([n - 1], device=dev),
    )
    top2 = torch.topk(logits[0].float(), 2).values
    return float(top2[0] - top2[1])


# ---- abort storm ---------------------------------------------------------------------------------
def _abort_plan(rng: random.Random, i: int, model: str,
                scale: float) -> tuple[dict, int | None, float | None]:
    """A request and where its client leaves: after n streamed chunks, or after a delay."""
    kind = rng.choice(("queued", "prefill", "stream", "non_stream"))
    words = rng.randint(_n(500, scale), _n(1000, scale)) if kind == "prefill" else \
        rng.randint(_n(5, scale), _n(80, scale))
    body = {"model": model, "prompt": prompt_text(rng, words),
            # Outputs shrink less than prompts: a request must live long enough to be cut.
            "max_tokens": rng.randint(_n(48, max(scale, 0.5)), _n(128, max(scale, 0.5))),
            "temperature": rng.choice((0.0, 0.8)), "seed": i, "ignore_eos": True,
            "stream": kind != "non_stream"}
    if kind == "stream":
        return body, rng.randint(1, 6), None
    delay = {"queued": rng.uniform(0.05, 0.5), "prefill": rng.uniform(0.1, 1.0),
             "non_stream": rng.uniform(0.0, 1.5)}[kind]
    return body, None, delay


def run_abort(server: LocalServer, num_requests: int, seed: int, concurrency: int = 32,
              scale: float = 1.0) -> dict:
    rng = random.Random(seed)
    plans = [_abort_plan(rng, i, server.model_name, scale) for i in range(num_requests)]
    aborted_before = server.on_engine(lambda e: dict(e.recorder.aborts_by_phase))
    t0 = time.monotonic()

    async def one(http: Any, body: dict, cut: int | None, delay: float | None) -> dict:
        try:
            return await asyncio.wait_for(complete(http, server.url, body, cut), delay)
        except TimeoutError:
            return {"status": 200, "cut": True}

    async def go() -> list:
        async with client(concurrency, 600) as http:
            return await _gather_bounded([one(http, *p) for p in plans], concurrency)

    results = asyncio.run(go())
    leaks = server.leak_report()
    phases = server.on_engine(lambda e: dict(e.recorder.aborts_by_phase))
    aborted = {k: v - aborted_before.get(k, 0) for k, v in sorted(phases.items())}
    failed = [r for r in results if r.get("status") != 200 or "error" in r]
    cut = sum(1 for r in results if r.get("cut"))
    checks = {"0 leaked blocks": leaks["held"]["kv_blocks_held"] == 0,
              "0 leaked per-request state": leaks["leaks"] == {},
              "no request failed": not failed,
              "a normal request answers afterwards": server.normal_request() == "ok"}
    return {"requests": num_requests, "cut_by_client": cut,
            "aborted_in_engine": sum(aborted.values()), "aborted_where": aborted,
            "finished_before_cut": num_requests - cut, "failed": len(failed),
            "failed_examples": [str(f)[:300] for f in failed[:3]],
            "seconds": round(time.monotonic() - t0, 1), **leaks, "checks": checks}


# ---- soak
# ------------------------------------------------------------------------------------------
def rss_mb() -> float:
    """Resident set size of this process (the server runs in it), from /proc."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak: best available


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(samples) < 2:
        return None
    n = len(samples)
    mt, mr = sum(t for t, _ in samples) / n, sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (r - mr) for t, r in samples) / var if var else None


def run_soak(server: LocalServer, duration_s: float, concurrency: int, seed: int,
             sample_every_s: float = 10.0, max_requests: int = 10**6, scale: float = 1.0) -> dict:
    t0 = time.monotonic()
    deadline = t0 + duration_s
    latencies: list[float] = []
    errors: list[str] = []
    samples: list[tuple[float, float]] = [(0.0, rss_mb())]
    sent = 0

    async def worker(http: Any, w: int) -> None:
        nonlocal sent
        local = random.Random(seed * 1000 + w)
        while time.monotonic() < deadline and sent < max_requests:
            sent += 1
            words = local.randint(_n(5, scale), _n(300, scale))
            body = {"model": server.model_name, "prompt": prompt_text(local, words),
                    "max_tokens": _n(local.choice((8, 16, 32, 64, 128)), scale), "seed": sent,
                    "temperature": local.choice((0.0, 0.7)), "stream": local.random() < 0.5}
            r = await complete(http, server.url, body)
            if r.get("status") != 200 or "error" in r:
                errors.append(str(r)[:300])
            else:
                latencies.append(r["latency_s"])

    async def sampler() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(sample_every_s, max(0.0, deadline - time.monotonic())))
            samples.append((time.monotonic() - t0, rss_mb()))

    async def go() -> None:
        async with client(concurrency, 600) as http:
            await asyncio.gather(sampler(), *(worker(http, w) for w in range(concurrency)))

    asyncio.run(go())
    leaks = server.leak_report()
    warm_s = min(60.0, duration_s / 4)  # the first minute fills caches and pools: not a leak
    slope = slope_mb_per_min([s for s in samples if s[0] >= warm_s])
    checks = {"0 errors": not errors, "pool whole, no leaked state": leaks["leaks"] == {},
              "a normal request answers afterwards": server.normal_request() == "ok"}
    return {
        "duration_s": duration_s,
        "concurrency": concurrency,
        "requests": len(latencies) + len(errors),
        "errors": len(errors),
        "error_examples": errors[:3],
        "latency_s": latency_summary(latencies),
        "rss_mb_samples": [round(r, 1) for _, r in samples],
        "rss_slope_mb_per_min": None if slope is None else round(slope, 3),
        "rss_slope_after_s": warm_s,
        "seconds": round(time.monotonic() - t0, 1),
        **leaks,
        "checks": checks,
    }
