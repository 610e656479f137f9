"""Where a served request's time goes: one JSON line per request and per engine step.

Off unless the environment names a file (`DYNASPEC_REQUEST_TIMELINE=PATH dynaspec serve ...`),
so a benchmark arm keeps its command line. All times are `time.monotonic()` seconds of the
server process, so the two kinds of line share one clock:

- request lines (written on the event loop when the response ends): `accept` (the handler
  starts, body parsed), `tokenized` (prompt ids built), `added` (the engine thread ran the add:
  the command waited for the step in progress), `first_token` (the engine emitted it, stamped on
  the engine thread), `first_delta` (its delta reached the event loop), `first_write` (its SSE
  chunk was handed to the socket), `done`, and the counts of deltas and chunks;
- step lines (written on the engine thread): `start`, `end`, the step's prompt and generated
  tokens and its requests, so steps that carried prefill chunks can be told from pure decode.

`python -m dynaspec.bench.served_timeline PATH` summarizes a file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

ENV = "DYNASPEC_REQUEST_TIMELINE"


class RequestTimeline:
    """Appends JSON lines to one file from any thread (a lock per write; buffered)."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._f = open(path, "a", encoding="utf-8", buffering=1 << 16)
        self.first_token: dict[str, float] = {}  # request id -> engine time of its first token

    @staticmethod
    def from_env() -> RequestTimeline | None:
        path = os.environ.get(ENV)
        return RequestTimeline(path) if path else None

    def _write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)

    # ---- the engine thread ---------------------------------------------------------------------
    def step(self, start: float, end: float, step: Any, outs: list) -> None:
        """One engine step (`step`: its StepStats or None) and the first tokens it produced."""
        if len(self.first_token) > 100_000:  # requests that never reached request(): drop
            self.first_token.clear()
        for out in outs:
            if out.token_ids and len(out.token_ids) == len(out.new_token_ids):
                self.first_token.setdefault(out.request_id, end)
        rec: dict[str, Any] = {"kind": "step", "start": round(start, 6), "end": round(end, 6),
                               "outputs": len(outs)}
        if step is not None:
            rec.update(prompt_tokens=step.num_prompt_tokens,
                       generation_tokens=step.num_generation_tokens,
                       requests=len(step.requests), width=step.width)
        self._write(rec)

    # ---- the event loop ------------------------------------------------------------------------
    def request(self, request_id: str, marks: dict[str, float], **counts: int) -> None:
        rec: dict[str, Any] = {"kind": "request", "id": request_id,
                               **{k: round(v, 6) for k, v in marks.items()}, **counts}
        first = self.first_token.pop(request_id, None)
        if first is not None:
            rec["first_token"] = round(first, 6)
        self._write(rec)

    def close(self) -> None:
        with self._lock:
            self._f.close()


def now() -> float:
    return time.monotonic()
