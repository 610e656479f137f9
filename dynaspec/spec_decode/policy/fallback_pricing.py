"""The goodput policy's pricing of a drafter's fallback (lookup first, an EAGLE head second).

Lookup-first drafting (`lookup_first.py`) drafts from a lookup where the context repeats and from
a head elsewhere, and the two are accepted at very different rates: on held-out chat the
lookup's first drafts at 0.58-0.74, the head's at 0.28-0.33. With one history per request the
head's drafts pulled a request's rate down, the policy cut it to K = 0, and then the lookup's
matches went undrafted too: eagle + n-gram ran 0.80-0.90x of n-gram alone
(docs/history/benchmarks-waves-1-4.md, eleventh session).

So the policy keeps the fallback's acceptance and drafting cost apart. The lookup is priced from
its own matches, as if it drafted alone; the fallback gets a cap of its own per request: the k
that gives that request the most tokens per second from the fallback's drafts at this step's
costs, 0 where none beats plain decode. A request at 0 is re-probed with one draft once
`probe_interval` tokens have passed without a fallback draft, as the policy re-probes requests.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from dynaspec.spec_decode.plan.step_width import RequestView
from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory, expected_accepted

if TYPE_CHECKING:
    from dynaspec.spec_decode.policy.goodput_settings import GoodputSettings


class FallbackPricer:
    """Acceptance histories and drafting cost of a drafter's fallback, and its per-request cap."""

    def __init__(self, settings: GoodputSettings) -> None:
        self.settings = settings
        self.histories: dict[str, AcceptanceHistory] = {}
        self.engine_history = AcceptanceHistory(alpha=0.05, prior=settings.prior_rate,
                                                prior_weight=settings.engine_prior_weight)
        self.costs: deque[float] = deque(maxlen=settings.draft_cost_window)
        self.seconds_per_token = 0.0  # the median of `costs` once enough exist
        self.last_ctx: dict[str, int] = {}  # context of each request's last fallback draft

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, ctx: int) -> None:
        if not num_drafted:
            return
        s = self.settings
        h = self.histories.get(request_id)
        if h is None:
            h = self.histories[request_id] = AcceptanceHistory(
                alpha=s.request_alpha, prior=s.prior_rate, prior_weight=s.request_prior_weight)
        h.update(num_drafted, num_accepted)
        self.engine_history.update(num_drafted, num_accepted)
        self.last_ctx[request_id] = ctx

    def observe_cost(self, seconds: float, num_drafted: int) -> None:
        """A step's fallback drafting seconds (its setup excluded) and the drafts they made."""
        if num_drafted and seconds >= 0:
            self.costs.append(seconds / num_drafted)
            if len(self.costs) >= self.settings.draft_cost_min_samples:
                self.seconds_per_token = statistics.median(self.costs)

    def forget(self, request_id: str) -> None:
        self.histories.pop(request_id, None)
        self.last_ctx.pop(request_id, None)

    def num_cached(self) -> int:
        return len(self.histories.keys() | self.last_ctx.keys())

    def cap(self, r: RequestView, limit: int, cost: Callable[[int], float]) -> int:
        """The fallback's cap for request r, <= limit; cost(width): this step's seconds."""
        if limit <= 0:
            return 0
        rate = self._rate(r.request_id)
        best_k, best = 0, 1.0 / cost(1)
        for k in range(1, limit + 1):
            value = (1.0 + expected_accepted(rate, k)) / (cost(1 + k) + self.seconds_per_token * k)
            if value > best * (1 + 1e-9):
                best_k, best = k, value
        if best_k:
            return best_k
        last = self.last_ctx.get(r.request_id)
        stale = last is None or r.context_len - last >= self.settings.probe_interval
        probe_rate = self.settings.probe_rates(self.engine_history)(0)
        probe = (1.0 + probe_rate) / (cost(2) + self.seconds_per_token)
        return 1 if stale and probe > (1.0 / cost(1)) * (1 + 1e-9) else 0

    def _rate(self, request_id: str) -> Callable[[int], float]:
        """rate(position): the request's own where it has them, the engine's deeper down."""
        prior = self.engine_history if self.engine_history.num_updates else None
        below = prior.rate if prior is not None else (lambda _i: self.settings.prior_rate)
        h = self.histories.get(request_id)
        if h is None or not h.num_updates:
            return below
        own = h.rates
        return lambda i: own[i] if i < len(own) else below(i)

