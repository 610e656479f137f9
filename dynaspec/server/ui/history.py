"""`GET /ui/history`: the last minutes of /ui/live samples, kept for a page that opens late.

Without it every chart of a freshly opened dashboard is empty until the tab has polled for a
while, although the server served traffic all along. So the server takes a /ui/live sample every
`interval_s` into a bounded ring (span_s of them, plus one rate window before the oldest shown
point) and the page draws from the ring at once, then goes on polling. The samples are the very
answers /ui/live gives (same registries, same lock), so the page derives rates and percentiles
from them exactly as from its own polls.

Cost: one sample every 5 s (a few milliseconds under the metrics lock, off the event loop in a
worker thread, never on the engine thread); memory about 60 samples of ~5 kB each; the answer is
about 300 kB, fetched once per page load.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dynaspec.server.ui.live import LIVE_SCHEMA

log = logging.getLogger("dynaspec.server")

INTERVAL_S = 5.0  # between samples: the page's rate window (10 s) spans two of them
SPAN_S = 300.0  # what the page shows (dashboard.js SPAN_S)
RATE_WINDOW_S = 10.0  # a rate at the oldest shown point needs a sample this much older

HISTORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["interval_s", "span_s", "samples", "goodput_note"],
    "properties": {
        "interval_s": {"type": "number", "description": "seconds between two samples"},
        "span_s": {"type": "number", "description": "how far back the samples reach"},
        "samples": {"type": "array", "items": LIVE_SCHEMA,
                    "description": "/ui/live answers, oldest first"},
        "goodput_note": {"type": ["string", "null"], "description": "why no goodput is "
                         "modelled (the K policy running is not the goodput policy, and why); "
                         "null when it runs"},
    },
}


def goodput_note(card: Any) -> str | None:
    """Why the goodput chart stays empty, from the engine's card (engine/client.ModelCard); None
    when the goodput policy runs, or may: under data parallelism the policies run on the ranks
    (the front end's card has none) and their own gauges say."""
    if not card.spec_plan.get("speculating"):
        return "speculation is off (no drafter, or no K above 0): no K policy runs"
    info = card.k_policy
    if info is None or info.get("name") == "goodput":
        return None
    text = f"the K policy running is '{info['name']}'"
    if info.get("requested") not in (None, info["name"]):
        text += f" (--k-policy {info['requested']})"
    if info.get("note"):
        text += f": {info['note']}"
    return text + ". Only the goodput policy models goodput."


class LiveHistory:
    """A bounded ring of `sample()` answers, one every `interval_s` while `run()` is awaited."""

    def __init__(self, sample: Callable[[], dict], interval_s: float = INTERVAL_S,
                 span_s: float = SPAN_S) -> None:
        if interval_s <= 0 or span_s <= 0:
            raise ValueError(f"interval_s and span_s must be > 0, got {interval_s}, {span_s}")
        self.interval_s, self.span_s = interval_s, span_s
        self._sample = sample
        self._ring: deque[dict] = deque(maxlen=int((span_s + RATE_WINDOW_S) / interval_s) + 2)
        self._lock = threading.Lock()  # take() runs in a worker thread, samples() on the loop

    def take(self) -> None:
        """Append one sample (the oldest falls out of the ring)."""
        snap = self._sample()
        with self._lock:
            self._ring.append(snap)

    def samples(self) -> list[dict]:
        with self._lock:
            return list(self._ring)

    async def run(self) -> None:
        """Sample until cancelled; a failed sample is logged and skipped, never fatal."""
        next_at = time.monotonic()
        while True:
            try:
                await asyncio.to_thread(self.take)
            except Exception:  # noqa: BLE001 - the history is a convenience, serving is not
                log.exception("live history sample failed")
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
