"""The goodput policy's settings (goodput_policy.py says what each is for) and the fixed-rate
views its pricing reads where a request has no history of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dynaspec.spec_decode.policy.acceptance import AcceptanceHistory, expected_accepted


@dataclass(frozen=True)
class GoodputSettings:
    prior_rate: float = 0.6  # per-position acceptance assumed before anything is observed
    probe_rate: float = 0.8  # acceptance at which a probe is judged worth its cost
    # Once the engine has this much evidence, probes are priced at its rates + the headroom
    # (a request may do better than the engine's mean; lookups vary far more than that).
    probe_evidence: int = 32  # the rate's standard error is then <= 0.09, well inside the headroom
    probe_headroom: float = 0.25
    probe_interval: int = 16  # tokens without a verified draft before a request is re-probed
    # The drafter's seconds per drafted token: the median of its last `draft_cost_window`
    # drafting steps, taken as `draft_cost_prior` until `draft_cost_min_samples` exist. An EMA
    # seeded by the first draft kept its cold outlier for good: an EAGLE head's first draft also
    # feeds it the whole prompt (4.8 ms a token against ~0.9 steady), after which K stayed 0 and
    # no later draft could correct it.
    draft_cost_window: int = 15
    draft_cost_min_samples: int = 3
    # The price until then: the drafter's own start-up measurement where it takes one
    # (Proposer.measure_draft_cost: an EAGLE head's), else 0 (a lookup's is negligible).
    draft_cost_prior: float = 0.0
    # Synthetic rejection mode's per-position acceptance (the last repeats); () = strict mode.
    synthetic_rates: tuple[float, ...] = ()
    divergence_bound: float = 2.0  # modelled vs observed goodput factor the guard tolerates
    divergence_steps: int = 32  # ... for this many decode steps in a row before it re-probes
    reprobe_interval: int = 64  # decode steps between two guard re-probes, at least
    # A step verifies only the drafts its requests produced (the eager path), so a cap the
    # drafter does not fill costs less than its full width. False where a fixed-shape path pads
    # every row to the planned width.
    widths_follow_drafts: bool = True
    # The drafter sizes its own drafts (Proposer.sizes_own_drafts): K is 0 or the ceiling.
    # Measured on agentic suffix drafts at c1: cutting caps to the K the rates favoured ran
    # 0.81x [0.68, 0.97] of always drafting up to 8, because the long drafts are the sure ones.
    whole_cap: bool = False
    # With whole_cap: a cut request still verifies a draft as deep as its cap between probes.
    strict_probes: bool = True
    # The engine-wide prior counts as this many observations (AcceptanceHistory.prior_weight).
    engine_prior_weight: float = 2.0
    # A request's own rates: a running mean from the prior (worth request_prior_weight
    # observations) that turns into an EMA at request_alpha. A fixed EMA at 0.3 swung with each
    # draft, and the policy's choices followed the swings: on c1 code edits it ran 0.918x and
    # 0.924x of always drafting 4 (docs/history/benchmarks-waves-1-4.md, sixth session).
    request_alpha: float = 0.1
    request_prior_weight: float = 2.0
    # The drafter has a fallback (Proposer.has_fallback: lookup first, a head second): its
    # acceptance, cost and cap are priced apart (fallback_pricing.py).
    prices_fallback: bool = False
    # Structured output drafts its grammar's forced tokens first (grammar_draft.py): their
    # acceptance and cap are priced apart, from grammar_prior (the masked target cannot pick
    # another token where one is allowed; only the library's spelling of a forced text may
    # differ from the model's).
    prices_grammar: bool = False
    grammar_prior: float = 0.95
    # The drafter can give a tree under a node budget (Proposer.drafts_trees, --draft-tree): each
    # request is priced as a chain and as a tree (tree_pricing.py) and drafts the better shape.
    drafts_trees: bool = False
    # The rate a branch (a child other than the first) is assumed accepted at before trees are
    # seen (tree_pricing.BranchRates), worth this many observations.
    branch_prior: float = 0.25
    branch_prior_weight: float = 2.0

    def __post_init__(self) -> None:
        for name in ("prior_rate", "probe_rate", "probe_headroom", "branch_prior",
                     "grammar_prior"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if any(not 0.0 <= r <= 1.0 for r in self.synthetic_rates):
            raise ValueError(f"synthetic_rates must be in [0, 1], got {self.synthetic_rates}")
        if self.draft_cost_prior < 0:
            raise ValueError(f"draft_cost_prior must be >= 0, got {self.draft_cost_prior}")
        if not 1 <= self.draft_cost_min_samples <= self.draft_cost_window:
            raise ValueError("need 1 <= draft_cost_min_samples <= draft_cost_window, got "
                             f"{self.draft_cost_min_samples} and {self.draft_cost_window}")
        if self.probe_interval < 1 or self.probe_evidence < 0:
            raise ValueError("need probe_interval >= 1 and probe_evidence >= 0, got "
                             f"{self.probe_interval} and {self.probe_evidence}")
        if (
            not self.divergence_bound > 1.0
            or self.divergence_steps < 1
            or self.reprobe_interval < 1
        ):
            raise ValueError(
                "need divergence_bound > 1, divergence_steps >= 1, reprobe_interval >= 1"
            )

    def probe_rates(self, engine: AcceptanceHistory) -> Callable[[int], float]:
        """rate(position) a probe is priced at: ``probe_rate`` until ``engine`` has
        ``probe_evidence`` updates, then the engine's own rates plus ``probe_headroom``, never
        above ``probe_rate``. A request may do better than the engine's mean, so a probe keeps
        some optimism; none at all where the engine has shown the drafter far below it."""
        if engine.num_updates < self.probe_evidence:
            return lambda _i: self.probe_rate
        return lambda i: min(self.probe_rate, engine.rate(i) + self.probe_headroom)


def ema(old: float | None, new: float, alpha: float = 0.1) -> float:
    return new if old is None else old + alpha * (new - old)


class Rates(Protocol):
    """Per-position conditional acceptance rates (an AcceptanceHistory, FixedRates, Deeper)."""

    def rate(self, position: int) -> float: ...


class FixedRates:
    """A history-shaped set of fixed per-position conditional rates, the last repeating (the
    prior before anything is observed; synthetic mode's simulated acceptance)."""

    def __init__(self, *rates: float) -> None:
        self._rates = rates

    def rate(self, position: int) -> float:
        return self._rates[min(position, len(self._rates) - 1)]

    def expected_accepted(self, k: int) -> float:
        return expected_accepted(self.rate, k)


class Deeper:
    """Rates observed at the first positions, another estimate's below them."""

    def __init__(self, rates: list[float], below: Rates) -> None:
        self._rates, self._below = rates, below

    def rate(self, position: int) -> float:
        return self._rates[position] if position < len(self._rates) else self._below.rate(position)
