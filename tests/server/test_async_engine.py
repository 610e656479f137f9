"""AsyncEngine: the engine is built on the thread that steps it; a failed build raises."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dynaspec.server.async_engine import AsyncEngine


class _State:
    def to_json(self) -> dict:
        return {"num_unfinished": 0}


class _StubEngine:
    tokenizer = None
    max_model_len = 64
    log_stats_interval_s = 0.0

    def __init__(self) -> None:
        self.built_on = threading.current_thread().name

    def state(self) -> _State:
        return _State()

    def has_unfinished_requests(self) -> bool:
        return False

    def shutdown(self) -> None:
        """The engine client protocol's last call (nothing to stop here)."""

    def take_finished_times(self) -> list:
        return []


def test_engine_is_built_and_called_on_the_engine_thread() -> None:
    eng = AsyncEngine(lambda: (_StubEngine(), None))
    try:
        assert eng.engine.built_on == "dynaspec-engine" != threading.current_thread().name
        # Commands run on that same thread: one thread does all of the engine's torch work.
        name = eng.call(lambda e: threading.current_thread().name).result(10)
        assert name == eng.engine.built_on
    finally:
        asyncio.run(eng.shutdown())
    assert not eng.alive


def test_a_stop_sent_as_the_thread_crashes_still_returns() -> None:
    class Crashing(_StubEngine):
        def take_finished_times(self) -> list:
            raise RuntimeError("metrics bug")

    eng = AsyncEngine(lambda: (Crashing(), None))
    assert eng.call(lambda e: 1).result(10) == 1  # the thread crashes right after this command
    asyncio.run(asyncio.wait_for(eng.shutdown(), 30))
    assert not eng.alive


def test_a_failed_build_raises_in_the_caller() -> None:
    def build() -> tuple:
        raise ValueError("model file is not GGUF")

    with pytest.raises(ValueError, match="not GGUF"):
        AsyncEngine(build)
