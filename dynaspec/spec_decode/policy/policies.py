"""Choosing and building the K policy the engine runs: ``auto`` resolved against the user's
flags, then the table, adaptive or goodput policy constructed (names in `registry.K_POLICIES`)."""

from __future__ import annotations

from dynaspec.registry import K_POLICIES
from dynaspec.spec_decode.plan.plan import SpecPlan
from dynaspec.spec_decode.policy.cost_model import StepCostModel
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy, GoodputSettings
from dynaspec.spec_decode.policy.k_policy import AdaptivePolicy, KPolicy, TablePolicy


def resolve_policy_name(name: str, speculating: bool, has_schedule: bool = False) -> str | None:
    """``auto`` runs the table when the user wrote a ``--k-schedule`` (an explicit schedule is an
    instruction: constant(k) keeps width 1+k on every decode step) and goodput otherwise; None
    when no policy runs (no drafter)."""
    K_POLICIES.check(name)
    if not speculating:
        return None
    if name == "auto":
        return "table" if has_schedule else "goodput"
    return name


def make_policy(plan: SpecPlan, name: str, cost_per_width: dict[int, float] | None = None,
                cost_model: StepCostModel | None = None,
                allowed_widths: tuple[int, ...] | None = None, has_schedule: bool = False,
                settings: GoodputSettings | None = None) -> KPolicy:
    resolved = resolve_policy_name(name, plan.speculating, has_schedule) or "table"
    if resolved == "table":
        return TablePolicy(plan)
    if resolved == "adaptive":
        return AdaptivePolicy(plan, cost_per_width)
    if cost_model is None:
        raise ValueError("the goodput policy needs a step cost model (measured at start-up)")
    return GoodputPolicy(plan, cost_model, settings or GoodputSettings(),
                         allowed_widths=allowed_widths)
