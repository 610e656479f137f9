"""The published schema and the server agree on bodies that break a rule between fields, the
grammar-format generators produce grammars that compile, the fuzz hooks keep valid bodies valid
(and invalid ones invalid), and a prompt the vocabulary cannot encode starts a document."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from dynaspec.server.openapi import openapi_components
from dynaspec.server.params import prompts_ids
from dynaspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    parse_body,
)

jsonschema = pytest.importorskip("jsonschema")

M = [{"role": "user", "content": "hi"}]
T = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "f"}}
JSON_FMT = {"type": "json_object"}
CHAT, COMP, TOK = "ChatCompletionRequest", "CompletionRequest", "TokenizeRequest"
BODIES = [  # (schema, body, valid)
    (CHAT, {"tool_choice": "none"}, True),
    (CHAT, {"tool_choice": "auto"}, False),
    (CHAT, {"tool_choice": "auto", "tools": []}, False),
    (CHAT, {"tool_choice": "auto", "tools": T}, True),
    (CHAT, {"tool_choice": NAMED}, False),
    (CHAT, {"tool_choice": NAMED, "tools": T}, True),
    # No tool is named "": the schema says a choice names like a tool (the fuzzer's find).
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": ""}}, "tools": T}, False),
    (CHAT, {"tool_choice": "required", "tools": T, "structured_outputs": {"regex": "a"}}, False),
    (CHAT, {"tool_choice": "required", "tools": T, "structured_outputs": None}, True),
    (CHAT, {"tool_choice": NAMED, "tools": T, "response_format": JSON_FMT}, False),
    (CHAT, {"tool_choice": "required", "tools": T, "response_format": {"type": "text"}}, True),
    (CHAT, {"tool_choice": "auto", "tools": T, "response_format": JSON_FMT}, True),
    (COMP, {"response_format": JSON_FMT, "structured_outputs": {"regex": "a"}}, False),
    (COMP, {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}}, True),
    (COMP, {"response_format": JSON_FMT, "structured_outputs": None}, True),
    (COMP, {"structured_outputs": {"regex": "a\x00"}}, False),  # xgrammar refuses NUL
    (TOK, {}, False),
    (TOK, {"prompt": "a", "messages": None}, True),
    (TOK, {"prompt": None, "messages": M}, True),
    (TOK, {"prompt": "a", "messages": M}, False),
    (TOK, {"prompt": None, "messages": None}, False),
]
MODELS = {CHAT: ChatCompletionRequest, COMP: CompletionRequest, TOK: TokenizeRequest}


def _server_accepts(model, body: dict) -> bool:
    try:
        req = parse_body(model, json.dumps(body).encode())
        if model is TokenizeRequest:
            return (req.prompt is None) != (req.messages is None)
        if (err := req.unsupported()) is not None:
            raise err
        req.structured_output()
    except APIError:
        return False
    return True


@pytest.mark.parametrize("name, body, valid", BODIES)
def test_schema_and_server_agree_on_rules_between_fields(name, body, valid):
    comps = openapi_components(1000, 256)
    base = {CHAT: {"model": "m", "messages": M}, COMP: {"model": "m", "prompt": "a"}}.get(name, {})
    full = {**base, **body}
    schema = {**comps[name], "components": {"schemas": comps}}
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(full))
    assert (not errors) is valid, errors
    assert _server_accepts(MODELS[name], full) is valid


def test_grammar_strings_declare_their_language():
    props = openapi_components()["StructuredOutputsBody"]["properties"]
    assert props["regex"]["format"] == "regex"
    assert props["grammar"]["format"] == "xgrammar-ebnf"
    assert props["json"]["anyOf"][1]["format"] == "json-schema-text"


def test_format_generators_compile(default_gguf_path):
    pytest.importorskip("xgrammar")
    hyp = pytest.importorskip("hypothesis")
    from dynaspec.bench.fuzz_formats import ebnf_values, json_schema_values
    from dynaspec.models.loader import load_tokenizer
    from dynaspec.structured.xgrammar_backend import XGrammarBackend
    from dynaspec.structured_params import StructuredOutputParams

    tok = load_tokenizer(default_gguf_path)
    backend = XGrammarBackend(tok, tok.vocab_size, [tok.eos_token_id], False)

    for field, strategy in (("grammar", ebnf_values()),
                            ("json", json_schema_values().map(json.dumps))):
        @hyp.settings(max_examples=150, derandomize=True, database=None, deadline=None)
        @hyp.given(strategy)
        def compiles(value: str) -> None:  # run at once, inside this iteration
            backend.compile(StructuredOutputParams(**{field: value}))  # noqa: B023

        compiles()


def _hooks(monkeypatch):
    pytest.importorskip("schemathesis")
    monkeypatch.setenv("FUZZ_MAX_TOKENS", "2")
    monkeypatch.setenv("FUZZ_MAX_MODEL_LEN", "4096")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "clients",
                        "fuzz_hooks.py")
    spec = importlib.util.spec_from_file_location("fuzz_hooks_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fuzz_hooks_cap_whole_number_floats_and_leave_invalid_values(monkeypatch):
    hooks = _hooks(monkeypatch)
    for given, want in ((2047.0, 2), (2047, 2), (4095.0, 2), (2.0, 2.0), (1, 1), (0, 0),
                        (-1, -1), (1.5, 1.5), ("9", "9"), (4096, 4096), (99999.0, 99999.0),
                        (True, True)):
        body = {"max_tokens": given}
        hooks._cap_tokens(body)
        # 4096+ is above the schema's maximum (max_model_len - 1): left invalid
        assert body == {"max_tokens": want}, given
    body = {"max_completion_tokens": None}
    hooks._cap_tokens(body)
    assert body == {"max_tokens": 2}


def test_fuzz_hooks_apply_the_rules_json_schema_cannot_state(monkeypatch):
    hooks = _hooks(monkeypatch)
    body = {"tools": [{"function": {"name": "a"}}, {"function": {"name": "a"}}],
            "tool_choice": {"type": "function", "function": {"name": "zz"}}}
    hooks._tool_rules(body)
    assert [t["function"]["name"] for t in body["tools"]] == ["a", "a_1"]
    assert body["tool_choice"]["function"]["name"] == "a"
    ids = {"prompt": [[1] * 5000, [2] * 3], "max_tokens": 2}
    hooks._fit_prompt(ids)
    assert [len(p) for p in ids["prompt"]] == [4094, 3]


class _Tok:
    bos_token_id, eos_token_id = None, 7

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text if c.isprintable()]  # drops what it cannot encode


def test_a_prompt_the_vocabulary_cannot_encode_starts_a_document():
    req = parse_body(CompletionRequest, b'{"model": "m", "prompt": ["\\u0014", "ab"]}')
    assert prompts_ids(_Tok(), req, None) == [[7], [97, 98]]


def test_unspellable_characters_of_the_default_vocabulary(default_gguf_path):
    import re

    from dynaspec.models.loader import load_tokenizer
    from dynaspec.structured.spellable import first_unspellable, pattern_class, unspellable_ranges

    tok = load_tokenizer(default_gguf_path)
    ranges = unspellable_ranges(tok)
    assert ranges == ((0x04, 0x04), (0x06, 0x06), (0x13, 0x14), (0x16, 0x16), (0x1D, 0x1D),
                      (0x40000, 0xBFFFF))  # six control bytes, lead bytes F1 and F2
    for ch in "\x14\U0005e659":
        assert tok.decode(tok.encode("a" + ch + "a", add_special_tokens=False)) != "a" + ch + "a"
    assert first_unspellable("ok \U0001F600", ranges) is None
    assert first_unspellable("x\x13", ranges) == "\x13"
    cls = re.compile(f"^[^{pattern_class(ranges)}]*$")
    assert cls.match("ok \U0001F600") and not cls.match("x\x13") and not cls.match("\U00087d5e")
