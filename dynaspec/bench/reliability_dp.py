"""The rank-loss reliability scenarios (§7d; see reliability.py): `rank-kill` and `rank-stop`.

A data-parallel server (2 ranks unless told otherwise) under sustained streaming load from a
real HTTP client; once a third of the requests have finished, rank 1 is killed (`kill -9`) or
stopped (`SIGSTOP`: its heartbeat goes silent, and after `--dp-heartbeat-timeout` the front end
declares it dead and kills it; the step exchange's `--dp-rank-timeout` is only the backstop).
Reported: requests completed, re-queued (the front end's count), failed (each error must name
the lost rank); the survivors' longest gap between two tokens of one stream while the rank
was lost; the time from the signal to the loss being handled and to full strength (/health
"ok" again, the replacement serving). Checks: every request that had streamed nothing at the
loss completes; only streams that had streamed (and so were on the lost rank, or the survivor)
may fail, and each failure names rank 1 (`had_streamed`: by the engine's count too, not only
the client's at the signal, which misses tokens still in flight); the survivor's gap is within
bound; the replacement serves within 30 s; every rank's KV pool is whole afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import threading
import time
from typing import Any

from dynaspec.bench.local_server import LocalServer, client, prompt_text

KILL_AFTER = 1 / 3  # of the requests finished
GAP_BOUND_S = 3.0  # the survivor's longest inter-token gap, for a kill or a stop (issue 50)
FULL_STRENGTH_BOUND_S = 30.0
# The front end's message for a lost request that had streamed (dp/lost_requests.py).
_ENGINE_STREAMED = re.compile(r"after (\d+) streamed token")


async def _stream(http: Any, url: str, body: dict, rec: dict) -> None:
    """One streamed completion; token chunk times land in rec["times"] as they arrive."""
    rec["times"], rec["start"] = [], time.monotonic()
    try:
        await _read_stream(http, url, body, rec)
    except Exception as exc:  # noqa: BLE001 - a broken connection is a failure to count
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        rec["end"] = time.monotonic()


async def _read_stream(http: Any, url: str, body: dict, rec: dict) -> None:
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            rec["error"] = f"{resp.status_code} {(await resp.aread())[:200].decode()}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                rec["error"] = obj["error"]["message"]
                return
            choice = obj["choices"][0]
            if choice["text"] or choice["finish_reason"] is None:
                rec["times"].append(time.monotonic())
            rec["finish"] = choice["finish_reason"] or rec.get("finish")


def _watch_health(url: str, out: dict, stop: threading.Event) -> None:
    """Polls /health every 0.1 s: when it left "ok" and came back (monotonic times)."""
    import httpx

    while not stop.is_set():
        try:
            status = httpx.get(url + "/health", timeout=5).json().get("status")
        except Exception:  # noqa: BLE001
            status = "unreachable"
        now = time.monotonic()
        if status != "ok" and "degraded_at" not in out:
            out["degraded_at"] = now
        if status == "ok" and "degraded_at" in out and "ok_again_at" not in out:
            out["ok_again_at"] = now
        out.setdefault("statuses", set()).add(status)
        stop.wait(0.1)


def run_rank_loss(server: LocalServer, num_requests: int, concurrency: int, seed: int,
                  how: str, scale: float = 1.0) -> dict:
    """`how`: "kill" (SIGKILL) or "stop" (SIGSTOP) of rank 1 mid-run."""
    rng = random.Random(seed)
    max_tokens = max(8, round(64 * scale))
    bodies = [{"model": server.model_name, "prompt": prompt_text(rng, rng.randint(4, 20)),
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
              for _ in range(num_requests)]
    recs: list[dict] = [{} for _ in bodies]
    pid = server.on_engine(lambda e: e.rank_pids()[1])
    timeout_s = server.on_engine(lambda e: e.config.parallel.dp_heartbeat_timeout_s)
    health: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_health, args=(server.url, health, stop), daemon=True)
    watcher.start()
    signal_at: list[float] = []

    async def go() -> None:
        sem = asyncio.Semaphore(concurrency)
        done = 0
        async with client(concurrency, 900) as http:
            async def one(i: int) -> None:
                nonlocal done
                async with sem:
                    await _stream(http, server.url, bodies[i], recs[i])
                done += 1
                if not signal_at and done >= num_requests * KILL_AFTER:
                    signal_at.append(time.monotonic())
                    for r in recs:  # what each stream had when the rank was lost
                        r["at_signal"] = len(r.get("times", []))
                    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)

            await asyncio.gather(*(one(i) for i in range(num_requests)))

    t0 = time.monotonic()
    asyncio.run(go())
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + 120
    while "ok_again_at" not in health and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    watcher.join(10)
    counts = server.on_engine(lambda e: e.resilience)
    # The longest gap between two heartbeats of one rank the front end saw (the stopped one's
    # silence excepted: its record ends with the loss): the margin under the timeout.
    beat_gap = server.on_engine(lambda e: e.sup.watch.beats.longest_gap_s)
    kv = server.on_engine(lambda e: e.query("kv"))
    server.on_engine(lambda e: e.check_integrity())
    if os.environ.get("DYNASPEC_BENCH_DUMP"):  # every stream's token times, for a closer look
        with open(os.environ["DYNASPEC_BENCH_DUMP"], "w") as f:
            json.dump({"signal_at": signal_at, "streams": recs}, f)
    out = _summary(recs, signal_at[0] if signal_at else None, health, counts, kv, seconds,
                   how, timeout_s)
    out["longest_heartbeat_gap_s"] = round(beat_gap, 3)
    return out


def had_streamed(rec: dict) -> bool:
    """Whether a stream had tokens out when the rank was lost, judged without a race.

    The client's count at the signal (``at_signal``) misses tokens the engine had already sent
    but the client had not yet read, so a failed stream also counts as streamed by the tokens it
    received at any time before its error, or by the engine's own count in that error ("after N
    streamed token(s)"). A stream that ended without an error is judged at the signal only."""
    if rec.get("at_signal", 0) > 0:
        return True
    if "error" not in rec:
        return False
    found = _ENGINE_STREAMED.search(rec["error"])
    return bool(rec.get("times")) or (found is not None and int(found.group(1)) > 0)


