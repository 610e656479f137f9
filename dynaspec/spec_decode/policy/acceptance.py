"""Per-request acceptance history: what the acceptance-aware K policies learn from each
verified step (docs/design.md §3)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class AcceptanceHistory:
    """Per request: EMA of the conditional acceptance rate at each draft position.

    Position i's rate estimates P(draft i accepted | drafts 0..i-1 accepted); a position is
    observed only when every earlier draft was accepted, which keeps the estimate unbiased
    when K varies step to step (docs/design.md §5's drafted_per_pos argument).
    """

    __slots__ = ("alpha", "prior", "prior_weight", "rates", "counts", "num_updates")

    def __init__(self, alpha: float = 0.3, prior: float | Sequence[float] | None = None,
                 prior_weight: float | None = None) -> None:
        """prior: where a position's EMA starts (None: the first observation seeds it), one rate
        for every position or one per position (the last repeats). With a prior, one rejected
        draft moves the estimate by alpha instead of setting it to 0.
        prior_weight: the prior counts as that many observations, so a slow EMA (small alpha)
        still leaves it at the pace of a running mean (step max(alpha, 1 / (n + weight)))
        instead of crawling from it for ~1/alpha observations."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if isinstance(prior, Sequence):
            if not prior:
                raise ValueError("a per-position prior needs at least one rate")
            prior = tuple(prior)
        self.alpha, self.prior, self.prior_weight = alpha, prior, prior_weight
        self.rates: list[float] = []
        self.counts: list[int] = []
        self.num_updates = 0

    def _prior_at(self, i: int) -> float:
        p = self.prior
        assert p is not None
        return p[min(i, len(p) - 1)] if isinstance(p, tuple) else p

    def _step(self, i: int) -> float:
        if self.prior_weight is None:
            return self.alpha
        return max(self.alpha, 1.0 / (self.counts[i] + self.prior_weight))

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(
                f"need 0 <= num_accepted <= num_drafted, got {num_accepted}/{num_drafted}"
            )
        if num_drafted == 0:
            return  # no drafts verified: nothing learned
        for i in range(min(num_accepted + 1, num_drafted)):
            hit = 1.0 if i < num_accepted else 0.0
            if i == len(self.rates):
                self.counts.append(0)
                self.rates.append(hit if self.prior is None else self._prior_at(i))
                if self.prior is None:  # the first observation seeds the EMA
                    self.counts[i] = 1
                    continue
            self.counts[i] += 1
            self.rates[i] += self._step(i) * (hit - self.rates[i])
        self.num_updates += 1

    def rate(self, position: int) -> float:
        """Positions never reached reuse the deepest observed rate (rates rarely rise with
        depth)."""
        if not self.rates:
            return 0.0
        return self.rates[min(position, len(self.rates) - 1)]

    def expected_accepted(self, k: int) -> float:
        return expected_accepted(self.rate, k)


def expected_accepted(rate: Callable[[int], float], k: int) -> float:
    """Expected accepted drafts out of k from conditional rates rate(i): sum over j of P(first j
    drafts all accepted)."""
    total, survive = 0.0, 1.0
    for i in range(k):
        survive *= rate(i)
        total += survive
    return total


class DraftLengths:
    """Per request: how far the drafter goes, once it drafts at all, when it may draft up to a cap.

    rates[j] estimates P(the drafter proposes draft j+1 | it proposed drafts 0..j), observed
    only below the cap (a draft that stops at the cap says nothing about how far it would have
    gone: the estimate stays unbiased when the cap varies step to step). Unobserved positions
    stay at 1.0, so before anything is seen a cap of k costs a full width 1+k, as it would for
    a drafter that always fills its cap. Suffix drafts stop where their evidence ends, so a
    verify step is often narrower than its cap: the goodput policy prices widths with this
    (goodput_policy.py).

    Steps without any draft are not counted: they verify nothing and cost what plain decode
    does, so they say nothing about what a cap costs. Counting them priced a request whose
    n-gram lookup missed for a few tokens as not worth drafting, and it stopped drafting until
    its next probe (c1 code edits, 1.23x against 1.28x without).
    """

    __slots__ = ("alpha", "rates", "num_updates")

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rates: list[float] = []
        self.num_updates = 0

    def update(self, cap: int, num_drafted: int) -> None:
        if not 0 <= num_drafted <= cap:
            raise ValueError(f"need 0 <= num_drafted <= cap, got {num_drafted}/{cap}")
        if num_drafted == 0:
            return
        for i in range(1, min(num_drafted + 1, cap)):
            hit = 1.0 if i < num_drafted else 0.0
            if i - 1 == len(self.rates):
                self.rates.append(1.0)
            self.rates[i - 1] += self.alpha * (hit - self.rates[i - 1])
        self.num_updates += 1

    def survival(self, n: int) -> list[float]:
        """[n]: P(the drafter proposes more than i drafts | it proposes one) for i < n."""
        out, s = [], 1.0
        for i in range(n):
            if i:
                s *= self.rates[i - 1] if i - 1 < len(self.rates) else 1.0
            out.append(s)
        return out

    def deeper(self, below: DraftLengths) -> DraftLengths:
        """These rates where observed, `below`'s past them (a view; neither is changed)."""
        out = DraftLengths(self.alpha)
        out.rates = self.rates + below.rates[len(self.rates):]
        out.num_updates = self.num_updates
        return out


FULL_LENGTHS = DraftLengths()  # never updated: every draft fills its cap
