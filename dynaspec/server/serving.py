"""OpenAI completions and chat completions over the AsyncEngine: prompt -> params -> response.

Both endpoints share one path: check the model and the fields dynaspec refuses, build each
prompt's token ids and SamplingParams (server/params.py; context-length errors are a 400 before
anything is queued), queue one engine request per choice, then either collect the final outputs
or stream SSE chunks merged from every choice. The choices of one prompt share its KV through
the prefix cache: the first is queued alone and the siblings once its prefill is done, so they
find the prompt's full blocks cached instead of computing them again. A request whose client goes
away has every unfinished choice aborted, whichever way it was sent, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dynaspec.engine.client import EngineUnavailable
from dynaspec.scheduler.scheduler import GRAMMAR_DEAD_END
from dynaspec.server.async_engine import AsyncEngine, OutputDelta, RequestStream
from dynaspec.server.format import Finished, Formatter, Usage
from dynaspec.server.params import base_params, choice_params, prompts_ids
from dynaspec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from dynaspec.server.sse import SSEResponse, TextTracker, sse, wait_disconnect
from dynaspec.server.tools import ToolPlan, ToolStream, tool_plan
from dynaspec.structured.spellable import Ranges, first_unspellable, unspellable_ranges
from dynaspec.structured_params import StructuredOutputParams

MAX_CHOICES = 256  # engine requests one API request may start (prompts x best_of)


@dataclass
class _Choice:
    index: int
    prompt_index: int
    stream: RequestStream
    echo: str = ""
    first: bool = True  # the prompt's first choice (its usage counts the prompt's cached tokens)
    pending: list = field(default_factory=list)  # deltas read early (the first choice's first)

    async def get(self) -> OutputDelta | None:
        return self.pending.pop(0) if self.pending else await self.stream.get()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        tok = engine.tokenizer
        self._token_str = functools.lru_cache(maxsize=1 << 16)(
            lambda i: tok.decode([i], skip_special_tokens=False))
        card = engine.engine.model_card()
        self._share_after = card.block_size if card.prefix_caching else None
        self.vocab = card.vocab_size

    @functools.cached_property
    def unspellable(self) -> Ranges:
        """Characters no token spells (a grammar needing one could never finish)."""
        return unspellable_ranges(self.engine.tokenizer)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{self.model_name}'", "model", "model_not_found")

    # ---- the endpoint --------------------------------------------------------------------------
    async def handle(self, request: Any, req: CompletionRequest | ChatCompletionRequest) -> Any:
        marks = {"accept": time.monotonic()}  # the request timeline's (request_timeline.py)
        self.check_model(req.model)
        if (err := req.unsupported()) is not None:
            raise err
        chat = isinstance(req, ChatCompletionRequest)
        tools = tool_plan(req) if isinstance(req, ChatCompletionRequest) else None
        n = req.n or 1
        # best_of below n means n; a stream cannot rank, so it generates n (both documented).
        n_gen = n if isinstance(req, ChatCompletionRequest) or req.stream \
            else max(n, req.best_of or n)
        # Off the event loop: a prompt near the body limit takes a while to render and encode.
        all_ids = await asyncio.to_thread(prompts_ids, self.engine.tokenizer, req, tools)
        marks["tokenized"] = time.monotonic()
        if len(all_ids) * n_gen > MAX_CHOICES:
            raise APIError(400, f"{len(all_ids)} prompts x {n_gen} choices is more than "
                           f"{MAX_CHOICES} sequences", "n")
        grammar = tools.grammar if tools is not None and tools.grammar else \
            _structured(req)
        if grammar is not None:
            _check_spellable(grammar, self.unspellable)
        params = [base_params(req, len(ids), self.engine.max_model_len, self.vocab,
                              self.engine.tokenizer, grammar, 0 if n_gen > n else None)
                  for ids in all_ids]
        if grammar is not None:
            await self._compile_grammar(req, grammar,
                                        tools is not None and tools.grammar is not None)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        echo = [self._echo(req, p, ids) for p, ids in enumerate(all_ids)] \
            if not isinstance(req, ChatCompletionRequest) and req.echo else [""] * len(all_ids)
        choices: list[_Choice] = []
        try:
            steps = bool(req.stream and req.stream_options and
                         req.stream_options.include_spec_steps)
            await self._start(rid, all_ids, params, n_gen, echo, choices, steps)
        except BaseException:
            _abort_all(choices, self.engine)
            raise
        marks["added"] = choices[0].stream.added_at
        want_lp = bool(req.logprobs) if chat else req.logprobs is not None
        fmt = Formatter(self.model_name, self._token_str, rid, chat, want_lp, tools)
        if req.stream:
            merged: asyncio.Queue = asyncio.Queue()
            usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(choices, merged, fmt, params[0].stop, usage, tools, marks)
            return SSEResponse(events, on_disconnect=lambda: _cut(choices, merged, self.engine),
                               on_close=lambda: _abort_all(choices, self.engine))
        try:
            return await self._collect(request, choices, fmt, n)
        finally:
            _abort_all(choices, self.engine)
            self._timeline(rid, marks)

    def _echo(self, req: CompletionRequest, p: int, ids: list[int]) -> str:
        prompt = req.prompt[p]
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(ids)

    async def _start(self, rid: str, all_ids: list[list[int]], params: list, n_gen: int,
                     echo: list[str], choices: list[_Choice], steps: bool) -> None:
        """Queue every choice; siblings after their first choice's prefill (prefix sharing).
        `steps`: each delta carries its step's record (stream_options.include_spec_steps)."""
        single = len(all_ids) == 1 and n_gen == 1
        for p, (ids, sp) in enumerate(zip(all_ids, params)):
            choices.append(await self._add(rid if single else f"{rid}-{p}-0", p * n_gen, p,
                                           ids, sp, echo[p], steps))
        share = [p for p, ids in enumerate(all_ids)
                 if n_gen > 1 and self._share_after and len(ids) >= self._share_after]
        for p in share:  # read (and keep) the first delta: the prompt's blocks are cached now
            first = choices[p]
            first.pending.append(await first.stream.get())
        for p, (ids, sp) in enumerate(zip(all_ids, params)):
            for i in range(1, n_gen):
                c = await self._add(f"{rid}-{p}-{i}", p * n_gen + i, p, ids,
                                    choice_params(sp, i), echo[p], steps)
                c.first = False
                choices.append(c)
        choices.sort(key=lambda c: c.index)

    async def _add(self, rid: str, index: int, p: int, ids: list[int], sp, echo: str,
                   steps: bool = False) -> _Choice:
        try:
            stream = await self.engine.add_request(rid, ids, sp, want_steps=steps)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), None, "unavailable") from None
        return _Choice(index, p, stream, echo)

    async def _compile_grammar(self, req: CompletionRequest | ChatCompletionRequest,
                               spec: StructuredOutputParams, for_tools: bool) -> None:
        """Compile in a worker thread, before the request is queued: the engine thread then
        finds it in the cache, so no step waits on a compile; a bad grammar is a 400 here."""
        try:
            await asyncio.to_thread(self.engine.engine.compile_grammar, spec)
        except ValueError as exc:
            param = "tools" if for_tools else "structured_outputs" \
                if req.structured_outputs is not None else "response_format"
            raise APIError(400, f"{param}: {exc}", param, "invalid_grammar") from None

    async def _collect(self, request: Any, choices: list[_Choice], fmt: Formatter,
                       n: int) -> dict | None:
        async def collect(c: _Choice) -> Finished:
            ids: list[int] = []
            logprobs: list = []
            while True:
                delta = await c.get()
                assert delta is not None  # only a stream's disconnect puts None
                ids.extend(delta.new_token_ids)
                logprobs.extend(delta.new_logprobs or ())
                if delta.finished:
                    return Finished(c.index, c.prompt_index, delta, ids, logprobs, c.echo,
                                    c.first)

        task = asyncio.ensure_future(asyncio.gather(*(collect(c) for c in choices)))
        watcher = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            waited: set[asyncio.Future[Any]] = {task, watcher}
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()  # the client left (or we are being cancelled): stop waiting
                # Retrieved, so asyncio does not log "exception was never retrieved" for it.
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if not task.done() or task.cancelled():
            return None  # nobody to answer; the caller's finally aborts the request
        done: list[Finished] = task.result()
        usage = Usage()
        for f in done:
            _raise_if_failed(f.final)
            usage.add(f.prompt_index, f.final, f.first)
        return fmt.response(_best(done, n), usage)

    def _timeline(self, rid: str, marks: dict[str, float], **counts: int) -> None:
        if self.engine.timeline is not None:
            marks["done"] = time.monotonic()
            self.engine.timeline.request(rid, marks, **counts)

    async def _events(self, choices: list[_Choice], merged: asyncio.Queue, fmt: Formatter,
                      stops: tuple[str, ...], include_usage: bool, tools: ToolPlan | None,
                      marks: dict[str, float]) -> AsyncIterator[bytes]:
        async def pump(c: _Choice) -> None:
            while True:
                delta = await c.get()
                merged.put_nowait((c, delta))
                if delta is None or delta.finished:
                    return

        pumps = [asyncio.ensure_future(pump(c)) for c in choices]
        texts = {c.index: TextTracker(stops) for c in choices}
        tool_streams = {c.index: ToolStream(tools) for c in choices} if tools else {}
        usage, left, deltas, chunks = Usage(), len(choices), 0, 0
        try:
            for c in choices:
                if fmt.chat:
                    yield sse(fmt.chunk(c.index, {"role": "assistant", "content": ""}, None,
                                        None, include_usage))
                elif c.echo:
                    fmt.start_offset(c.index, c.echo)
                    yield sse(fmt.chunk(c.index, c.echo, None, None, include_usage))
            while left:
                c, delta = await merged.get()
                if c is None or delta is None:  # the client disconnected
                    return
                if delta.finished and delta.finish_reason in ("abort", "error"):
                    tail = ("" if c.index in tool_streams
                            else texts[c.index].update(delta.text, True))
                    if tail:  # the text produced before the failure, not streamed yet
                        yield sse(fmt.chunk(c.index, {"content": tail} if fmt.chat else tail,
                                            None, None, include_usage))
                    yield sse(_failure(delta).body())
                    break
                deltas += 1
                marks.setdefault("first_delta", time.monotonic())
                chunk = self._chunk(fmt, c, delta, texts[c.index], tool_streams.get(c.index),
                                    include_usage)
                if chunk is not None:
                    yield sse(chunk)
                    chunks += 1
                    marks.setdefault("first_write", time.monotonic())
                if delta.finished:
                    left -= 1
                    usage.add(c.prompt_index, delta, c.first)
            else:
                if include_usage:
                    yield sse(fmt.usage_chunk(usage))
        finally:
            for t in pumps:
                t.cancel()
            self._timeline(fmt.rid, marks, deltas=deltas, chunks=chunks)
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _chunk(fmt: Formatter, c: _Choice, delta: OutputDelta, text: TextTracker,
               tools: ToolStream | None, include_usage: bool) -> dict | None:
        new_text = text.update(delta.text, delta.finished)
        lp = fmt.logprobs(c.index, delta.new_token_ids, delta.new_logprobs)
        finish = delta.finish_reason
        content: dict | str | None
        if tools is not None:
            content, called = tools.update(new_text, delta.finished)
            finish = "tool_calls" if called and finish == "stop" else finish
        else:
            content = ({"content": new_text} if new_text else None) if fmt.chat else new_text
        if not (content or lp or delta.finished or delta.step):  # a step's record is news
            return None
        if fmt.chat and content is None:
            content = {}
        chunk = fmt.chunk(c.index, content if content is not None else "", lp, finish,
                          include_usage)
        if delta.finished:
            chunk["dynaspec"] = fmt.extension(delta)
        if delta.step is not None:
            chunk.setdefault("dynaspec", {})["step"] = delta.step
        return chunk


