"""The OpenAI API against a live server (default model, speculation off), with the openai client."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.server.conftest import MODEL

PROMPT = "Hello, my name is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(live_server_factory):
    return live_server_factory()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _stream_text(chunks, chat: bool) -> tuple[str, list]:
    parts, finals = [], []
    for ch in chunks:
        for c in ch.choices:
            parts.append((c.delta.content or "") if chat else c.text)
            if c.finish_reason:
                finals.append(ch)
    return "".join(parts), finals


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].text.strip()
    assert r.choices[0].finish_reason == "length"
    assert r.model_extra["dynaspec"]["spec"] is None  # speculation is off on this server


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("stop", [None, [", and"]])
def test_completion_stream_reassembles_to_greedy_text(client, stop):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop)
    full = client.completions.create(**kw)
    text, finals = _stream_text(client.completions.create(stream=True, **kw), chat=False)
    assert text == full.choices[0].text
    assert [f.choices[0].finish_reason for f in finals] == [full.choices[0].finish_reason]
    if stop:  # the stop string cut the text, and no part of it was streamed first
        assert full.choices[0].finish_reason == "stop" and ", and" not in text


def test_chat_stream_reassembles_to_greedy_text(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text, finals = _stream_text(chunks, chat=True)
    assert text == full.choices[0].message.content
    assert len(finals) == 1 and "dynaspec" in finals[0].model_extra


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    streamed, _ = _stream_text(client.completions.create(stream=True, **kw), chat=False)
    assert a == b == streamed


def test_usage_counts(server, client):
    tok = server.async_engine.tokenizer
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=0)
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert r.usage.completion_tokens == len(lp.tokens) == len(lp.token_logprobs) == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text

    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert c.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(CHAT)))
    content = c.choices[0].logprobs.content
    assert c.usage.completion_tokens == len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
               for t in content)

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == c.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["kv_num_blocks"] == 256
    text = httpx.get(server.url + "/metrics").text
    count = re.search(r'^dynaspec:e2e_request_latency_seconds_count\{[^}]*\} (\S+)', text, re.M)
    assert count and float(count.group(1)) >= 1  # the tests above finished requests
    assert re.search(r"^dynaspec:generation_tokens_total\{[^}]*\} [1-9]", text, re.M)
    assert 'dynaspec:kv_pool_size_tokens{model_name="default",pool="target"} 4096.0' in text


async def _cut_after_first_chunk(url: str, i: int) -> bool:
    # ignore_eos: none can end by itself before its client leaves, so every one must be aborted.
    body = {"model": MODEL, "prompt": f"Story number {i}: once upon a time", "max_tokens": 200,
            "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as http:  # own connection: closing it cuts the stream
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return True  # leaving both blocks closes the connection mid-stream
    return False


def _finished_count(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(r'^dynaspec:e2e_request_latency_seconds_count\{[^}]*\} (\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_mid_stream_frees_blocks(server, client):
    before = _finished_count(server)
    aborted_before = server.on_engine(lambda e: server.async_engine.num_aborted)

    async def cut_all() -> list[bool]:
        return await asyncio.gather(*(_cut_after_first_chunk(server.url, i) for i in range(50)))

    assert all(asyncio.run(cut_all()))
    state = server.wait_idle(timeout=60)  # 50 x 200 tokens would take far longer than this
    assert state["free"] == state["blocks"], state
    server.on_engine(lambda e: e.check_integrity())
    # Every one was aborted, none ran to the end (none reached the finished histogram).
    assert server.on_engine(lambda e: server.async_engine.num_aborted) - aborted_before == 50
    assert _finished_count(server) == before
    # And the server still serves.
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text


def test_openapi_publishes_the_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"),
                       ("/v1/chat/completions", "ChatCompletionRequest")):
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == \
            {"$ref": f"#/components/schemas/{name}"}
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == \
            {"$ref": "#/components/schemas/ErrorResponse"}
        body = schemas[name]
        assert body["additionalProperties"] is False and "model" in body["required"]
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert {"type": "string", "minLength": 1} in schemas["CompletionRequest"]["properties"][
        "prompt"
    ]["anyOf"]
    # Every reference resolves (a fuzzer or client generator would fail on a dangling one).
    refs = re.findall(
        r'"#/components/schemas/([^"]+)"', httpx.get(server.url + "/openapi.json").text
    )
    assert refs and set(refs) <= set(schemas)
