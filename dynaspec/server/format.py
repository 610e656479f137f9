"""One request's OpenAI JSON objects: choices, chunks, logprobs, usage and the extension field.

A request has one choice per (prompt, sample): choice index = prompt index * n + sample index,
as vLLM numbers batched completions. Usage counts each prompt once (however many choices it
has), every choice's completion tokens, and `prompt_tokens_details.cached_tokens`: the prompt
tokens the prefix cache served (for a prompt with several choices, those of its first choice,
so cached_tokens <= prompt_tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynaspec.server.async_engine import OutputDelta
from dynaspec.server.tools import ToolPlan, parse_tool_calls


@dataclass
class Finished:
    """A choice's collected output."""

    index: int
    prompt_index: int
    final: OutputDelta
    ids: list[int]
    logprobs: list
    echo: str = ""
    first: bool = True

    @property
    def mean_logprob(self) -> float:
        """best_of's ranking: the mean logprob of the chosen tokens."""
        return sum(lp for lp, _ in self.logprobs) / max(1, len(self.logprobs))


@dataclass
class Usage:
    prompt: dict[int, int] = field(default_factory=dict)  # prompt index -> tokens
    cached: dict[int, int] = field(default_factory=dict)  # prompt index -> cached tokens
    completion: int = 0

    def add(self, prompt_index: int, final: OutputDelta, first_choice: bool) -> None:
        self.completion += final.num_output_tokens
        if final.num_prompt_tokens:
            self.prompt.setdefault(prompt_index, final.num_prompt_tokens)
        if first_choice:
            self.cached[prompt_index] = final.num_cached_tokens

    def body(self) -> dict:
        p = sum(self.prompt.values())
        return {"prompt_tokens": p, "completion_tokens": self.completion,
                "total_tokens": p + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


class Formatter:
    def __init__(self, model: str, token_str: Callable[[int], str], rid: str, chat: bool,
                 want_logprobs: bool, tools: ToolPlan | None = None) -> None:
        self.rid, self.chat, self.want_logprobs, self.tools = rid, chat, want_logprobs, tools
        self.model, self.created = model, int(time.time())
        self.token_str = token_str
        self.offsets: dict[int, int] = {}  # completions' text_offset runs across chunks

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, index: int, ids: list[int], entries: list | None) -> dict | None:
        if not self.want_logprobs or not entries:
            return None
        toks = [self.token_str(i) for i in ids[:len(entries)]]
        if self.chat:
            content = [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                        "top_logprobs": [self._top(i, v) for i, v in top]}
                       for t, (lp, top) in zip(toks, entries)]
            return {"content": content, "refusal": None}
        offsets, at = [], self.offsets.get(index, 0)
        for t in toks:
            offsets.append(at)
            at += len(t)
        self.offsets[index] = at
        return {"tokens": toks, "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [{self.token_str(i): v for i, v in top} for _, top in entries],
                "text_offset": offsets}

    def _top(self, token_id: int, logprob: float) -> dict:
        t = self.token_str(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

    @staticmethod
    def extension(final: OutputDelta) -> dict:
        t = final.timings
        return {"spec": final.spec.to_json() if final.spec is not None else None,
                "ttft_s": t.ttft_s if t else None, "e2e_s": t.e2e_s if t else None}

    def start_offset(self, index: int, echo: str) -> None:
        """text_offset counts from the start of the choice's text, echoed prompt included."""
        self.offsets.setdefault(index, len(echo))

    def choice(self, index: int, f: Finished) -> dict:
        self.start_offset(index, f.echo)
        lp = self.logprobs(index, f.ids, f.logprobs)
        finish = f.final.finish_reason
        if not self.chat:
            return {"index": index, "text": f.echo + f.final.text, "logprobs": lp,
                    "finish_reason": finish}
        message: dict[str, Any] = {"role": "assistant", "content": f.final.text}
        if self.tools is not None:
            content, calls = parse_tool_calls(self.tools, f.final.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}

    def response(self, done: list[Finished], usage: Usage) -> dict:
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": [self.choice(i, f) for i, f in enumerate(done)],
                "usage": usage.body(), "system_fingerprint": None,
                "dynaspec": self.extension(done[0].final) if len(done) == 1 else
                [self.extension(f.final) for f in done]}

    def chunk(self, index: int, content: Any, lp: dict | None, finish: str | None,
              with_usage: bool) -> dict:
        if self.chat:
            choice = {"index": index, "delta": content, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": content, "logprobs": lp, "finish_reason": finish}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
               "choices": [choice]}
        if with_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage.body()}
