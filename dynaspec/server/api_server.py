"""The OpenAI-compatible HTTP API: `build_app(async_engine, served_model_name, api_key=None)`.

Bodies are read and validated by hand (size limit first, then strict pydantic models) rather than
through FastAPI's parameter binding, so every failure is an OpenAI-style error with the status
OpenAI uses (400 instead of FastAPI's 422) and a message naming the field, and a body over the
limit is refused before it is read whole. The same pydantic models are published as the request
bodies in /openapi.json (built once, from their JSON schemas), with the error shape for 4xx/5xx,
so clients and fuzzers read the real contract. No middleware wraps the app: BaseHTTPMiddleware
would buffer streams and hide client disconnects.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dynaspec.server.async_engine import AsyncEngine
from dynaspec.server.openapi import openapi_components
from dynaspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from dynaspec.server.request_outcomes import metrics_prefix
from dynaspec.server.serving import OpenAIServing
from dynaspec.structured.spellable import pattern_class

log = logging.getLogger("dynaspec.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20


def build_async_engine(served_model_name: str | None = None, metrics_prefix: str = "dynaspec",
                       **engine_kwargs: Any) -> AsyncEngine:
    """Load the engine from flat engine args and start its thread, with Prometheus metrics."""
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine
    from dynaspec.metrics.prometheus import PrometheusMetrics

    config = EngineConfig.from_kwargs(**engine_kwargs)
    if config.spec.speculator == "oracle":
        # It drafts outputs recorded for known prompts: a measuring device, not a drafter to serve.
        raise ValueError("--speculator oracle replays recorded outputs for benchmarks and tests "
                         "only; the server does not run it (choose ngram, suffix, draft or eagle)")

    def build() -> tuple[Any, Any]:
        if config.parallel.data_parallel_size > 1 or config.parallel.engine_process:  # dp/
            from dynaspec.dp.front_end import DPEngine
            name = served_model_name or config.model.model
            dp = DPEngine(config, metrics_labels={"model_name": name},
                          metrics_prefix=metrics_prefix)
            return dp, dp.metrics
        engine = LLMEngine(config)
        name = served_model_name or engine.parts.model_name
        return engine, PrometheusMetrics(labels={"model_name": name}, prefix=metrics_prefix)

    return AsyncEngine(build)


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_drain_s: float = 0.0, ui: bool = True) -> FastAPI:
    """The FastAPI app. On shutdown (after uvicorn has let open connections finish) requests
    still in flight get up to `shutdown_drain_s` to finish, then are aborted; the engine thread
    is stopped and joined. `ui`: serve the page at /ui and its JSON at /ui/live (server/ui/)."""

    history = None
    if ui:
        from dynaspec.server.ui.routes import live_history, ui_router

        history = live_history(async_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The dashboard's server-side history (ui/history.py): sampled while the app runs.
        sampler = asyncio.create_task(history.run()) if history is not None else None
        try:
            yield
        finally:
            if sampler is not None:
                sampler.cancel()
        await async_engine.shutdown(shutdown_drain_s)

    app = FastAPI(title="dynaspec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    serving = OpenAIServing(async_engine, served_model_name)
    _install_error_handlers(app)
    app.include_router(_v1_router(serving, api_key, max_body_bytes))
    app.include_router(_tokenizer_router(serving, api_key, max_body_bytes))
    _add_open_routes(app, async_engine, served_model_name)
    if ui:
        app.include_router(ui_router(async_engine, APIError, history))
    app.state.serving = serving
    app.state.async_engine = async_engine
    app.state.live_history = history
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the routes plus the pydantic bodies and the error shape."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        serving = app.state.serving
        schema.setdefault("components", {}).setdefault("schemas", {}).update(
            openapi_components(serving.vocab, serving.engine.max_model_len,
                               pattern_class(serving.unspellable)))
        # One model is served: its id is the one path value that is not a 404.
        for param in schema["paths"]["/v1/models/{model_id}"]["get"].get("parameters", []):
            if param.get("name") == "model_id":
                param["schema"] = {"type": "string", "enum": [serving.model_name],
                                   "example": serving.model_name}
        app.openapi_schema = schema
    return app.openapi_schema


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_ERROR = {"content": {"application/json": {"schema": _ref("ErrorResponse")}}}
_OBJECT = {"type": "object"}


def _body_doc(model: type, streams: bool = True) -> dict:
    """The route's OpenAPI extras: the request body, the JSON (or, with `"stream": true`,
    server-sent events) answer and the OpenAI error responses."""
    ok: dict[str, dict] = {"application/json": {"schema": {
        "type": "object", "required": ["id", "object", "choices", "usage"]}}}
    if streams:
        # Schemathesis checks each event as {"event", "data", ...}; data is one JSON chunk.
        ok["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                              "properties": {"data": {"type": "string"}}}}
    if not streams:
        ok = {"application/json": {"schema": _OBJECT}}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(model.__name__)}}},
            "responses": {"200": {"description": "the answer" + (
                ", as server-sent events when stream is true" if streams else ""), "content": ok},
                **{str(code): {"description": why, **_ERROR} for code, why in (
                    (400, "invalid request"), (401, "missing or wrong API key"),
                    (404, "unknown model"), (413, "body too large"), (500, "engine error"),
                    (503, "shutting down or aborted"))}}}


def _error(err: APIError) -> JSONResponse:
    headers = dict(err.headers or {})
    if err.status == 401:
        headers["www-authenticate"] = "Bearer"
    return JSONResponse(err.body(), status_code=err.status, headers=headers or None)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error(APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param,
                               "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}
        # Starlette names the allowed methods of a 405 in exc.headers ("Allow"): keep them.
        return _error(APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)),
                               headers=dict(exc.headers or {})))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # left while sending its body: nobody to answer

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(APIError(500, f"internal error: {type(exc).__name__}", None, "internal"))


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing it (413) as soon as it passes `limit` bytes, declared or not."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body is too large ({size} bytes > limit {limit} bytes)", None,
                    "request_too_large")


def _authorizer(api_key: str | None):
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           None, "invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", None, "invalid_api_key")
    return authorize


def _v1_router(serving: OpenAIServing, api_key: str | None, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_authorizer(api_key))])

    async def run(request: Request, model: type) -> Response:
        req = parse_body(model, await _read_body(request, max_body_bytes))
        result = await serving.handle(request, req)
        if isinstance(result, Response):
            return result
        return JSONResponse(result) if result is not None else Response(status_code=499)

    @router.post("/completions", openapi_extra=_body_doc(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await run(request, CompletionRequest)

    @router.post("/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await run(request, ChatCompletionRequest)

    created = int(time.time())

    model_card = serving.engine.engine.model_card()  # fixed once the engine has started

    def card() -> dict:
        return {"id": serving.model_name, "object": "model", "created": created,
                "owned_by": "dynaspec", "max_model_len": model_card.max_model_len,
                "dynaspec": model_card.to_json()}

    @router.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @router.get("/models/{model_id:path}", responses={404: {"description": "unknown model",
                                                            **_ERROR}})
    async def model(model_id: str) -> dict:
        serving.check_model(model_id)
        return card()

    return router


def _add_open_routes(app: FastAPI, async_engine: AsyncEngine, model_name: str) -> None:
    @app.get("/health", responses={503: {"description": "the engine has stopped (or no "
                                                        "data-parallel rank serves)",
                                         "content": {"application/json": {"schema": _OBJECT}}}})
    async def health() -> JSONResponse:
        failure = async_engine.engine.failure()  # no data-parallel rank serves
        ok = async_engine.alive and failure is None
        status = "ok" if ok else (failure or "engine stopped")
        body = {"status": status, **async_engine.state}
        ranks = getattr(async_engine.engine, "health", None)  # data parallel: ok or degraded
        if ranks is not None:
            body.update(ranks() if ok else {})
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={404: {"description": "metrics are not enabled", **_ERROR}})
    async def metrics() -> Response:
        from dynaspec.metrics.prometheus import CONTENT_TYPE

        if async_engine.metrics is None:
            raise APIError(404, "metrics are not enabled")
        with async_engine.metrics_lock:
            body = async_engine.metrics.render()
        body += async_engine.outcomes.render(metrics_prefix(async_engine.metrics),
                                             {"model_name": model_name})
        return Response(body, media_type=CONTENT_TYPE)


def _tokenizer_router(serving: OpenAIServing, api_key: str | None,
                      max_body_bytes: int) -> APIRouter:
    """vLLM's /tokenize and /detokenize (same API key as /v1)."""
    router = APIRouter(dependencies=[Depends(_authorizer(api_key))])
    tok = serving.engine.tokenizer

    @router.post("/tokenize", openapi_extra=_body_doc(TokenizeRequest, streams=False))
    async def tokenize(request: Request) -> dict:
        req = parse_body(TokenizeRequest, await _read_body(request, max_body_bytes))
        if req.model is not None:
            serving.check_model(req.model)
        ids = tokenize_ids(tok, req)
        out = {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return out

    @router.post("/detokenize", openapi_extra=_body_doc(DetokenizeRequest, streams=False))
    async def detokenize(request: Request) -> dict:
        req = parse_body(DetokenizeRequest, await _read_body(request, max_body_bytes))
        if req.model is not None:
            serving.check_model(req.model)
        bad = [t for t in req.tokens if t >= serving.vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, "
                           f"{serving.vocab})", "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    return router


def tokenize_ids(tok: Any, req: TokenizeRequest) -> list[int]:
    from dynaspec.models.tokenizer import ChatTemplateError

    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    msgs = ChatCompletionRequest.model_construct(messages=req.messages).chat_messages()
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt
                                       is not False)
    except ChatTemplateError as exc:
        raise APIError(400, f"chat template failed: {exc}", "messages",
                       "chat_template_error") from None
    return tok.encode(text)
