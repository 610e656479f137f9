"""A live uvicorn server on 127.0.0.1 (a free port) in a background thread, for the API tests.

Each test module starts ONE server (module-scoped fixture) on the default model with a small,
fixed KV pool, so "the pool is fully free again" is cheap to check and the suite stays fast.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

# Small pool and context: fast start-up, and a prompt-too-long request stays cheap to send.
SERVER_ENGINE_KWARGS = dict(model="default", num_kv_blocks=256, max_model_len=512)
MODEL = "default"


class LiveServer:
    def __init__(self, api_key: str | None = None, max_body_bytes: int = 1 << 20,
                 drain_s: float = 1.0, **engine_kwargs: Any) -> None:
        from dynaspec.server.api_server import build_app, build_async_engine
        from dynaspec.server.launch import make_server

        kwargs = {**SERVER_ENGINE_KWARGS, **engine_kwargs}
        self.api_key = api_key
        self.async_engine = build_async_engine(MODEL, **kwargs)
        self.app = build_app(self.async_engine, MODEL, api_key=api_key,
                             max_body_bytes=max_body_bytes)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no free-port race
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, self.async_engine, drain_s=drain_s,
                                  log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self._sock.close()

    def client(self, api_key: str | None = None, **kw: Any):  # type: ignore[no-untyped-def]
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or self.api_key or "none",
                             max_retries=0, timeout=120, **kw)

    def on_engine(self, fn, timeout: float = 60):  # type: ignore[no-untyped-def]
        """Run fn(engine) on the engine thread (the only thread allowed to touch it)."""
        return self.async_engine.call(fn).result(timeout)

    def wait_idle(self, timeout: float = 60) -> dict:
        """Wait until no request is running or waiting; return the published engine state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.on_engine(lambda e: {"running": e.num_running, "waiting": e.num_waiting,
                                              "free": e.kv.num_free_blocks(),
                                              "blocks": e.kv.num_blocks})
            if state["running"] == state["waiting"] == 0:
                return state
            time.sleep(0.05)
        raise AssertionError(f"engine still busy after {timeout}s: {state}")


@pytest.fixture(scope="module")
def live_server_factory():
    """Start servers for this module; all are stopped at module teardown."""
    servers: list[LiveServer] = []

    def start(**kwargs: Any) -> LiveServer:
        server = LiveServer(**kwargs).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()
