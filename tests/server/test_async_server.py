"""--async-scheduling behind the API: same greedy text as the sync engine, streams, metrics."""

from __future__ import annotations

import httpx
import pytest

from dynaspec import LLM, SamplingParams
from tests.cost_tables import FREE_VERIFY
from tests.server.conftest import MODEL, SERVER_ENGINE_KWARGS

PROMPT = "The list is: apple, banana, cherry, apple, banana, cherry, apple,"
# The default policy with a fixed free-verify table: it drafts, deterministically.
SPEC = dict(speculator="ngram", num_spec_tokens=4, cost_table=FREE_VERIFY, dtype="float32")


@pytest.fixture(scope="module")
def server(live_server_factory):
    return live_server_factory(async_scheduling=True, **SPEC)


def test_async_server_matches_sync_engine_and_streams(server):
    assert server.on_engine(lambda e: type(e.driver).__name__ == "AsyncStepLoop")
    ref = LLM(**{**SERVER_ENGINE_KWARGS, **SPEC}).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[" cherry, apple, banana"]))[0]
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
              stop=[" cherry, apple, banana"])
    full = client.completions.create(**kw)
    assert full.choices[0].text == ref.text
    assert full.choices[0].finish_reason == ref.finish_reason
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == ref.text
    state = server.wait_idle()
    assert state["free"] == state["blocks"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "dynaspec:spec_decode_num_draft_tokens_total" in metrics
    assert server.on_engine(lambda e: e.counters.check_identities()) == []
