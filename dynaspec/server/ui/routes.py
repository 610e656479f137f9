"""The page's routes: `/` redirects to `/ui`, `/ui` is the page, `/ui/<asset>` its scripts and
style (read from the package once, at start-up: nothing is fetched at run time, no CDN),
`/ui/live` the JSON its dashboard polls (ui/live.py) and `/ui/history` the last minutes of it
the server kept (ui/history.py), read once when the page opens. Open like /metrics and /health:
the page asks for the API key itself (kept in the tab's sessionStorage) and sends it only to
/v1."""

from __future__ import annotations

import logging
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, RedirectResponse, Response

from dynaspec.server.ui.history import HISTORY_SCHEMA, LiveHistory, goodput_note
from dynaspec.server.ui.live import LIVE_SCHEMA, live_stats

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}
# The page may run only its own files: no inline script, nothing from another origin.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'")


def _assets() -> dict[str, tuple[bytes, str]]:
    root = resources.files("dynaspec.server.ui") / "static"
    out = {}
    for entry in root.iterdir():
        suffix = entry.name[entry.name.rfind("."):]
        if suffix in _TYPES:
            out[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return out


class QuietPolls(logging.Filter):
    """Leaves the dashboard's answered polls out of uvicorn's access log: an open page would
    otherwise write a line a second, burying the requests an operator reads the log for."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 5 and args[2] == "/ui/live" and args[4] == 200)


def _quiet_access_log() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietPolls) for f in access.filters):
        access.addFilter(QuietPolls())


def live_history(async_engine: Any) -> LiveHistory | None:
    """The ring /ui/history serves (None without metrics); the app's lifespan runs its sampler."""
    if async_engine.metrics is None:
        return None
    return LiveHistory(lambda: live_stats(async_engine.metrics, async_engine.metrics_lock,
                                          async_engine.state))


def ui_router(async_engine: Any, error: Any, history: LiveHistory | None = None) -> APIRouter:
    """`error(status, message)` builds the API's error exception (api_server.APIError);
    `history`: the samples /ui/history serves (none kept: an empty list)."""
    assets = _assets()
    note = goodput_note(async_engine.engine.model_card())  # fixed once the engine has started
    _quiet_access_log()
    router = APIRouter()
    headers = {"Cache-Control": "no-cache", "Content-Security-Policy": _CSP,
               "X-Content-Type-Options": "nosniff"}

    def asset(name: str) -> Response:
        if name not in assets:
            raise error(404, f"no page asset '{name}'")
        body, media = assets[name]
        return Response(body, media_type=media, headers=headers)

    @router.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/ui", status_code=307)

    @router.get("/ui", include_in_schema=False)
    async def page() -> Response:
        return asset("index.html")

    @router.get("/ui/live", responses={
        200: {"description": "the /metrics samples as JSON, with the engine state",
              "content": {"application/json": {"schema": LIVE_SCHEMA}}},
        404: {"description": "metrics are not enabled"}})
    async def live() -> JSONResponse:
        if async_engine.metrics is None:
            raise error(404, "metrics are not enabled")
        return JSONResponse(live_stats(async_engine.metrics, async_engine.metrics_lock,
                                       async_engine.state), headers={"Cache-Control": "no-store"})

    @router.get("/ui/history", responses={
        200: {"description": "the last minutes of /ui/live samples the server kept, and why "
              "goodput is not modelled when it is not",
              "content": {"application/json": {"schema": HISTORY_SCHEMA}}},
        404: {"description": "metrics are not enabled"}})
    async def past() -> JSONResponse:
        if async_engine.metrics is None:
            raise error(404, "metrics are not enabled")
        kept = history if history is not None else LiveHistory(dict)
        return JSONResponse({"interval_s": kept.interval_s, "span_s": kept.span_s,
                             "samples": kept.samples(), "goodput_note": note},
                            headers={"Cache-Control": "no-store"})

    @router.get("/ui/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return asset(name)

    return router