def _structured(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputParams | None:
    return req.structured_output()


def _check_spellable(spec: StructuredOutputParams, ranges: Ranges) -> None:
    """A choice or regex that needs a character no token spells is a 400 here, as the
    published schema says (its pattern excludes them), not a dead end mid-generation."""
    texts = [(f"structured_outputs.choice[{i}]", c) for i, c in enumerate(spec.choice or ())]
    if spec.regex is not None:
        texts.append(("structured_outputs.regex", spec.regex))
    for param, text in texts:
        if (ch := first_unspellable(text, ranges)) is not None:
            raise APIError(400, f"{param} contains U+{ord(ch):04X}, a character no token of "
                           "this model's vocabulary spells, so the output could never match",
                           param, "unspellable_character")


def _best(done: list[Finished], n: int) -> list[Finished]:
    """best_of: per prompt, the n choices with the highest mean logprob, in index order."""
    per_prompt = len(done) // max(1, len({f.prompt_index for f in done}))
    if per_prompt == n:
        return done
    kept: list[Finished] = []
    for p in sorted({f.prompt_index for f in done}):
        group = [f for f in done if f.prompt_index == p]
        kept.extend(sorted(sorted(group, key=lambda f: -f.mean_logprob)[:n],
                           key=lambda f: f.index))
    return kept


def _failure(delta: OutputDelta) -> APIError:
    if delta.finish_reason == "error" and (delta.error or "").startswith(GRAMMAR_DEAD_END):
        return APIError(400, f"structured output: {delta.error}", None, "grammar_dead_end")
    if delta.finish_reason == "error":  # what it produced before the failure is kept
        return APIError(500, f"generation failed: {delta.error or 'engine error'}", None,
                        "engine_error", detail={"text": delta.text,
                                                "num_output_tokens": delta.num_output_tokens})
    return APIError(503, delta.error or "the request was aborted", None, "aborted")


def _raise_if_failed(final: OutputDelta) -> None:
    if final.finish_reason in ("abort", "error"):
        raise _failure(final)


def _cut(choices: list[_Choice], merged: asyncio.Queue, engine: AsyncEngine) -> None:
    """Client disconnected mid-stream: abort, and wake the SSE generator with a None."""
    _abort_all(choices, engine)
    merged.put_nowait((None, None))


def _abort_all(choices: list[_Choice], engine: AsyncEngine) -> None:
    for c in choices:
        if not c.stream.finished:
            engine.abort(c.stream.request_id)
