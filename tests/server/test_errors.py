"""Malformed requests: each gets the right status and an OpenAI-style error naming the problem,
and the server keeps serving (a good request succeeds right after each)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL

GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
CHAT_GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
C, CH = "/v1/completions", "/v1/chat/completions"


def _with(base: dict, **changes) -> dict:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not ...}  # `...` deletes a field


# (id, method, path, body: dict | bytes, status, substrings the message must contain, param)
CASES = [
    ("truncated-json", "POST", C, b'{"model": "default", "prompt": "hi",', 400, ["not valid JSON"], None),
    ("empty-body", "POST", C, b"", 400, ["not valid JSON"], None),
    ("body-not-object", "POST", C, b"[1, 2]", 400, ["JSON object"], None),
    ("missing-model", "POST", C, _with(GOOD, model=...), 400, ["'model' is required"], "model"),
    ("unknown-model", "POST", C, _with(GOOD, model="gpt-9"), 404, ["gpt-9", "does not exist"], "model"),
    ("missing-prompt", "POST", C, _with(GOOD, prompt=...), 400, ["'prompt' is required"], "prompt"),
    ("prompt-wrong-type", "POST", C, _with(GOOD, prompt=123), 400, ["prompt must be"], "prompt"),
    ("prompt-empty-list", "POST", C, _with(GOOD, prompt=[]), 400, ["prompt must be"], "prompt"),
    ("prompt-batch-mixed", "POST", C, _with(GOOD, prompt=["a", [1, 2]]), 400, ["prompt must be"], "prompt"),
    ("prompt-float-token", "POST", C, _with(GOOD, prompt=[1, 2.5]), 400, ["prompt must be"], "prompt"),
    ("prompt-empty-string", "POST", C, _with(GOOD, prompt=""), 400, ["prompt strings must be non-empty"], "prompt"),
    ("token-outside-vocab", "POST", C, _with(GOOD, prompt=[1, 99999999]), 400, ["outside the vocabulary"], "prompt"),
    ("prompt-too-long", "POST", C, _with(GOOD, prompt="hello " * 600), 400, ["context length"], "prompt"),
    ("max-tokens-beyond-context", "POST", C, _with(GOOD, max_tokens=100000), 400, ["max_tokens", "context length"], "max_tokens"),
    ("max-tokens-zero", "POST", C, _with(GOOD, max_tokens=0), 400, ["max_tokens", "greater than or equal to 1"], "max_tokens"),
    ("max-tokens-negative", "POST", C, _with(GOOD, max_tokens=-5), 400, ["max_tokens"], "max_tokens"),
    ("max-tokens-string", "POST", C, _with(GOOD, max_tokens="ten"), 400, ["max_tokens", "integer"], "max_tokens"),
    ("max-tokens-float", "POST", C, _with(GOOD, max_tokens=2.5), 400, ["max_tokens", "integer"], "max_tokens"),
    ("temperature-string", "POST", C, _with(GOOD, temperature="hot"), 400, ["temperature", "number"], "temperature"),
    ("temperature-negative", "POST", C, _with(GOOD, temperature=-1), 400, ["temperature"], "temperature"),
    ("top-p-zero", "POST", C, _with(GOOD, top_p=0), 400, ["top_p"], "top_p"),
    ("top-k-below-minus-one", "POST", C, _with(GOOD, top_k=-3), 400, ["top_k"], "top_k"),
    ("seed-string", "POST", C, _with(GOOD, seed="abc"), 400, ["seed"], "seed"),
    ("logprobs-too-many", "POST", C, _with(GOOD, logprobs=50), 400, ["logprobs"], "logprobs"),
    ("stop-empty-string", "POST", C, _with(GOOD, stop=[""]), 400, ["stop strings must be non-empty"], "stop"),
    ("stop-wrong-type", "POST", C, _with(GOOD, stop=5), 400, ["stop must be a string or a list of strings"], "stop"),
    ("n-too-many", "POST", C, _with(GOOD, n=99), 400, ["n", "less than or equal to 16"], "n"),
    ("suffix", "POST", C, _with(GOOD, suffix="tail"), 400, ["suffix is not supported"], "suffix"),
    ("logit-bias-bad-key", "POST", C, _with(GOOD, logit_bias={"abc": 1.0}), 400, ["logit_bias.abc", "should match pattern"], "logit_bias.abc"),
    ("unknown-field", "POST", C, _with(GOOD, max_token=5), 400, ["unknown field 'max_token'"], "max_token"),
    ("presence-penalty-range", "POST", C, _with(GOOD, presence_penalty=3.0), 400, ["presence_penalty"], "presence_penalty"),
    ("chat-missing-messages", "POST", CH, _with(CHAT_GOOD, messages=...), 400, ["'messages' is required"], "messages"),
    ("chat-empty-messages", "POST", CH, _with(CHAT_GOOD, messages=[]), 400, ["messages", "at least 1"], "messages"),
    ("chat-messages-string", "POST", CH, _with(CHAT_GOOD, messages="hi"), 400, ["messages"], "messages"),
    ("chat-bad-role", "POST", CH, _with(CHAT_GOOD, messages=[{"role": "robot", "content": "x"}]), 400, ["role"], "messages.0.role"),
    ("chat-image-part", "POST", CH, _with(CHAT_GOOD, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, ["content must be a string", "not supported"], "messages.0.content"),
    ("chat-tools-no-function", "POST", CH, _with(CHAT_GOOD, tools=[{"type": "function"}]), 400, ["'tools.0.function' is required"], "tools.0.function"),
    ("chat-tool-choice-unknown", "POST", CH, _with(CHAT_GOOD, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), 400, ["'g'", "not among the tools"], "tool_choice.function.name"),
    ("chat-tool-choice-without-tools", "POST", CH, _with(CHAT_GOOD, tool_choice="required"), 400, ["needs tools"], "tool_choice"),
    ("chat-max-completion-tokens-zero", "POST", CH, _with(CHAT_GOOD, max_completion_tokens=0), 400, ["max_completion_tokens"], "max_completion_tokens"),
    ("body-too-large", "POST", C, _with(GOOD, prompt="x" * (1 << 20)), 413, ["too large", "limit"], None),
    ("unknown-route", "POST", "/v1/embeddings", GOOD, 404, ["no route", "/v1/embeddings"], None),
    ("wrong-method", "GET", C, b"", 405, ["not allowed"], None),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(live_server_factory):
    return live_server_factory()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_table_is_big_enough():
    assert len(CASES) >= 15 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(http, case):
    _, method, path, body, status, needles, param = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.request(method, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["code"], err  # every error has a code
    if status == 405:
        assert r.headers["allow"] == "POST", r.headers
    for needle in needles:
        assert needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    # The engine keeps serving: a good request right after succeeds.
    ok = http.post(C, json=GOOD)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 1


def test_openai_client_raises_typed_errors(server):
    import openai

    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)


def test_engine_intact_after_errors(server):
    state = server.wait_idle()
    assert state["free"] == state["blocks"]
    server.on_engine(lambda e: e.check_integrity())


@pytest.mark.parametrize("field, value", [("top_k", 2**70), ("seed", 2**70)])
def test_out_of_range_sampling_value_is_a_400_and_fails_no_one_else(server, field, value):
    # Found by `bench reliability --scenario fuzz`: this used to pass validation and fail the
    # whole engine step, so every request batched with it got a 500.
    r = httpx.post(server.url + "/v1/completions", json={**GOOD, field: value}, timeout=60)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def _fail_forward(server, at: int) -> None:
    """The engine's `at`-th forward from now raises (a failing step; the engine keeps serving)."""
    def install(e):  # type: ignore[no-untyped-def]
        run, calls = e.runner.run, []

        def flaky(prepared):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == at:
                raise RuntimeError("injected forward failure")
            return run(prepared)

        e.runner.run = flaky

    server.on_engine(install)


def _restore_forward(server) -> None:
    server.on_engine(lambda e: e.runner.__dict__.pop("run", None))


FAILING = {**GOOD, "max_tokens": 12, "ignore_eos": True}


def test_a_failed_generation_is_a_500_that_keeps_its_text(server, http):
    _fail_forward(server, 4)  # the prefill and two decodes ran: 3 tokens
    try:
        r = http.post(C, json=FAILING)
    finally:
        _restore_forward(server)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_error" and err["type"] == "server_error"
    assert "injected forward failure" in err["message"]
    assert err["num_output_tokens"] == 3 and err["text"], err
    ok = http.post(C, json=FAILING)  # the same request again, unbroken: the same first tokens
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith(err["text"])


def test_a_failed_stream_sends_its_text_then_an_error_event(server, http):
    _fail_forward(server, 4)
    try:
        r = http.post(C, json={**FAILING, "stream": True})
    finally:
        _restore_forward(server)
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "engine_error" and err["num_output_tokens"] == 3
    streamed = "".join(c["text"] for e in events[:-2] for c in json.loads(e)["choices"])
    assert streamed == err["text"] and streamed, events
    server.on_engine(lambda e: e.check_integrity())
