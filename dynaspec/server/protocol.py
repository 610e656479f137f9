"""OpenAI request bodies as pydantic models, validated strictly, plus error formatting.

Strict JSON validation: `"max_tokens": "16"` or `true` is a wrong type, as OpenAI's own API says,
rather than being coerced. Unknown fields are refused (a misspelt `max_token` would otherwise
silently generate with defaults). Fields that OpenAI accepts but dynaspec cannot honour are parsed
and refused with a message naming them, so a client never gets a silently different behaviour.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator
from pydantic.json_schema import models_json_schema

from dynaspec.structured.params import StructuredOutputParams

MAX_TOP_LOGPROBS = 20  # SamplingParams' bound


class APIError(Exception):
    """An error the API returns as `{"error": {...}}` with `status`."""

    _TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
              404: "invalid_request_error", 405: "invalid_request_error",
              413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self._TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


# Fields typed Any are checked by a validator (one clear message); their published schema says
# what the validator accepts, so /openapi.json tells clients and fuzzers the real contract.
_STR_LIST = {"type": "array", "items": {"type": "string", "minLength": 1}}
StopField = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1},
                                                     {**_STR_LIST, "maxItems": 16},
                                                     {"type": "null"}]})]
PromptField = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]})]
ContentField = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"$ref": "#/components/schemas/TextPart"}},
    {"type": "null"}]})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel method: the field is schema_, the JSON key "schema".
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced; strict only documents that


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's extension: exactly one of json (a schema), regex, grammar (EBNF), choice,
    json_object."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class _Common(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension (vLLM's)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension
    seed: int | None = None
    stop: StopField = None  # a string or a list of strings (checked below, one clear message)
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool | None = None  # extension
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored, as a label only
    metadata: dict[str, str] | None = None  # accepted and ignored
    store: bool | None = None  # accepted and ignored
    response_format: ResponseFormat | None = None  # on completions too, as vLLM accepts it
    structured_outputs: StructuredOutputsBody | None = None  # extension (vLLM's)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else v
        if v is None:
            return None
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("stop must be a string or a list of strings")
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(items)}")
        return v

    def unsupported(self) -> APIError | None:
        """A clear 400 for a valid OpenAI field whose behaviour dynaspec does not implement."""
        if self.n not in (None, 1):
            return APIError(400, f"n={self.n} is not supported: dynaspec returns one choice per "
                            "request; send n separate requests (with different seeds)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return APIError(400, f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            return APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            return APIError(400, "stream_options is only allowed when stream is true",
                            "stream_options")
        return None

    def structured_output(self) -> StructuredOutputParams | None:
        """The grammar this request asks for, or None; a 400 naming the field when malformed."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            return _bad("give either response_format or structured_outputs, not both",
                        "structured_outputs")
        try:
            if so is not None:
                return StructuredOutputParams(json=so.json_, regex=so.regex, grammar=so.grammar,
                                              choice=so.choice, json_object=bool(so.json_object))
            if rf is None or rf.type == "text":
                return None
            if rf.type == "json_object":
                return StructuredOutputParams(json_object=True)
        except ValueError as exc:
            return _bad(str(exc), "structured_outputs")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            return _bad("response_format of type 'json_schema' needs json_schema.schema",
                        "response_format.json_schema")
        return StructuredOutputParams(json=rf.json_schema.schema_)

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    prompt: PromptField
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's legacy default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        """One prompt: a string or token ids (a one-element batch of either is unwrapped)."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(type(t) is int for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            raise ValueError(f"batched prompts ({len(v)}) are not supported; send one prompt "
                             "per request")
        raise ValueError("prompt must be a string or a non-empty list of integer token ids")

    def unsupported(self) -> APIError | None:
        if self.echo:
            return APIError(400, "echo is not supported", "echo")
        if self.best_of not in (None, 1):
            return APIError(400, f"best_of={self.best_of} is not supported (only 1)", "best_of")
        if self.suffix:
            return APIError(400, "suffix is not supported", "suffix")
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ContentField = None  # a string or a list of text parts (checked below)
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str | list[TextPart] | None:
        if v is None or isinstance(v, str):
            return v
        ok = isinstance(v, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in v)
        if not ok:
            raise ValueError("content must be a string or a list of {\"type\": \"text\", "
                             "\"text\": ...} parts (images and other parts are not supported)")
        return [TextPart(type="text", text=p["text"]) for p in v]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: up to the context limit
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> APIError | None:
        if self.tools:
            return APIError(400, "tools are not supported", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            return APIError(400, "tool_choice is not supported", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            return APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def chat_messages(self) -> list[dict]:
        # "developer" is OpenAI's newer name for "system"; HF templates only know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def _bad(message: str, param: str) -> StructuredOutputParams:
    raise APIError(400, message, param, "invalid_value")


def parse_body(model: type[_Strict], raw: bytes) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {msg}", None, "invalid_json")
    if kind == "model_type" and not err["loc"]:
        return APIError(400, "request body must be a JSON object", None, "invalid_body")
    # Union members show up in the location ("stop.str"): keep only the field path.
    param = ".".join(str(p) for p in err["loc"] if not _is_type_tag(p)) or None
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field '{param}'", param, "unknown_field")
    if kind == "missing":
        return APIError(400, f"'{param}' is required", param, "missing_field")
    if kind == "value_error" and param and msg.startswith(param.split(".")[-1]):
        return APIError(400, msg, param, "invalid_value")  # the message already names the field
    got = err.get("input")
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    detail = f" (got {shown})" if kind.endswith(("_type", "_than", "_equal", "literal_error")) else ""
    return APIError(400, f"'{param}': {msg}{detail}", param, "invalid_value")


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict")
                                      or "[" in part or part.startswith("function-"))


def openapi_components() -> dict:
    """JSON schemas of the request bodies (and what they refer to) plus the error body, keyed
    by name for OpenAPI's components/schemas."""
    _, defs = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest,
                                                             TextPart)],
                                 ref_template="#/components/schemas/{model}")
    error = {"type": "object", "required": ["message", "type", "param", "code"],
             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]}}}
    return {**defs["$defs"], "ErrorResponse": {"type": "object", "required": ["error"],
                                               "properties": {"error": error}}}
