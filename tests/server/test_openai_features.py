"""The OpenAI API as clients use it, through the official `openai` client, on the tiny fp32 Llama:
penalties / logit_bias / min_tokens token-exact with and without n-gram speculation, n > 1
reproducible with a seed, batched prompts and echo, tool calls whose arguments parse and match
the schema (streamed and not), cached_tokens, /tokenize and /detokenize, and a schema that says
what the server does."""

from __future__ import annotations

import json

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from .conftest import MODEL  # noqa: E402

PROMPTS = [[17, 33, 45, 17, 33, 45, 17, 33, 45, 17, 33], [100, 101, 102, 103, 100, 101, 102],
           [5, 9, 250, 31, 77, 140, 8, 61]]
SETTINGS = {
    "presence": dict(presence_penalty=0.4),
    "frequency": dict(frequency_penalty=0.2),
    "repetition": dict(extra_body={"repetition_penalty": 1.3}),
    "logit_bias": dict(logit_bias={"40": 6, "100": -100}),
    "min_tokens": dict(extra_body={"min_tokens": 10, "stop_token_ids": [40]},
                       logit_bias={"40": 4}),
    "bad_words": None,  # built from the unprocessed output (below)
}
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def servers(live_server_factory, tiny_llama_dir):
    common = dict(model=tiny_llama_dir, dtype="float32", max_model_len=256, num_kv_blocks=256)
    plain = live_server_factory(**common)
    spec = live_server_factory(**common, speculator="ngram", num_spec_tokens=4,
                               prompt_lookup_min=1, k_policy="table")
    return plain, spec


def _greedy(client, prompt, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  **kw)
    return r.choices[0].text, r.choices[0].finish_reason


def _first_word(client) -> str:
    """A token the unprocessed greedy output of PROMPTS[0] contains, as text."""
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                  logprobs=0)
    return next(t for t in r.choices[0].logprobs.tokens if t.strip())


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_token_exact_with_and_without_ngram(servers, name):
    plain, spec = servers
    a, b = plain.client(), spec.client()
    kw = SETTINGS[name] or dict(extra_body={"bad_words": [_first_word(a)]})
    changed = False
    for p in PROMPTS:
        ref = _greedy(a, p, **kw)
        assert _greedy(b, p, **kw) == ref, f"{name} prompt {p}"
        changed |= ref != _greedy(a, p)
    assert changed, f"{name} must change some greedy output"
    assert spec.on_engine(lambda e: e.counters.num_accepted_tokens) > 0


def test_n4_with_seed_is_reproducible(servers):
    c = servers[1].client()
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=4, seed=7)
    r1, r2 = c.completions.create(**kw), c.completions.create(**kw)
    texts = [ch.text for ch in r1.choices]
    assert [ch.index for ch in r1.choices] == [0, 1, 2, 3]
    assert texts == [ch.text for ch in r2.choices]
    assert len(set(texts)) > 1, "each choice samples with its own seed stream"
    assert r1.usage.completion_tokens == 32 and r1.usage.prompt_tokens == len(PROMPTS[2])
    chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=4, seed=3)
    again = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=4, seed=3)
    assert [x.message.content for x in chat.choices] == [x.message.content for x in again.choices]
    single = c.completions.create(**{**kw, "n": 1})
    assert single.choices[0].text == texts[0], "choice 0 samples with the seed itself"


def test_n_streamed_equals_not_streamed(servers):
    c = servers[0].client()
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=11)
    whole = [ch.text for ch in c.completions.create(**kw).choices]
    parts = ["", "", ""]
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            parts[ch.index] += ch.text
    assert parts == whole


def test_best_of_returns_n_reproducibly(servers):
    c = servers[0].client()
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, n=2, best_of=4,
              seed=5)
    r1, r2 = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in r1.choices] == [0, 1] and r1.choices[0].logprobs is None
    assert [ch.text for ch in r1.choices] == [ch.text for ch in r2.choices]
    assert r1.usage.completion_tokens == 24  # all four were generated


def test_streamed_chat_n2_usage(servers):
    c = servers[0].client()
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=2,
                                            seed=1, stream=True,
                                            stream_options={"include_usage": True}))
    finished = {ch.index for k in chunks for ch in k.choices if ch.finish_reason}
    assert finished == {0, 1}
    usage = chunks[-1].usage
    assert usage.completion_tokens == 8 and usage.prompt_tokens_details.cached_tokens is not None