def _summary(recs: list[dict], t_sig: float | None, health: dict, counts: Any, kv: list,
             seconds: float, how: str, timeout_s: float) -> dict:
    ok = [r for r in recs if "error" not in r and r.get("finish")]
    failed = [r for r in recs if "error" in r]
    unstreamed = [r for r in recs if not had_streamed(r)]
    # The survivor's streams: in flight across the loss (tokens before and after it), done.
    pairs = [(b - a, a) for r in ok if t_sig is not None and r.get("at_signal", 0) > 0
             and r["times"] and r["times"][-1] > t_sig
             for a, b in zip(r["times"], r["times"][1:])]
    gaps = [g for g, _ in pairs]
    longest, longest_at = max(pairs, default=(0.0, t_sig or 0.0))
    gap_bound = GAP_BOUND_S
    full = (health["ok_again_at"] - t_sig) if t_sig is not None and "ok_again_at" in health \
        else None
    loss = (counts.loss_times[0] - t_sig) if t_sig is not None and counts.loss_times else None
    checks = {
        "rank_lost_once": counts.rank_losses == 1,
        "every_unstreamed_request_completed": all(r in ok for r in unstreamed),
        "failures_name_rank_1": all("data-parallel rank 1" in r["error"] for r in failed),
        "only_streaming_requests_failed": all(had_streamed(r) for r in failed),
        f"survivor_gap_le_{gap_bound:.0f}s": t_sig is not None and longest <= gap_bound,
        f"full_strength_within_{FULL_STRENGTH_BOUND_S:.0f}s":
            full is not None and full <= FULL_STRENGTH_BOUND_S,
        "kv_pools_whole": all(k is not None and k["num_free_blocks"] == k["num_blocks"]
                              for k in kv),
    }
    return {
        "checks": checks,
        "signal": "SIGKILL" if how == "kill" else f"SIGSTOP (dp_heartbeat_timeout_s {timeout_s})",
        "requests": len(recs),
        "completed": len(ok),
        "requeued": counts.requeued,
        "failed": len(failed),
        "failed_by_engine_count": counts.failed,
        "streams_in_flight_at_signal": sum(1 for r in recs if r.get("at_signal", 0) > 0
                                           and r.get("end", 0) > (t_sig or 0)),
        "survivor_longest_gap_s": round(longest, 3),
        "survivor_longest_gap_began_s_after_signal": round(longest_at - t_sig, 2)
        if t_sig is not None else None,
        "survivor_gap_p50_s": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else None,
        "signal_to_loss_handled_s": round(loss, 2) if loss is not None else None,
        "signal_to_full_strength_s": round(full, 2) if full is not None else None,
        "health_statuses_seen": sorted(health.get("statuses", ())),
        "replacements": counts.replacements,
        "seconds": round(seconds, 1),
        "errors_sample": sorted({r["error"][:160] for r in failed})[:3],
    }
