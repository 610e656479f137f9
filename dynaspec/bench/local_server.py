"""The OpenAI server in a background thread of this process, and the HTTP calls the reliability
scenarios drive it with (reliability.py, reliability_load.py, reliability_dp.py).

The server listens on 127.0.0.1 on a free port; no traffic leaves the host.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from typing import Any

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


async def complete(http: Any, url: str, body: dict, cut_after_chunks: int | None = None) -> dict:
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


def client(concurrency: int, timeout_s: float) -> Any:
    from dynaspec.extras import require

    httpx = require("httpx", "bench", "the reliability scenarios")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)
