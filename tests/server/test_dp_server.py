"""`dynaspec serve --data-parallel-size 2` end to end on the default model (fp32, goodput policy).

One server for the module; the last test kills a rank and checks /health and new requests.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import assert_greedy_equal
from tests.e2e.dp_helpers import assert_processes_gone
from tests.server.conftest import MODEL, LiveServer

DP_KWARGS = dict(data_parallel_size=2, dtype="float32", num_kv_blocks=128, max_num_seqs=4,
                 max_model_len=256,
                 speculator="ngram", num_spec_tokens=3)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was",
           "1, 2, 3, 4, 5,"]


@pytest.fixture(scope="module")
def server(default_gguf_path):
    s = LiveServer(**DP_KWARGS).start()
    pids = s.async_engine.engine.rank_pids()
    yield s
    s.stop()
    s.async_engine.engine.shutdown()
    assert_processes_gone(pids.values())


def _metric(text: str, name: str, rank: str, extra: str = "") -> float:
    pat = rf'^{re.escape(name)}\{{[^}}]*rank="{rank}"[^}}]*{extra}[^}}]*\}} (\S+)'
    return sum(float(m) for m in re.findall(pat, text, re.M))


def test_greedy_completions_equal_single_rank(server):
    from dynaspec import LLM, SamplingParams

    client = server.client()

    async def ask_all():
        async with httpx.AsyncClient(timeout=120) as http:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0}
                      for p in PROMPTS]
            return await asyncio.gather(*(http.post(server.url + "/v1/completions", json=b)
                                          for b in bodies))

    got = [r.json() for r in asyncio.run(ask_all())]
    ref_llm = LLM(model="default", dtype="float32", num_kv_blocks=128)
    refs = ref_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for p, r, g in zip(PROMPTS, refs, got):
        text = g["choices"][0]["text"]
        if text != r.text:  # the API returns text: examine the first divergence (near-tie rule)
            assert_greedy_equal("default", r.prompt_token_ids, r.token_ids,
                                ref_llm.tokenizer.encode(text), p)
    assert client.models.list().data[0].id == MODEL


def test_metrics_label_each_rank_and_sum_them(server):
    text = httpx.get(server.url + "/metrics").text
    name = "dynaspec:spec_decode_num_emitted_tokens_total"
    per_rank = [_metric(text, name, str(r)) for r in range(2)]
    assert all(v > 0 for v in per_rank), f"a rank served nothing: {per_rank}"
    assert _metric(text, name, "all") == sum(per_rank)
    steps = "dynaspec:spec_decode_steps_total"
    assert _metric(text, steps, "all") == _metric(text, steps, "0") + _metric(text, steps, "1")
    assert text.count("# TYPE dynaspec:spec_decode_steps_total counter") == 1  # one family
    # The goodput policy (the default) decided K from the shared state: one K per tick.
    logs = [{t[0]: t[1] for t in log} for log in server.on_engine(lambda e: e.query("decisions"))]
    common = set(logs[0]) & set(logs[1])
    assert len(common) >= 10 and all(logs[0][t] == logs[1][t] for t in common)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


async def _cut_after_two_chunks(url: str) -> bool:
    body = {"model": MODEL, "prompt": "Tell me a long story about a dragon", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 2:
                    return True  # leaving the blocks closes the connection mid-stream
    return False


def test_client_disconnect_frees_blocks_on_the_owning_rank(server):
    assert asyncio.run(_cut_after_two_chunks(server.url))
    deadline = time.monotonic() + 30
    while True:
        kv = server.on_engine(lambda e: e.query("kv"))
        if all(k["num_free_blocks"] == k["num_blocks"] and not k["num_unfinished"] for k in kv):
            break
        assert time.monotonic() < deadline, f"blocks not freed after the disconnect: {kv}"
        time.sleep(0.1)
    server.on_engine(lambda e: e.check_integrity())


def test_health_fails_when_a_rank_is_gone(server):
    eng = server.async_engine.engine
    os.kill(eng.rank_pids()[1], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while (r := httpx.get(server.url + "/health")).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 with a rank gone"
        time.sleep(0.1)
    assert r.status_code == 503 and "data-parallel rank 1 died" in r.json()["status"]
    resp = httpx.post(server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 503 and "rank 1" in resp.json()["error"]["message"]
