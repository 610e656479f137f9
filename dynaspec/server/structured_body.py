"""The structured-output request fields: OpenAI's `response_format` and vLLM's
`structured_outputs`, with the grammar languages declared as string formats."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from dynaspec.server.body_fields import _Strict

class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel method: the field is schema_, the JSON key "schema".
    # Not nullable: a json_schema format needs it (the schema below says so).
    schema_: dict = Field(default=None, alias="schema")
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
    json_: dict | Annotated[str, Field(pattern=r"\S")] = Field(default=None, alias="json")
    regex: Annotated[str, Field(pattern=r"\S")] = None
    grammar: Annotated[str, Field(pattern=r"\S")] = None
    choice: list[Annotated[str, Field(min_length=1)]] = Field(default=None, min_length=1)
    json_object: Literal[True] = None

