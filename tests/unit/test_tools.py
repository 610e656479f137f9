"""Tool-call parsing and streaming (server/tools.py), without a model."""

from __future__ import annotations

import json

from dynaspec.server.protocol import ChatCompletionRequest
from dynaspec.server.tools import ToolStream, parse_tool_calls, tool_plan

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]


def _plan(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **kw}
    return tool_plan(ChatCompletionRequest.model_validate(body))


def test_plans():
    assert _plan(tool_choice="none") is None
    assert _plan().mode == "auto" and _plan().grammar is None
    named = _plan(tool_choice={"type": "function", "function": {"name": "g"}})
    assert named.mode == "named" and json.loads(named.grammar.json) == {"type": "object"}
    req = json.loads(_plan(tool_choice="required").grammar.json)
    assert req["type"] == "array" and req["minItems"] == 1
    one = json.loads(_plan(tool_choice="required", parallel_tool_calls=False).grammar.json)
    assert [b["properties"]["name"]["enum"] for b in one["anyOf"]] == [["f"], ["g"]]


def test_auto_parses_blocks_and_keeps_the_rest_as_content():
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' \
           '<tool_call>{"name": "nope", "arguments": {}}</tool_call>' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(_plan(), text)
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert content is not None and content.startswith("Sure.")
    _, one = parse_tool_calls(_plan(parallel_tool_calls=False), text)
    assert len(one) == 1
    assert parse_tool_calls(_plan(), "no calls") == ("no calls", [])


def test_auto_stream_holds_back_a_possible_tag():
    s = ToolStream(_plan())
    out = [s.update(t, False)[0] for t in ("Hi ", "<tool", "_call>", '{"name": "f", ',
                                           '"arguments": {}}</tool_call>')]
    assert out[0] == {"content": "Hi "} and out[1:] == [None] * 4
    final, called = s.update("", True)
    assert called and final["tool_calls"][0]["function"]["name"] == "f"
    plain = ToolStream(_plan())
    assert plain.update("a <to", False)[0] == {"content": "a "}  # "<to" may begin a tag
    assert plain.update("ol> c", True) == ({"content": "<tool> c"}, False)


def test_named_stream_sends_argument_deltas():
    s = ToolStream(_plan(tool_choice={"type": "function", "function": {"name": "f"}}))
    first, _ = s.update('{"a"', False)
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert s.update(": 1}", True)[0]["tool_calls"][0]["function"] == {"arguments": ": 1}"}
