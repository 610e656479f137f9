"""The structured-output workloads (json_extract, tool_call): deterministic per seed, every
item carries a JSON schema that is valid, compiles, and accepts an answer of the task's shape."""

from __future__ import annotations

import json

import pytest

from dynaspec.bench.structured_workloads import (
    EVENT_SCHEMA,
    MODULE_SCHEMA,
    ORDER_SCHEMA,
    TOOLS,
    required_call_schema,
)
from dynaspec.bench.workloads import WorkloadUnavailable, load_workload
from tests.unit.test_workloads import TOK

jsonschema = pytest.importorskip("jsonschema")

ANSWERS = {
    "module_task": {"module": "json", "kind": "library", "summary": "JSON encoder and decoder.",
                    "topics": ["json", "encoding"],
                    "details": {"has_examples": True, "mentions_classes": False,
                                "first_name_defined": "dumps"}},
    "event_task": {"title": "Open Chess Forum", "date": {"year": 2026, "month": "May", "day": 3},
                   "location": {"city": "Lyon", "country": "France"}, "status": "scheduled",
                   "participants": [{"name": "Ana Ruiz", "role": "speaker"}]},
    "order_task": {"order_id": "A-1234", "customer": {"name": "Owen Price",
                                                      "email": "owen.price@example.org"},
                   "items": [{"sku": "KB-104", "quantity": 2, "unit": "box"}],
                   "priority": "urgent", "paid": False},
}
CALL = {"name": "set_timer", "arguments": {"minutes": 12, "label": "pasta"}}


@pytest.mark.parametrize("name", ["json_extract", "tool_call"])
def test_deterministic_seeded_and_constrained(name):
    a = load_workload(name, TOK, 9, seed=1)
    assert a == load_workload(name, TOK, 9, seed=1)
    assert a != load_workload(name, TOK, 9, seed=2)  # a held-out seed gives other cases
    for item in a:
        assert item.structured is not None and item.max_tokens > 0
        schema = json.loads(item.structured.json)
        jsonschema.Draft202012Validator.check_schema(schema)
        text = TOK.decode(item.prompt_ids)
        assert text.startswith("<|user|>\n") and text.endswith("<|assistant|>\n")
    with pytest.raises(WorkloadUnavailable, match="no long variant"):
        load_workload(name, TOK, 1, seed=0, long=True)


def test_json_extract_covers_its_three_shapes_and_shows_the_schema():
    items = load_workload("json_extract", TOK, 9, seed=0)
    kinds = {it.label.split(":")[1] for it in items}
    assert kinds == set(ANSWERS)
    for it in items:
        schema = json.loads(it.structured.json)
        assert json.dumps(schema) in TOK.decode(it.prompt_ids)
        jsonschema.validate(ANSWERS[it.label.split(":")[1]], schema)


def test_tool_call_offers_the_tool_its_request_needs():
    for it in load_workload("tool_call", TOK, 12, seed=3):
        target = it.label.split(":")[1]
        schema = json.loads(it.structured.json)
        offered = [s["properties"]["name"]["enum"][0] for s in schema["anyOf"]]
        assert target in offered and 3 <= len(offered) <= 5
        assert f'"name": "{target}"' in TOK.decode(it.prompt_ids)
    jsonschema.validate(CALL, required_call_schema(list(TOOLS)))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "set_timer", "arguments": {"minutes": 0, "label": "x"}},
                            required_call_schema(list(TOOLS)))


@pytest.mark.parametrize("schema,answer", [
    (MODULE_SCHEMA, ANSWERS["module_task"]), (EVENT_SCHEMA, ANSWERS["event_task"]),
    (ORDER_SCHEMA, ANSWERS["order_task"]), (required_call_schema(list(TOOLS)), CALL)])
def test_the_grammar_accepts_an_answer_of_the_shape(tiny_llama_dir, schema, answer):
    pytest.importorskip("xgrammar")
    from dynaspec.models.loader import load_tokenizer
    from dynaspec.structured.manager import StructuredOutputManager
    from dynaspec.structured_params import StructuredOutputParams

    tok = load_tokenizer(tiny_llama_dir)
    so = StructuredOutputManager("xgrammar", tok, tok.vocab_size, [0], any_whitespace=False)
    m = so.backend().matcher(so.compile(StructuredOutputParams(json=schema)))
    for t in tok.encode(json.dumps(answer), add_special_tokens=False):
        assert m.accept(t)
    assert m.accept(0) and m.is_terminated()  # complete: its stop token ends it
