"""`dynaspec serve --data-parallel-size 2` end to end on the default model (fp32, goodput policy).

One server for the module; the last test kills a rank mid-stream: only its stream ends (an SSE
error event naming it), /health says degraded, new requests are served, the rank is replaced.
"""

from __future__ import annotations

import asyncio
import json
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
    pids = set(s.async_engine.engine.rank_pids().values())
    yield s
    pids |= set(s.async_engine.engine.rank_pids().values())  # the replacement's too
    s.stop()
    s.async_engine.engine.shutdown()
    assert_processes_gone(pids)


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
    logs = [{t.tick: t.k for t in log} for log in server.on_engine(lambda e: e.query("decisions"))]
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


async def _two_streams_kill_rank_1(url: str, pid: int) -> tuple[list, dict]:
    """Two streams (one per rank: least-loaded routing); once both streamed, rank 1 is
    killed. Each stream's (chunks, error, finish); /health as seen at the error event."""
    body = {"model": MODEL, "prompt": "Tell me a long story about a dragon", "max_tokens": 120,
            "temperature": 0, "ignore_eos": True, "stream": True}
    both = [asyncio.Event(), asyncio.Event()]
    health: dict = {}
    async with httpx.AsyncClient(timeout=180) as http:
        async def stream(i: int) -> tuple:
            chunks, error, finish = 0, None, None
            async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        error = obj["error"]["message"]
                        health.update((await http.get(url + "/health")).json())
                        continue
                    chunks += 1
                    finish = obj["choices"][0]["finish_reason"] or finish
                    if chunks == 2:
                        both[i].set()
            return chunks, error, finish

        async def kill() -> None:
            await asyncio.wait_for(asyncio.gather(both[0].wait(), both[1].wait()), 120)
            os.kill(pid, signal.SIGKILL)

        *results, _ = await asyncio.gather(stream(0), stream(1), kill())
    return results, health


def test_a_lost_rank_ends_only_its_stream_and_is_replaced(server):
    eng = server.async_engine.engine
    results, health = asyncio.run(_two_streams_kill_rank_1(server.url, eng.rank_pids()[1]))
    errors = [r for r in results if r[1] is not None]
    done = [r for r in results if r[1] is None]
    assert len(errors) == 1 and len(done) == 1, results
    assert "data-parallel rank 1 died (exit code -9)" in errors[0][1], errors[0][1]
    assert done[0][2] == "length", done  # the survivor's stream ran to its end
    assert health["status"] == "degraded" and health["ranks_serving"] == [0], health
    resp = httpx.post(server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=120)
    assert resp.status_code == 200, resp.text  # served while degraded
    text = httpx.get(server.url + "/metrics").text
    assert _metric_plain(text, "dynaspec:dp_rank_losses_total") == 1
    assert _metric_plain(text, "dynaspec:dp_requests_failed_total") == 1
    deadline = time.monotonic() + 180
    while (h := httpx.get(server.url + "/health").json())["status"] != "ok":
        assert time.monotonic() < deadline, f"rank 1 not replaced: {h}"
        time.sleep(0.2)
    assert h["ranks_serving"] == [0, 1]
    text = httpx.get(server.url + "/metrics").text
    assert _metric_plain(text, "dynaspec:dp_rank_replacements_total") == 1
    assert _metric_plain(text, "dynaspec:dp_ranks_serving") == 2


def _metric_plain(text: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)", text, re.M)
    assert len(found) == 1, f"{name}: {found}"
    return float(found[0])
