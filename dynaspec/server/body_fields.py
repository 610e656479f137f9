"""Field types shared by the request bodies (dynaspec/server/protocol.py and its parts).

Strict JSON validation: `"max_tokens": "16"` or `true` is a wrong type, as OpenAI's own API says,
rather than being coerced; a whole-number float (`16.0`) is an integer, as JSON Schema says, so
the published schema and the validator agree. Fields typed Any are checked by a validator (one
clear message); their published schema says what the validator accepts.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

MAX_TOP_LOGPROBS = 20  # SamplingParams' bound


def _whole(v: Any) -> Any:
    """A float with no fraction is an integer (JSON Schema's rule); anything else is left to the
    strict int check, which names it."""
    return int(v) if type(v) is float and v.is_integer() and abs(v) < 2**63 else v


Int = Annotated[int, BeforeValidator(_whole)]


# A bounded integer is Annotated[int, Field(ge=..., le=...), WHOLE]: bounds inside the type, so
# the published schema says minimum/maximum (bounds on an Optional field's Field() come out as
# pydantic's own "ge"/"le" keys). Spelt out, not built by a function, so type checkers read it.
WHOLE = BeforeValidator(_whole)


def _ignored(what: str) -> Any:
    return Field(default=None, description=f"Accepted and ignored: {what}")


# Fields typed Any are checked by a validator (one clear message); their published schema says
# what the validator accepts, so /openapi.json tells clients and fuzzers the real contract.
_STR_LIST = {"type": "array", "items": {"type": "string", "minLength": 1}}
StopField = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1},
                                                     {**_STR_LIST, "maxItems": 16},
                                                     {"type": "null"}]})]
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
MAX_PROMPTS = 16  # prompts in one batched /v1/completions request
PromptField = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
     "maxItems": MAX_PROMPTS},
    _IDS,
    {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_PROMPTS}],
    "description": "a string, a list of strings, token ids, or a list of token-id lists"})]
ContentField = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"$ref": "#/components/schemas/TextPart"}},
    {"type": "null"}]})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    include_spec_steps: bool | None = Field(
        default=False, description="extension: each chunk carries dynaspec.step, the engine "
        "step that produced it (k: the step's K or null with speculation off; drafted and "
        "accepted: this request's valid drafts and accepted drafts; tokens: tokens emitted). "
        "Absent under data parallelism (the ranks keep their step records)")

