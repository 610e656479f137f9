"""Per-request acceptance history: what the acceptance-aware K policies learn from each
verified step (docs/design.md §3)."""

from __future__ import annotations


class AcceptanceHistory:
    """Per request: EMA of the conditional acceptance rate at each draft position.

    Position i's rate estimates P(draft i accepted | drafts 0..i-1 accepted); a position is
    observed only when every earlier draft was accepted, which keeps the estimate unbiased
    when K varies step to step (docs/design.md §5's drafted_per_pos argument).
    """

    __slots__ = ("alpha", "prior", "rates", "num_updates")

    def __init__(self, alpha: float = 0.3, prior: float | None = None) -> None:
        """prior: where a position's EMA starts (None: the first observation seeds it). With a
        prior, one rejected draft moves the estimate by alpha instead of setting it to 0."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha, self.prior = alpha, prior
        self.rates: list[float] = []
        self.num_updates = 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(
                f"need 0 <= num_accepted <= num_drafted, got {num_accepted}/{num_drafted}"
            )
        if num_drafted == 0:
            return  # no drafts verified: nothing learned
        for i in range(min(num_accepted + 1, num_drafted)):
            hit = 1.0 if i < num_accepted else 0.0
            if i == len(self.rates) and self.prior is None:
                self.rates.append(hit)  # first observation seeds the EMA
            elif i == len(self.rates):
                self.rates.append(self.prior + self.alpha * (hit - self.prior))
            else:
                self.rates[i] += self.alpha * (hit - self.rates[i])
        self.num_updates += 1

    def rate(self, position: int) -> float:
        """Positions never reached reuse the deepest observed rate (rates rarely rise with
        depth)."""
        if not self.rates:
            return 0.0
        return self.rates[min(position, len(self.rates) - 1)]

    def expected_accepted(self, k: int) -> float:
        """Expected accepted drafts out of k: sum over j of P(first j drafts all accepted)."""
        total, survive = 0.0, 1.0
        for i in range(k):
            survive *= self.rate(i)
            total += survive
        return total
