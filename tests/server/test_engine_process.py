"""`dynaspec serve --engine-process`: the engine core in its own process, the HTTP process only
validating, streaming and framing; answers and /metrics as from an in-process engine."""

from __future__ import annotations

import pytest

from tests.e2e.dp_helpers import assert_processes_gone
from tests.server.conftest import MODEL, LiveServer

KWARGS = dict(engine_process=True, dtype="float32", num_kv_blocks=64, max_num_seqs=4,
              max_model_len=256, speculator="ngram", num_spec_tokens=3)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = LiveServer(model=tiny_llama_dir, **KWARGS).start()
    pids = s.async_engine.engine.rank_pids()
    yield s
    s.stop()
    s.async_engine.engine.shutdown()
    assert_processes_gone(pids.values())


def test_answers_equal_the_in_process_engine(server, tiny_llama_dir):
    import os

    from dynaspec import LLM, SamplingParams

    pids = server.async_engine.engine.rank_pids()
    assert list(pids) == [0] and pids[0] != os.getpid()
    prompt = "def add(a, b):"
    got = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                             temperature=0)
    ref = LLM(model=tiny_llama_dir, **{**KWARGS, "engine_process": False}).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert got.choices[0].text == ref.text and got.usage.completion_tokens == len(ref.token_ids)
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True)
    assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1


def test_metrics_are_one_engines_series_without_a_rank_label(server):
    import httpx

    server.client().completions.create(model=MODEL, prompt="hello", max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith("dynaspec:generation_tokens_total")]
    assert lines and all("rank=" not in ln for ln in lines)
    assert float(lines[0].split()[-1]) >= 4
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
