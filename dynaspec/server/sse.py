"""Server-sent events: the streaming response, disconnect detection and safe text deltas."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response

log = logging.getLogger("dynaspec.server")


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_disconnect(receive: Callable[[], Any]) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """Streams `events`, listening for the client's disconnect the whole time.

    Starlette's StreamingResponse only notices a disconnect when a write fails (ASGI >= 2.4),
    which for a request waiting on a long step can be much later, and it leaves closing the
    generator to the garbage collector. Here a disconnect calls `on_disconnect` at once (which
    aborts the request and wakes the generator), and `on_close` always runs when the response ends.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None],
                 on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def listen() -> None:
            await wait_disconnect(receive)
            self.on_disconnect()

        listener = asyncio.ensure_future(listen())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away between our writes
            log.debug("client disconnected during a stream")
        finally:
            listener.cancel()
            await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close()


class TextTracker:
    """Turns the engine's cumulative text into deltas that are never taken back.

    Until the request finishes it holds back the last (longest stop string - 1) characters, which
    could still turn out to begin a stop string (the engine cuts the text there), and a trailing
    U+FFFD (a character whose remaining bytes come with the next token). So the streamed deltas
    always add up to the non-streamed text.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def update(self, text: str, finished: bool) -> str:
        if not finished:
            text = text[:len(text) - self.hold] if self.hold else text
            text = text.rstrip("\ufffd")
        if len(text) <= len(self.sent):
            return ""
        if not text.startswith(self.sent):  # should not happen; never resend what was sent
            log.warning("streamed text changed behind the cursor; continuing from the end")
        new, self.sent = text[len(self.sent):], text
        return new
