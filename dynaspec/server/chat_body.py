"""Chat message bodies: text parts, tool definitions, tool calls and the named tool choice."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from dynaspec.server.body_fields import ContentField, _ignored, _Strict


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


# OpenAI's rule for a function's name; a tool choice naming anything else can never be one of
# the tools, so the published schema says so too.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = Field(default=None, description="a JSON schema of the arguments")
    strict: bool | None = _ignored("arguments always follow the schema when constrained")


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME, description="one of the tools' names")


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


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