def test_siblings_share_the_prompt_through_the_prefix_cache(servers):
    c = servers[0].client()
    prompt = list(range(3, 60))  # > 3 blocks of 16
    hits = lambda: servers[0].on_engine(lambda e: e.kv.prefix_cache_hits)  # noqa: E731
    before = hits()
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3, temperature=0)
    assert r.usage.prompt_tokens == len(prompt)
    assert hits() - before == 2 * 48, "both siblings find the first choice's 3 full blocks"
    again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 48


def test_batched_prompts_and_echo(servers):
    c = servers[0].client()
    r = c.completions.create(model=MODEL, prompt=["hello there", "the fox"], max_tokens=4,
                             temperature=0, echo=True, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("hello there") and r.choices[2].text.startswith("the fox")
    alone = c.completions.create(model=MODEL, prompt="the fox", max_tokens=4, temperature=0)
    assert r.choices[3].text == "the fox" + alone.choices[0].text
    lp = c.completions.create(model=MODEL, prompt="the fox", max_tokens=3, temperature=0,
                              echo=True, logprobs=0).choices[0].logprobs
    assert lp.text_offset[0] == len("the fox")  # offsets count the echoed prompt
    ids = c.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2,
                               temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def _check_call(call, name="get_weather"):
    assert call.type == "function" and call.function.name == name and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(
        args, WEATHER if name == "get_weather" else TOOLS[1]["function"]["parameters"]
    )


@pytest.mark.parametrize("server_i", [0, 1])
def test_named_tool_call_parses_and_matches(servers, server_i):
    c = servers[server_i].client()
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice,
                                  max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert len(msg.tool_calls) == 1
    _check_call(msg.tool_calls[0])
    args, name, ids = "", None, set()
    for chunk in c.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                           tool_choice=choice, max_tokens=60, temperature=0,
                                           stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                name = tc.function.name or name
                args += tc.function.arguments or ""
                ids.add(tc.id) if tc.id else None
            last = ch.finish_reason
    assert name == "get_weather" and len(ids) == 1 and last == "tool_calls"
    assert args == msg.tool_calls[0].function.arguments


def test_required_tool_calls(servers):
    c = servers[1].client()
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=120,
              temperature=0)
    one = c.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    _check_call(one.message.tool_calls[0], one.message.tool_calls[0].function.name)
    streamed = c.chat.completions.create(**kw, parallel_tool_calls=False, stream=True)
    deltas = [tc for chunk in streamed for ch in chunk.choices for tc in ch.delta.tool_calls or ()]
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(t.function.name, t.function.arguments) for t in one.message.tool_calls]
    # Parallel: an array of calls. The random model never closes it, so the text comes back.
    many = c.chat.completions.create(**kw).choices[0]
    assert many.finish_reason == "length" and many.message.content.startswith('[{"name": ')


def test_history_with_tool_calls_renders(servers):
    c = servers[0].client()
    msgs = CHAT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=4,
                                  temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_tokenize_detokenize(servers):
    url = servers[0].url
    t = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "the fox"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 256
    d = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": t["tokens"]}).json()
    assert d["prompt"].endswith("the fox")
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT}).json()
    r = servers[0].client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens


def test_cached_tokens_and_ignored_fields(servers):
    c = servers[0].client()
    prompt = list(range(100, 150))
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, user="u",
                                 extra_body={"service_tier": "auto"})
    second = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 48
    whole = httpx.post(servers[0].url + "/v1/completions", json={
        "model": MODEL, "prompt": [5.0, 6.0], "max_tokens": 2.0, "top_k": 3.0})
    assert whole.status_code == 200, whole.text  # whole-number floats are integers


def test_schema_tells_the_truth(servers):
    spec = httpx.get(servers[0].url + "/openapi.json").json()
    paths = spec["paths"]
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    ok = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/event-stream"} <= set(ok)
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]
    param = paths["/v1/models/{model_id}"]["get"]["parameters"][0]
    assert param["schema"]["enum"] == [MODEL]
    comp = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "service_tier" in comp and "Accepted and ignored" in comp["service_tier"]["description"]
    assert len(comp["prompt"]["anyOf"]) == 4
    assert {"/tokenize", "/detokenize"} <= set(paths)
    r = httpx.delete(servers[0].url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
