"""/openapi.json is a valid OpenAPI 3.1 document and every open GET answer matches the schema it
publishes, as schemathesis reads them (what the shared fuzz script runs); the schema says what
the server accepts for a named tool choice; a whole-number float token limit is that integer."""

from __future__ import annotations

import httpx
import pytest

from tests.cost_tables import FREE_VERIFY

# GET operations without a body or an API key: schemathesis checks each answer's schema.
OPEN_GETS = ("/health", "/metrics", "/ui/live", "/ui/history", "/v1/models")


@pytest.fixture(scope="module")
def server(live_server_factory, tiny_llama_dir):
    return live_server_factory(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                               speculator="ngram", num_spec_tokens=3, cost_table=FREE_VERIFY)


@pytest.fixture(scope="module")
def spec(server) -> dict:
    return httpx.get(server.url + "/openapi.json").json()


def test_the_document_is_valid_openapi_3_1(spec):
    validator = pytest.importorskip("openapi_spec_validator",
                                    reason="openapi-spec-validator is not installed")
    assert spec["openapi"].startswith("3.1")
    validator.validate(spec)  # raises naming the first wrong part (e.g. a null default)


def test_every_open_answer_matches_its_schema_as_schemathesis_reads_it(server, spec):
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed "
                                       "(the test extra has it)")
    server.client().completions.create(model="default", prompt="one two one two one",
                                       max_tokens=4, temperature=0)  # samples to describe
    server.wait_idle()
    schema = schemathesis.openapi.from_dict(spec)
    for path in OPEN_GETS:
        # Raises on a failed check and on a schema schemathesis itself refuses (a pair given
        # by prefixItems was rewritten to a list-valued `items`, which OpenAPI 3.1 rejects).
        schema[path]["GET"].validate_response(httpx.get(server.url + path))


def test_a_named_tool_choice_must_look_like_a_tool_name(server, spec):
    named = spec["components"]["schemas"]["NamedFunction"]["properties"]["name"]
    tool = spec["components"]["schemas"]["FunctionDef"]["properties"]["name"]
    assert named["pattern"] == tool["pattern"]  # "" can never name a tool: not schema-valid
    tools = [{"type": "function", "function": {"name": "f"}}]
    for name, status in (("", 400), ("f", 200)):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": name}}})
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == "tool_choice.function.name"


def test_a_whole_number_float_token_limit_is_that_integer(server, spec):
    """What made one fuzzed chat completion take 26 s: `max_tokens: 123.0` is 123 to the
    schema and the server, and a fuzz hook that capped only ints let it through. The schema
    says so, and the server generates exactly that many."""
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "123.0" in props["max_tokens"]["description"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3.0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
