"""OpenAI request bodies as pydantic models, validated strictly.

Unknown fields are refused (a misspelt `max_token` would otherwise silently generate with
defaults). Fields OpenAI clients send that change nothing here (`service_tier`, `user`,
`metadata`, `store`) are accepted and say so in their description. The same models are published
in /openapi.json (dynaspec/server/openapi.py), so clients and fuzzers read the real contract;
the parts live beside this module: shared field types (body_fields), structured-output fields
(structured_body), chat messages and tools (chat_body).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

# Re-exported: callers import these from here, as before the split.
from dynaspec.server.body_fields import (  # noqa: F401
    MAX_PROMPTS,
    MAX_TOP_LOGPROBS,
    WHOLE,
    PromptField,
    StopField,
    StreamOptions,
    _ignored,
    _Strict,
    _whole,
)
from dynaspec.server.chat_body import (  # noqa: F401
    ChatMessage,
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    ToolCall,
    ToolDef,
    _json_or_text,
)
from dynaspec.server.errors import APIError, parse_body, validation_error  # noqa: F401
from dynaspec.server.structured_body import JsonSchemaFormat, ResponseFormat, StructuredOutputsBody  # noqa: F401
from dynaspec.structured_params import StructuredOutputParams, schema_text

MAX_N = 16  # choices per prompt; each is a sequence in the engine
# Bounded integers (see body_fields.WHOLE).
_TopK = Annotated[int, Field(ge=-1, le=2**31 - 1), WHOLE]
_Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), WHOLE]
_NonNegative = Annotated[int, Field(ge=0), WHOLE]
_Positive = Annotated[int, Field(ge=1), WHOLE]
_NumChoices = Annotated[int, Field(ge=1, le=MAX_N), WHOLE]
_TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WHOLE]

# Rules between fields, in the published schema as well as in the checks (unsupported(),
# structured_output()), so a body the schema calls valid is not refused for them.
_GRAMMAR_FORMAT = {"type": "object", "required": ["type"],
                   "properties": {"type": {"enum": ["json_object", "json_schema"]}}}
_GIVEN = {"structured_outputs": {"required": ["structured_outputs"],
                                 "properties": {"structured_outputs": {"type": "object"}}},
          "response_format": {"required": ["response_format"],
                              "properties": {"response_format": _GRAMMAR_FORMAT}}}
# response_format (other than text) and structured_outputs: one grammar at most.
_ONE_GRAMMAR: dict[str, Any] = {"not": {"allOf": list(_GIVEN.values())}}
# tool_choice auto/required/{named} needs tools; a forced call is the grammar, so no other.
_FORCING = {"required": ["tool_choice"], "properties": {"tool_choice": {
    "anyOf": [{"const": "required"}, {"type": "object"}]}}}
_TOOL_RULES: list[dict[str, Any]] = [
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
        "anyOf": [{"enum": ["auto", "required"]}, {"type": "object"}]}}},
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
    {"not": {"allOf": [_FORCING, {"anyOf": list(_GIVEN.values())}]}}]
_TOKEN_KEY = r"^[0-9]{1,9}$"
# Said in the schema because a client capping generation must cap floats too: a fuzzer that
# lowered only int max_tokens let `123.0` through, which generated 123 tokens (26 s on 2 cores).
_TOKEN_LIMIT = ("tokens generated at most; a whole-number float is that integer (JSON Schema's "
                "rule): 123.0 generates up to 123 tokens")


class _Common(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: _TopK | None = Field(default=None)  # extension (vLLM's)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension
    seed: _Seed | None = Field(
        default=None, description="choice i of a request samples with seed + i")
    stop: StopField = None  # a string or a list of strings (checked below, one clear message)
    stop_token_ids: list[_NonNegative] | None = None  # extension
    ignore_eos: bool | None = None  # extension
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(default=None,
                                                 description="read only when stream is true")
    n: _NumChoices | None = Field(default=1)
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
    min_tokens: _NonNegative | None = Field(
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
                return StructuredOutputParams(
                    json=None if so.json_ is None else schema_text(so.json_), regex=so.regex,
                    grammar=so.grammar, choice=None if so.choice is None else tuple(so.choice),
                    json_object=bool(so.json_object))
            if rf is None or rf.type == "text":
                return None
            if rf.type == "json_object":
                return StructuredOutputParams(json_object=True)
        except ValueError as exc:
            return _bad(str(exc), "structured_outputs")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            return _bad("response_format of type 'json_schema' needs json_schema.schema",
                        "response_format.json_schema")
        return StructuredOutputParams(json=schema_text(rf.json_schema.schema_))

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra={"allOf": [_ONE_GRAMMAR]})
    prompt: PromptField
    max_tokens: _Positive | None = Field(default=16, description=_TOKEN_LIMIT)  # OpenAI's
    logprobs: _TopLogprobs | None = Field(default=None)
    echo: bool | None = Field(default=False, description="the prompt's text before each choice's")
    best_of: _NumChoices | None = Field(default=None, description=(
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


class ChatCompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra={"allOf": [_ONE_GRAMMAR, *_TOOL_RULES]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: _Positive | None = Field(default=None, description=_TOKEN_LIMIT + "; null: "
                                         "up to the context length")
    max_completion_tokens: _Positive | None = Field(default=None, description=_TOKEN_LIMIT)
    logprobs: bool | None = False
    top_logprobs: _TopLogprobs | None = Field(
        default=None, description="read only when logprobs is true")
    tools: list[ToolDef] | None = Field(default=None, max_length=128, description=(
        "function names must be unique (400 otherwise)"))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="'auto' (default with tools) parses <tool_call>{...}</tool_call> "
        "from the text; 'required' and a named function constrain the output to the tools' "
        "argument schemas, so the arguments always parse; a named function must be one of "
        "tools (400 otherwise: a rule JSON Schema cannot state)")
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


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [  # exactly one of them (400 else)
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(default=True, description="prompt only")
    add_generation_prompt: bool | None = Field(default=True, description="messages only")
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[_NonNegative]


def _bad(message: str, param: str) -> StructuredOutputParams:
    raise APIError(400, message, param, "invalid_value")
