"""Structured output through the OpenAI API, with the official `openai` client, on the default
model: JSON schema (nested object, enum, array, required) with and without n-gram speculation,
streaming and not; regex, choice, EBNF and json_object forms; bad grammars are a 400."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from tests.cost_tables import FREE_VERIFY  # noqa: E402

from .conftest import MODEL  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "owner": {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 12},
                                 "adult": {"type": "boolean"}},
                  "required": ["city", "adult"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "toys", "owner"],
    "additionalProperties": False,
}
ANIMALS = ["cat", "dog", "parrot", "goldfish", "rabbit", "hamster", "turtle", "pony", "snake",
           "canary"]
PROMPTS = [f"Invent a pet {a} and describe it as JSON." for a in ANIMALS]  # 10 prompts
MAX_TOKENS = 96  # the schema bounds every field: a complete object fits well within this
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def servers(live_server_factory):
    return {"plain": live_server_factory(),
            # The default policy on a fixed free-verify table: it drafts, deterministically.
            "ngram": live_server_factory(speculator="ngram", num_spec_tokens=4,
                                         prompt_lookup_min=1, cost_table=FREE_VERIFY)}


def _chat(client, prompt: str, stream: bool, **kw) -> tuple[str, str]:
    args = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                max_tokens=MAX_TOKENS)
    args.update(kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_json_schema_parses_and_validates(servers, kind):
    """Ten requests at once, every other one streamed: both forms share the batch."""
    server = servers[kind]
    client = server.client()
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: _chat(client, PROMPTS[i], i % 2 == 1,
                                                response_format=RESPONSE_FORMAT),
                                range(len(PROMPTS))))
    for prompt, (text, finish) in zip(PROMPTS, results):
        assert finish == "stop", f"{prompt!r}: finish {finish}, text {text!r}"
        jsonschema.validate(json.loads(text), SCHEMA)
    state = server.wait_idle()
    assert state["free"] == state["blocks"]
    if kind == "ngram":
        c = server.on_engine(lambda e: e.counters)
        assert c.num_drafts > 0, "the n-gram server must have speculated"
        assert not c.check_identities()


def test_spec_and_plain_servers_agree(servers):
    """Greedy constrained output is the same with speculation (bf16 default model: compared on
    the parsed object, near ties aside, it must agree for most prompts)."""
    def answers(server) -> list[str]:  # the six at once: the default path is row-invariant
        client = server.client()
        with ThreadPoolExecutor(6) as pool:
            return list(pool.map(lambda p: _chat(client, p, False,
                                                 response_format=RESPONSE_FORMAT)[0], PROMPTS[:6]))

    outs = {k: answers(s) for k, s in servers.items()}
    same = sum(a == b for a, b in zip(outs["plain"], outs["ngram"]))
    assert same >= 5, outs


def test_regex_and_choice_forms(servers):
    client = servers["ngram"].client()
    r = client.completions.create(model=MODEL, prompt="Call me at", temperature=0, max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    choices = ["yes", "no", "maybe not"]
    text, finish = _chat(client, "Is the sky green?", False,
                         extra_body={"structured_outputs": {"choice": choices}})
    assert text in choices and finish == "stop"
    text, finish = _chat(client, "Pick a colour.", True,
                         extra_body={"structured_outputs": {
                             "grammar": 'root ::= "colour: " ("red" | "green" | "blue")'}})
    assert re.fullmatch(r"colour: (red|green|blue)", text) and finish == "stop", text


def test_json_object_form(servers):
    client = servers["plain"].client()
    text, finish = _chat(client, 'Reply with a JSON object like {"a": 1}.', False,
                         response_format={"type": "json_object"}, max_tokens=200)
    if finish == "stop":  # any JSON object has no length bound; when complete it parses
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nosuch"}}}}, "response_format", "nosuch"),
    ({"extra_body": {"structured_outputs": {"regex": "a["}}}, "structured_outputs", "["),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= "}}}, "structured_outputs",
     "grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
     "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"},
      "extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs", "not both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
])
def test_bad_grammar_is_400_and_the_next_request_works(servers, body, param, words):
    server = servers["plain"]
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, **body)
    err = info.value.body
    assert err["param"] == param and words in err["message"], err
    text, finish = _chat(client, "Is water wet?", False,
                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert text in ("yes", "no") and finish == "stop"
    state = server.wait_idle()
    assert state["free"] == state["blocks"]


def test_grammar_metrics_are_exported(servers):
    import httpx

    server = servers["ngram"]
    _chat(server.client(), PROMPTS[0], False, response_format=RESPONSE_FORMAT)
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r"dynaspec:structured_output_mask_seconds_count\{[^}]*\} [1-9]", text), text
    assert re.search(r"dynaspec:structured_output_compile_seconds_count\{[^}]*\} [1-9]", text)
    assert re.search(r"dynaspec:structured_output_masked_rows_total\{[^}]*\} [1-9]", text)


@pytest.mark.parametrize("body, param", [
    ({"choice": ["yes", ",\u0014"]}, "structured_outputs.choice[1]"),
    ({"regex": "a\U0005e659"}, "structured_outputs.regex"),
])
def test_a_character_no_token_spells_is_a_400_as_the_schema_says(servers, body, param):
    """The default vocabulary lacks U+0014 and the UTF-8 lead bytes of U+40000..U+BFFFF."""
    import httpx

    server = servers["plain"]
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                           extra_body={"structured_outputs": body})
    err = info.value.body
    assert err["param"] == param and err["code"] == "unspellable_character", err
    props = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"][
        "StructuredOutputsBody"]["properties"]
    for pattern in (props["choice"]["items"]["pattern"], props["regex"]["pattern"]):
        assert re.search(pattern, "yes") and not re.search(pattern, ",\u0014")
        assert not re.search(pattern, "a\U0005e659") and re.search(pattern, "a\U0001F600")


def test_a_grammar_dead_end_fails_only_its_request(servers):
    """A regex that escapes U+0014 passes the up-front check (the check reads characters, not
    escapes), then no token can continue it
    after "a": that request alone is a 400 (it was a 500 for its whole step), the others in
    the batch finish normally, and every KV block comes back."""
    server = servers["ngram"]
    client = server.client()
    dead = dict(model=MODEL, prompt="Say a", max_tokens=8, temperature=0,
                extra_body={"structured_outputs": {"regex": "a\\x14z"}})
    fine = dict(model=MODEL, prompt="Is water wet?", max_tokens=8, temperature=0,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})

    def run(kw):
        try:
            return client.completions.create(**kw).choices[0].text
        except openai.BadRequestError as exc:
            return exc.body

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, [dead, fine, dead, fine]))
    for err in results[0::2]:
        assert isinstance(err, dict) and err["code"] == "grammar_dead_end", err
        assert "no token" in err["message"]
    assert all(r in ("yes", "no") for r in results[1::2]), results
    state = server.wait_idle()
    assert state["free"] == state["blocks"]
