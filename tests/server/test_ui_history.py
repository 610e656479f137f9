"""ui/history.py: the ring of /ui/live samples the server keeps for a page that opens late (bounded,
oldest first, sampled while the app runs, a failed sample skipped), served at /ui/history with
its published schema; and the reason the page gives when the goodput policy is not running."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from dynaspec.engine.client import ModelCard
from dynaspec.server.ui.history import HISTORY_SCHEMA, LiveHistory, goodput_note
from tests.cost_tables import FREE_VERIFY
from tests.server.conftest import MODEL

PROMPT = "one two three four five six. one two three four five six. one two three four"


def test_the_ring_keeps_the_last_span_oldest_first():
    counter = itertools.count()
    ring = LiveHistory(lambda: {"time": next(counter)}, interval_s=5.0, span_s=20.0)
    for _ in range(20):
        ring.take()
    kept = [s["time"] for s in ring.samples()]
    # span / interval samples, one rate window (10 s) more, and one spare at each end.
    assert kept == list(range(20))[-len(kept):] and len(kept) == 20 // 5 + 10 // 5 + 2


def test_run_samples_on_its_interval_and_survives_a_failed_sample():
    calls = itertools.count()

    def sample() -> dict:
        n = next(calls)
        if n == 1:
            raise RuntimeError("a metrics bug")
        return {"time": n}

    ring = LiveHistory(sample, interval_s=0.01, span_s=1.0)

    async def go() -> None:
        task = asyncio.create_task(ring.run())
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(go())
    times = [s["time"] for s in ring.samples()]
    assert times[0] == 0 and 1 not in times and len(times) >= 3, times


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="interval_s"):
        LiveHistory(dict, interval_s=0)


def _card(k_policy: dict | None, speculating: bool = True) -> ModelCard:
    return ModelCard(max_model_len=64, vocab_size=10, spec_plan={"speculating": speculating},
                     k_policy=k_policy, lossless=True, execution_plan={}, block_size=16,
                     prefix_caching=True)


def test_the_goodput_note_says_why_goodput_is_not_modelled():
    refused = {"name": "table", "requested": "auto", "cost_table": "refused",
               "note": "goodput fell back to the table: the step costs measured at start-up "
                       "(87 s) failed their checks, as they do when the machine is busy while "
                       "measuring: batch 4 ctx 128: width 2 0.97 ms < width 1 1.64 ms"}
    note = goodput_note(_card(refused))
    assert note is not None
    assert "'table' (--k-policy auto)" in note and "busy while measuring" in note
    assert "width 2 0.97 ms < width 1" in note  # the table's own failed check
    adaptive = goodput_note(_card({"name": "adaptive", "requested": "adaptive"}))
    assert adaptive is not None and "'adaptive'" in adaptive and "--k-policy" not in adaptive
    assert "speculation is off" in (goodput_note(_card(None, speculating=False)) or "")
    assert goodput_note(_card({"name": "goodput", "requested": "auto"})) is None
    assert goodput_note(_card(None)) is None  # data parallel: the ranks' gauges say


@pytest.fixture(scope="module")
def server(live_server_factory, tiny_llama_dir):
    return live_server_factory(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                               speculator="ngram", num_spec_tokens=3, k_policy="table")


def test_history_shows_the_traffic_before_the_page_opened(server):
    import jsonschema

    deadline = time.monotonic() + 30
    while not httpx.get(server.url + "/ui/history").json()["samples"]:
        assert time.monotonic() < deadline, "the app's lifespan takes a sample as it starts"
        time.sleep(0.05)
    server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    server.wait_idle()
    server.app.state.live_history.take()  # what the sampler does every interval_s
    past = httpx.get(server.url + "/ui/history").json()
    jsonschema.Draft202012Validator(HISTORY_SCHEMA).validate(past)

    def generated(sample: dict) -> float:
        return sum(v for _, v in sample["series"].get("generation_tokens_total", []))

    assert generated(past["samples"][0]) == 0 and generated(past["samples"][-1]) >= 12
    times = [s["time"] for s in past["samples"]]
    assert times == sorted(times)
    assert all(s["prefix"] == "dynaspec:" and s["state"] for s in past["samples"])
    assert "'table'" in past["goodput_note"] and "models goodput" in past["goodput_note"]


def test_history_is_empty_not_missing_without_the_sampler(server):
    from starlette.testclient import TestClient

    from dynaspec.server.api_server import build_app

    # Not entered as a context manager: no lifespan, so no sampler (and the shared engine is
    # not shut down).
    client = TestClient(build_app(server.async_engine, MODEL))
    r = client.get("/ui/history")
    assert r.status_code == 200 and r.json()["samples"] == []


def test_goodput_running_has_no_note(live_server_factory, tiny_llama_dir):
    s = live_server_factory(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                            speculator="ngram", num_spec_tokens=3, cost_table=FREE_VERIFY)
    assert httpx.get(s.url + "/ui/history").json()["goodput_note"] is None
