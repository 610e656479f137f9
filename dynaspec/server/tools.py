"""Tool calling for /v1/chat/completions: the grammar a tool_choice implies; tool_calls from text.

- `none`: the tools are not rendered and nothing is parsed.
- `auto` (the default when tools are given): the tools go to the chat template (its `tools`
  variable) and the model answers freely; `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks in the text (the Hermes/Qwen convention most templates teach) become tool_calls.
- a named function: the output is constrained to that function's argument schema through the
  structured-output backend, so the arguments always parse; the whole text is the arguments.
- `required`: the output is constrained to `{"name": <one of the tools>, "arguments": <its
  schema>}`, a non-empty array of them when parallel_tool_calls is true (the default).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from dynaspec.server.protocol import ChatCompletionRequest, NamedToolChoice
from dynaspec.structured_params import StructuredOutputParams, schema_text

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    schemas: dict[str, dict]  # tool name -> its argument schema
    named: str | None
    parallel: bool
    grammar: StructuredOutputParams | None  # the constraint, for required and named


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    if not req.tools or req.tool_choice == "none":
        return None
    schemas = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools}
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return ToolPlan("named", schemas, name, False,
                        StructuredOutputParams(json=schema_text(schemas[name])))
    if choice == "required":
        one = {"anyOf": [{"type": "object", "properties": {"name": {"enum": [n]}, "arguments": s},
                          "required": ["name", "arguments"], "additionalProperties": False}
                         for n, s in schemas.items()]}
        schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
        return ToolPlan("required", schemas, None, parallel,
                        StructuredOutputParams(json=schema_text(schema)))
    return ToolPlan("auto", schemas, None, parallel, None)


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished text."""
    if plan.mode == "named":
        return None, [new_call(plan.named or "", text)]
    if plan.mode == "required":
        try:
            data = json.loads(text)
        except ValueError:  # cut by max_tokens: the grammar could not finish it
            return text, []
        items = data if isinstance(data, list) else [data]
        return None, [new_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                      for c in items]
    calls = []
    for block in _BLOCK.findall(text):
        call = _auto_call(plan, block)
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls[:None if plan.parallel else 1]


def _auto_call(plan: ToolPlan, block: str) -> dict | None:
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in plan.schemas:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return new_call(data["name"], args if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False))


class ToolStream:
    """Turns a choice's text deltas into chat deltas when tools are in play.

    named: argument deltas as they come (the first carries the call's id and name).
    required: nothing until the end, then the calls. auto: content streams, except that text
    from an (even partial) `<tool_call>` on is held, and parsed into calls at the end.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content or arguments
        self.call: dict | None = None

    def update(self, new: str, finished: bool) -> tuple[dict | None, bool]:
        """(the delta to send or None, whether the choice ended in tool calls)."""
        self.text += new
        if self.plan.mode == "named":
            return self._named(new), finished
        if self.plan.mode == "auto" and not finished:
            at = self.text.find(OPEN_TAG, self.sent)
            end = at if at >= 0 else _safe_end(self.text)
            if end > self.sent:
                text, self.sent = self.text[self.sent:end], end
                return {"content": text}, False
            return None, False
        if not finished:
            return None, False
        content, calls = parse_tool_calls(self.plan, self.text)
        delta: dict = {}
        if content and self.plan.mode == "auto":
            rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
            if rest:
                delta["content"] = rest
        elif content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return delta or None, bool(calls)

    def _named(self, new: str) -> dict | None:
        if self.call is None:
            self.call = new_call(self.plan.named or "", "")
            head = {"index": 0, "id": self.call["id"], "type": "function",
                    "function": {"name": self.plan.named, "arguments": new}}
            return {"tool_calls": [head]}
        if not new:
            return None
        return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]}


def _safe_end(text: str) -> int:
    """Where content may be sent up to: before a trailing prefix of `<tool_call>`."""
    for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-k:]):
            return len(text) - k
    return len(text)
