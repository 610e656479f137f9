"""OpenAI request bodies as pydantic models, validated strictly, plus error formatting.

Strict JSON validation: `"max_tokens": "16"` or `true` is a wrong type, as OpenAI's own API says,
rather than being coerced; a whole-number float (`16.0`) is an integer, as JSON Schema says, so
the published schema and the validator agree. Unknown fields are refused (a misspelt `max_token`
would otherwise silently generate with defaults). Fields OpenAI clients send that change nothing
here (`service_tier`, `user`, `metadata`, `store`) are accepted and say so in their description.
The same models are published in /openapi.json, so clients and fuzzers read the real contract.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.json_schema import models_json_schema

# Re-exported: callers import the error helpers from here, as before the split.
from dynaspec.server.errors import APIError, parse_body, validation_error  # noqa: F401
from dynaspec.structured.params import StructuredOutputParams

MAX_TOP_LOGPROBS = 20  # SamplingParams' bound


def _whole(v: Any) -> Any:
    """A float with no fraction is an integer (JSON Schema's rule); anything else is left to the
    strict int check, which names it."""
    return int(v) if type(v) is float and v.is_integer() and abs(v) < 2**63 else v


Int = Annotated[int, BeforeValidator(_whole)]


def IntIn(**bounds: int) -> Any:  # noqa: N802 - a type
    """An integer with bounds inside the type, so the published schema says minimum/maximum
    (bounds on an Optional field's Field() come out as pydantic's own "ge"/"le" keys)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


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


MAX_N = 16  # choices per prompt; each is a sequence in the engine
_TOKEN_KEY = r"^[0-9]{1,9}$"


class _Common(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: IntIn(ge=-1, le=2**31 - 1) | None = Field(default=None)  # extension (vLLM's)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension
    seed: IntIn(ge=-(2**63), lt=2**64) | None = Field(
        default=None, description="choice i of a request samples with seed + i")
    stop: StopField = None  # a string or a list of strings (checked below, one clear message)
    stop_token_ids: list[IntIn(ge=0)] | None = None  # extension
    ignore_eos: bool | None = None  # extension
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(default=None,
                                                 description="read only when stream is true")
    n: IntIn(ge=1, le=MAX_N) | None = Field(default=1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=2.0)  # extension
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=_TOKEN_KEY)],
                               Annotated[float, Field(ge=-100.0, le=100.0)]] | None,
                          WithJsonSchema({"anyOf": [{"type": "object", "patternProperties": {
                              _TOKEN_KEY: {"type": "number", "minimum": -100, "maximum": 100}},
                              "additionalProperties": False}, {"type": "null"}]})] = Field(
        default=None, description="token id (as a string) -> bias added to its logit; ids "
        "outside the vocabulary can never be generated, so their bias changes nothing")
    min_tokens: IntIn(ge=0) | None = Field(
        default=None, description="EOS and stop_token_ids are banned until this many tokens "
        "are out (at most the token limit: larger values mean the limit)")
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = Field(default=None,
                                                                         max_length=64,
                                        description="strings never generated (vLLM's)")
    user: str | None = _ignored("a label for the caller")
    metadata: dict[str, str] | None = _ignored("stored completions are not kept")
    store: bool | None = _ignored("stored completions are not kept")
    service_tier: str | None = _ignored("there is one tier")
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
        """A clear 400 for a combination of fields dynaspec refuses."""
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
    max_tokens: IntIn(ge=1) | None = Field(default=16)  # OpenAI's legacy default
    logprobs: IntIn(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(default=None)
    echo: bool | None = Field(default=False, description="the prompt's text before each choice's")
    best_of: IntIn(ge=1, le=MAX_N) | None = Field(default=None, description=(
        "sequences generated per prompt, of which the n with the highest mean token logprob are "
        "returned; values below n mean n, and a streamed request generates n"))
    # The schema allows only what is served (no fill-in-the-middle template); the check in
    # unsupported() gives the clear message.
    suffix: Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0},
                                                            {"type": "null"}]})] = Field(
        default=None, description="only null or \"\": this server has no fill-in-the-middle "
        "template (400 otherwise)")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        """The prompts, always as a list: one string or token-id list, or a batch of either."""
        if isinstance(v, str) or _is_ids(v):
            v = [v]
        if not isinstance(v, list) or not v or not (all(isinstance(p, str) for p in v)
                                                    or all(_is_ids(p) for p in v)):
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists")
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts, got {len(v)}")
        if any(p == "" for p in v):
            raise ValueError("prompt strings must be non-empty")
        return [p if isinstance(p, str) else [_whole(t) for t in p] for p in v]

    def unsupported(self) -> APIError | None:
        if self.suffix:
            return APIError(400, "suffix is not supported: this server has no fill-in-the-middle "
                            "template", "suffix", "unsupported")
        return super().unsupported()


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        (type(t) is int or (type(t) is float and t.is_integer())) and 0 <= t < 2**63 for t in v)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(default=None, description="a JSON schema of the arguments")
    strict: bool | None = _ignored("arguments always follow the schema when constrained")


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ContentField = None  # a string or a list of text parts (checked below)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls

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
    max_tokens: IntIn(ge=1) | None = Field(default=None)  # None: up to the context limit
    max_completion_tokens: IntIn(ge=1) | None = Field(default=None)
    logprobs: bool | None = False
    top_logprobs: IntIn(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        default=None, description="read only when logprobs is true")
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="'auto' (default with tools) parses <tool_call>{...}</tool_call> "
        "from the text; 'required' and a named function constrain the output to the tools' "
        "argument schemas, so the arguments always parse")
    parallel_tool_calls: bool | None = Field(
        default=None, description="honoured: false allows at most one call (default true)")

    def unsupported(self) -> APIError | None:
        if (err := _tool_errors(self)) is not None:
            return err
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def chat_messages(self) -> list[dict]:
        # "developer" is OpenAI's newer name for "system"; HF templates only know "system".
        out = []
        for m in self.messages:
            msg: dict = {"role": "system" if m.role == "developer" else m.role,
                         "content": m.text()}
            if m.tool_calls:  # templates read the arguments as a mapping (as vLLM gives them)
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template's `tools` variable (OpenAI's shape)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _tool_errors(req: ChatCompletionRequest) -> APIError | None:
    names = [t.function.name for t in req.tools or ()]
    choice = req.tool_choice
    if choice is not None and choice != "none" and not names:
        return APIError(400, f"tool_choice {_choice_label(choice)} needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return APIError(400, f"tool_choice names '{choice.function.name}', which is not among "
                        f"the tools ({', '.join(names)})", "tool_choice.function.name")
    if len(set(names)) != len(names):
        return APIError(400, "tool names must be unique", "tools")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and (req.response_format is not None and req.response_format.type != "text"
                   or req.structured_outputs is not None):
        return APIError(400, "a forced tool call already constrains the output; drop "
                        "response_format / structured_outputs", "tool_choice")
    return None


def _choice_label(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"'{choice.function.name}'"


def _json_or_text(text: str) -> Any:
    import json
    try:
        return json.loads(text)
    except ValueError:
        return text


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(default=True, description="prompt only")
    add_generation_prompt: bool | None = Field(default=True, description="messages only")
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[IntIn(ge=0)]


def _bad(message: str, param: str) -> StructuredOutputParams:
    raise APIError(400, message, param, "invalid_value")


def openapi_components(vocab: int | None = None, max_model_len: int | None = None) -> dict:
    """JSON schemas of the request bodies (and what they refer to) plus the error body, keyed
    by name for OpenAPI's components/schemas; with the served model's vocabulary and context
    length, token ids and token limits say their real maximum."""
    _, defs = models_json_schema([(m, "validation") for m in (
        CompletionRequest, ChatCompletionRequest, TextPart, TokenizeRequest, DetokenizeRequest)],
                                 ref_template="#/components/schemas/{model}")
    error = {"type": "object", "required": ["message", "type", "param", "code"],
             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]}}}
    out = {**defs["$defs"], "ErrorResponse": {"type": "object", "required": ["error"],
                                              "properties": {"error": error}}}
    _set_limits(out, vocab, max_model_len)
    return out


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
