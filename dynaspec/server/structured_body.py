"""The structured-output request fields: OpenAI's `response_format` and vLLM's
`structured_outputs`, with the grammar languages declared as string formats.

A grammar that does not compile is a 400, and no JSON Schema can say which strings compile, so
each grammar string names its language in `format`: `regex` (JSON Schema's own format; xgrammar
reads ECMA-262 without lookaround, backreferences or inline flags), and two formats of ours,
`xgrammar-ebnf` (an EBNF grammar with a `root` rule) and `json-schema-text` (a JSON Schema as
JSON text). Clients that generate values (fuzzers) register a generator for each format
(dynaspec/bench/fuzz_formats.py does for schemathesis), as OpenAPI intends for custom formats.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from dynaspec.server.body_fields import _Strict

REGEX_FORMAT = "regex"
EBNF_FORMAT = "xgrammar-ebnf"
JSON_SCHEMA_TEXT_FORMAT = "json-schema-text"


# Grammar texts: a non-blank string whose schema names its format.
_JsonSchemaText = Annotated[str, Field(pattern=r"\S", description="a JSON Schema as JSON text",
                                       json_schema_extra={"format": JSON_SCHEMA_TEXT_FORMAT})]
# xgrammar refuses a NUL character in a regex (a literal one; "\\x00" is fine).
_Regex = Annotated[str, Field(
    pattern=r"^[^\u0000]*[^\s\u0000][^\u0000]*$", json_schema_extra={"format": REGEX_FORMAT},
    description="a regular expression the whole output matches (no NUL character, lookaround, "
    "backreferences or inline flags); one that does not compile is a 400")]
_Ebnf = Annotated[str, Field(
    pattern=r"\S", json_schema_extra={"format": EBNF_FORMAT},
    description="an EBNF grammar in xgrammar's dialect, with a rule named root; one that does "
    "not compile is a 400")]


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel method: the field is schema_, the JSON key "schema".
    # Not nullable: a json_schema format needs it (the schema below says so). Absent, it is
    # None: pydantic does not validate defaults, so the type says what a body may send and
    # mypy's arg-type/assignment errors on these None defaults are ignored (here and below).
    schema_: dict = Field(default=None, alias="schema")  # type: ignore[arg-type]
    strict: bool | None = None  # the schema is always enforced; strict only documents that


class ResponseFormat(_Strict):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"]}}}})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's extension: exactly one of json (a schema), regex, grammar (EBNF), choice,
    json_object. Fields are not nullable and exactly one is given, as the schema says."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1, "maxProperties": 1})
    json_: dict | _JsonSchemaText = Field(  # type: ignore[assignment]
        default=None, alias="json", description="a JSON Schema (an object, or its JSON text); "
        "one that does not compile is a 400")
    # Absent fields are None (see JsonSchemaFormat.schema_): not nullable in a body.
    regex: _Regex = None  # type: ignore[assignment]
    grammar: _Ebnf = None  # type: ignore[assignment]
    choice: list[Annotated[str, Field(min_length=1)]] = Field(
        default=None, min_length=1)  # type: ignore[arg-type]
    json_object: Literal[True] = None  # type: ignore[assignment]

