"""OpenAI completions and chat completions over the AsyncEngine: prompt -> params -> response.

Both endpoints share one path: check the model and the fields dynaspec cannot honour, build the
prompt's token ids here (so context-length errors are a 400 before anything is queued), queue
the request, then either collect the final output or stream SSE chunks. A request whose client
goes away is aborted, whichever way it was sent, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any, AsyncIterator, Callable

from dynaspec.models.tokenizer import ChatTemplateError
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.async_engine import AsyncEngine, EngineUnavailable, OutputDelta, RequestStream
from dynaspec.server.protocol import ChatCompletionRequest, CompletionRequest, APIError
from dynaspec.server.sse import SSEResponse, TextTracker, sse, wait_disconnect
from dynaspec.structured.params import StructuredOutputParams


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        tok = engine.tokenizer
        self._token_str = functools.lru_cache(maxsize=1 << 16)(
            lambda i: tok.decode([i], skip_special_tokens=False))

    # ---- request -> token ids and SamplingParams ----------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{self.model_name}'", "model", "model_not_found")

    def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(req, ChatCompletionRequest):
            try:
                text = tok.apply_chat_template(req.chat_messages())
            except ChatTemplateError as exc:
                raise APIError(400, f"chat template failed: {exc}", "messages") from None
            return tok.encode(text)
        return tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest,
                        num_prompt: int) -> SamplingParams:
        chat = isinstance(req, ChatCompletionRequest)
        where, ctx = ("messages" if chat else "prompt"), self.engine.max_model_len
        if num_prompt == 0:
            raise APIError(400, f"{where} is empty (0 tokens)", where)
        room = ctx - num_prompt
        if room <= 0:
            raise APIError(400, f"{where} has {num_prompt} tokens but the model's context length "
                           f"is {ctx}, which leaves no room to generate", where,
                           "context_length_exceeded")
        limit = req.token_limit if chat else req.max_tokens
        if limit is not None and limit > room:
            name = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
            raise APIError(400, f"{name} {limit} + {num_prompt} prompt tokens exceed the model's "
                           f"context length {ctx}", name, "context_length_exceeded")
        if chat:
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                min_p=req.min_p or 0.0, seed=req.seed, max_tokens=limit or room,
                stop=req.stop_list, stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
                structured_output=req.structured_output())
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ")[0]) from None

    # ---- the endpoint --------------------------------------------------------------------------
    async def handle(self, request: Any, req: CompletionRequest | ChatCompletionRequest) -> Any:
        self.check_model(req.model)
        if (err := req.unsupported()) is not None:
            raise err
        # Off the event loop: a prompt near the body limit takes a while to render and encode.
        ids = await asyncio.to_thread(self.prompt_ids, req)
        params = self.sampling_params(req, len(ids))
        if params.structured_output is not None:
            await self._compile_grammar(req, params.structured_output)
        chat = isinstance(req, ChatCompletionRequest)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            stream = await self.engine.add_request(rid, ids, params)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages" if chat else "prompt") from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), None, "unavailable") from None
        fmt = _Format(self, rid, chat, params.logprobs is not None)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(stream, fmt, TextTracker(params.stop), usage)
            return SSEResponse(events, on_disconnect=lambda: _cut(stream, self.engine),
                               on_close=lambda: _abort_unfinished(stream, self.engine))
        try:
            return await self._collect(request, stream, fmt)
        finally:
            _abort_unfinished(stream, self.engine)

    async def _compile_grammar(self, req: CompletionRequest | ChatCompletionRequest,
                               spec: StructuredOutputParams) -> None:
        """Compile in a worker thread, before the request is queued: the engine thread then
        finds it in the cache, so no step waits on a compile; a bad grammar is a 400 here."""
        structured = self.engine.engine.structured
        try:
            await asyncio.to_thread(structured.compile, spec)
        except ValueError as exc:
            param = "structured_outputs" if req.structured_outputs is not None \
                else "response_format"
            raise APIError(400, f"{param}: {exc}", param, "invalid_grammar") from None

    async def _collect(self, request: Any, stream: RequestStream, fmt: _Format) -> dict | None:
        async def collect() -> tuple[OutputDelta, list[int], list]:
            ids: list[int] = []
            logprobs: list = []
            while True:
                delta = await stream.get()
                ids.extend(delta.new_token_ids)
                logprobs.extend(delta.new_logprobs or ())
                if delta.finished:
                    return delta, ids, logprobs

        task = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()  # the client left (or we are being cancelled): stop waiting
        if not task.done() or task.cancelled():
            return None  # nobody to answer; the caller's finally aborts the request
        final, ids, logprobs = task.result()
        _raise_if_failed(final)
        return fmt.response(final, ids, logprobs)

    async def _events(self, stream: RequestStream, fmt: _Format, text: TextTracker,
                      include_usage: bool) -> AsyncIterator[bytes]:
        if fmt.chat:
            yield sse(fmt.chunk({"role": "assistant", "content": ""}, None, None, include_usage))
        while True:
            delta = await stream.get()
            if delta is None:  # the client disconnected
                return
            if delta.finished and delta.finish_reason in ("abort", "error"):
                yield sse(_failure(delta).body())
                break
            new_text = text.update(delta.text, delta.finished)
            lp = fmt.logprobs(delta.new_token_ids, delta.new_logprobs)
            if new_text or lp or delta.finished:
                content = {"content": new_text} if fmt.chat else new_text
                chunk = fmt.chunk(content, lp, delta.finish_reason, include_usage)
                if delta.finished:
                    chunk["dynaspec"] = fmt.extension(delta)
                yield sse(chunk)
            if delta.finished:
                if include_usage:
                    yield sse(fmt.usage_chunk(delta))
                break
        yield b"data: [DONE]\n\n"


class _Format:
    """Builds one request's OpenAI JSON objects (ids, logprobs, usage, the extension field)."""

    def __init__(self, serving: OpenAIServing, rid: str, chat: bool, want_logprobs: bool) -> None:
        self.rid, self.chat, self.want_logprobs = rid, chat, want_logprobs
        self.model, self.created = serving.model_name, int(time.time())
        self.token_str: Callable[[int], str] = serving._token_str
        self.offset = 0  # completions' text_offset runs across chunks

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, ids: list[int], entries: list | None) -> dict | None:
        if not self.want_logprobs or not entries:
            return None
        toks = [self.token_str(i) for i in ids[:len(entries)]]
        if self.chat:
            content = [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                        "top_logprobs": [self._top(i, v) for i, v in top]}
                       for t, (lp, top) in zip(toks, entries)]
            return {"content": content, "refusal": None}
        offsets = []
        for t in toks:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": toks, "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [{self.token_str(i): v for i, v in top} for _, top in entries],
                "text_offset": offsets}

    def _top(self, token_id: int, logprob: float) -> dict:
        t = self.token_str(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode())}

    @staticmethod
    def usage(final: OutputDelta) -> dict:
        return {"prompt_tokens": final.num_prompt_tokens,
                "completion_tokens": final.num_output_tokens,
                "total_tokens": final.num_prompt_tokens + final.num_output_tokens}

    @staticmethod
    def extension(final: OutputDelta) -> dict:
        m = final.metrics
        return {"spec": final.spec, "ttft_s": m.get("ttft_s"), "e2e_s": m.get("e2e_s")}

    def response(self, final: OutputDelta, ids: list[int], logprobs: list) -> dict:
        lp = self.logprobs(ids, logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                      "logprobs": lp, "finish_reason": final.finish_reason}
        else:
            choice = {"index": 0, "text": final.text, "logprobs": lp,
                      "finish_reason": final.finish_reason}
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": [choice], "usage": self.usage(final),
                "system_fingerprint": None, "dynaspec": self.extension(final)}

    def chunk(self, content: Any, lp: dict | None, finish: str | None, with_usage: bool) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": content if finish is None or content.get("content")
                      else {}, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content, "logprobs": lp, "finish_reason": finish}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
               "choices": [choice]}
        if with_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self, final: OutputDelta) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(final)}


def _failure(delta: OutputDelta) -> APIError:
    if delta.finish_reason == "error":
        return APIError(500, f"generation failed: {delta.error or 'engine error'}", None,
                        "engine_error")
    return APIError(503, delta.error or "the request was aborted", None, "aborted")


def _raise_if_failed(final: OutputDelta) -> None:
    if final.finish_reason in ("abort", "error"):
        raise _failure(final)


def _cut(stream: RequestStream, engine: AsyncEngine) -> None:
    """Client disconnected mid-stream: abort, and wake the SSE generator with a None."""
    if not stream.finished:
        engine.abort(stream.request_id)
    stream.queue.put_nowait(None)  # type: ignore[arg-type]


def _abort_unfinished(stream: RequestStream, engine: AsyncEngine) -> None:
    if not stream.finished:
        engine.abort(stream.request_id)
