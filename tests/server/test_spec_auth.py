"""A server with n-gram speculation (K=4) and an API key: per-request speculation metrics in the
`dynaspec` extension field, 401 without the key, and a clean shutdown with a request in flight."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from tests.cost_tables import FREE_VERIFY
from tests.server.conftest import MODEL

KEY = "test-key-123"
# Repetitive text so the n-gram drafter finds matches in the prompt.
PROMPT = "one two three four five six. one two three four five six. one two three four"


@pytest.fixture(scope="module")
def server(live_server_factory):
    # A short drain so the shutdown test's long request is surely still running when aborted.
    return live_server_factory(
        api_key=KEY, speculator="ngram", num_spec_tokens=4, cost_table=FREE_VERIFY, drain_s=0.2
    )


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions")])
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Basic {KEY}", "Bearer"])
def test_v1_needs_the_api_key(server, method, path, header):
    headers = {"authorization": header} if header else {}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = httpx.request(method, server.url + path, headers=headers,
                      json=body if method == "POST" else None)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "API key" in err["message"]


def test_openai_client_with_wrong_key(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="nope").completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_spec_metrics_in_response(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    spec = r.model_extra["dynaspec"]["spec"]
    assert spec is not None
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
            "acceptance_rate", "mean_acceptance_length", "draft_skips"} <= set(spec)
    assert spec["num_emitted_tokens"] == r.usage.completion_tokens
    assert spec["num_draft_tokens"] > 0  # the prompt repeats itself: n-gram drafts were verified


def test_spec_metrics_on_final_chunk_and_greedy_equal(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["dynaspec"]["spec"]["num_drafts"] >= 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full


def test_models_card_and_prometheus_show_speculation(server, client):
    extra = client.models.retrieve(MODEL).model_extra["dynaspec"]
    card = extra["spec_plan"]
    assert card["speculating"] and card["max_k"] == 4
    # The card says what runs: goodput, which may run any K from 0 to 4, so widths 1..5 (not
    # "constant").
    assert card["kind"] == "variable" and card["widths"] == [1, 2, 3, 4, 5]
    assert extra["k_policy"]["name"] == "goodput" and extra["k_policy"]["cost_table"].startswith(
        "injected"
    )
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'^dynaspec:k_policy_info\{[^}]*policy="goodput"[^}]*\} 1', text, re.M)
    m = re.search(r"^dynaspec:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)", text, re.M)
    assert m and float(m.group(1)) > 0
    assert re.search(r'^dynaspec:spec_decode_steps_total\{[^}]*k="4"[^}]*\} [1-9]', text, re.M)


def test_shutdown_with_a_request_in_flight(server):
    """Last test of the module: stop the server while a long stream runs. It gets the drain
    period (0.2 s here) to finish, then is aborted: the stream ends with an error event and [DONE],
    and the engine thread stops with every block free."""
    first_chunk = threading.Event()
    events: list[str] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 450, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {KEY}"}) as resp:
            for line in resp.iter_lines():
                if line:
                    events.append(line)
                    first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(60)
    server.stop()
    t.join(30)
    assert not t.is_alive()
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "shutting down" in events[-2]
    assert not server.async_engine.alive  # the engine thread was stopped and joined
    eng = server.async_engine.engine  # safe to touch now: its thread is gone
    assert eng.num_running == eng.num_waiting == 0
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    eng.check_integrity()
