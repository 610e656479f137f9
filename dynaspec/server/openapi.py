"""The request bodies' JSON schemas for /openapi.json, with the served model's limits."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from dynaspec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TextPart,
    TokenizeRequest,
)


def openapi_components(vocab: int | None = None, max_model_len: int | None = None,
                       unspellable: str = "") -> dict:
    """JSON schemas of the request bodies (and what they refer to) plus the error body, keyed
    by name for OpenAPI's components/schemas; with the served model's vocabulary and context
    length, token ids and token limits say their real maximum; `unspellable` (a character
    class: structured/spellable.py) is kept out of choice strings and regexes."""
    _, defs = models_json_schema([(m, "validation") for m in (
        CompletionRequest, ChatCompletionRequest, TextPart, TokenizeRequest, DetokenizeRequest)],
                                 ref_template="#/components/schemas/{model}")
    error = {"type": "object", "required": ["message", "type", "param", "code"],
             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]}}}
    out = {**defs["$defs"], "ErrorResponse": {"type": "object", "required": ["error"],
                                              "properties": {"error": error}}}
    _drop_null_defaults(out)
    _set_limits(out, vocab, max_model_len)
    if unspellable:
        _exclude_chars(out["StructuredOutputsBody"]["properties"], unspellable)
    return out


def _drop_null_defaults(schemas: dict) -> None:
    """pydantic writes `"default": null` for every optional field, also for the fields a body may
    leave out but not send as null (structured_outputs' one-of fields): OpenAPI 3.1 requires a
    default to be valid against its schema, so those say nothing about a default."""
    for schema in schemas.values():
        for prop in schema.get("properties", {}).values():
            if "default" in prop and prop["default"] is None and not _admits_null(prop):
                del prop["default"]


def _admits_null(schema: dict) -> bool:
    types = schema.get("type")
    if types == "null" or (isinstance(types, list) and "null" in types):
        return True
    return any(_admits_null(b) for b in schema.get("anyOf", []) + schema.get("oneOf", []))


def _exclude_chars(props: dict, cls: str) -> None:
    """Choice strings and regexes may not contain a character no token spells (the server
    answers 400: such a grammar could never finish)."""
    props["choice"]["items"]["pattern"] = f"^[^{cls}]*$"
    props["regex"]["pattern"] = f"^[^\\u0000{cls}]*[^\\s\\u0000{cls}][^\\u0000{cls}]*$"
    note = " (no character this model's vocabulary cannot spell)"
    props["choice"]["description"] = "the output is exactly one of these strings" + note
    props["regex"]["description"] += note


def _set_limits(schemas: dict, vocab: int | None, max_model_len: int | None) -> None:
    def cap(schema: dict, maximum: int) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == "integer":
                branch["maximum"] = maximum
            elif branch.get("type") == "array":
                cap(branch["items"], maximum)

    if vocab is not None:
        cap(schemas["CompletionRequest"]["properties"]["prompt"], vocab - 1)
        cap(schemas["DetokenizeRequest"]["properties"]["tokens"], vocab - 1)
    if max_model_len is not None:  # a prompt of token ids must leave room to generate
        ids, batch = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][2:4]
        ids["maxItems"] = batch["items"]["maxItems"] = max_model_len - 1
        for name, fields in (("CompletionRequest", ("max_tokens",)),
                             ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens"))):
            for f in fields:
                cap(schemas[name]["properties"][f], max_model_len - 1)
