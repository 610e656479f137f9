"""Running the app under uvicorn with an engine-aware shutdown.

Plain uvicorn shutdown waits for open connections and then cancels them, so a long stream would
just be cut (the client sees a broken chunked body). EngineServer drains the engine first: it stops
listening, lets in-flight requests finish for `drain_s` seconds, then aborts the rest, which
ends each open stream with an error event and `data: [DONE]` (non-streamed requests get a 503).
Only then does uvicorn close the (by now idle) connections.
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

from dynaspec.server.async_engine import AsyncEngine


class EngineServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_s: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while draining
        if not self.force_exit:
            await self.async_engine.shutdown(self.drain_s)
        await super().shutdown(sockets)


def make_server(app: Any, async_engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000,
                drain_s: float = 30.0, log_level: str = "info") -> EngineServer:
    # The grace period only has to cover writing the final events once the engine is drained.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    return EngineServer(config, async_engine, drain_s)
