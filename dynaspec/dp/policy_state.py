"""The K policy's engine-wide state, copied to every member when a group forms (§7d).

The step K is a pure function of the gathered view and of state every rank updates identically
(dp/agreement.py). A re-formed group breaks the second half twice: a replacement rank starts
from a fresh policy, and a survivor may have applied one more tick than another (a peer died
after some ranks had its row). So at every formation the member that has run the most ticks
exports this state and the others import it: the tables and rates a decision reads (the goodput
policy's cost table, draft cost, engine-wide acceptance prior and divergence guard), never the
per-request histories, which only lower a request's own cap.
"""

from __future__ import annotations

import copy

from dynaspec.dp.agreement import LockstepPolicy

# GoodputPolicy attributes its DP decision reads (goodput_policy._shared_rows, the guard).
SHARED_FIELDS = ("cost_model", "draft_seconds_per_token", "draft_costs", "modelled_goodput",
                 "observed_goodput", "num_decode_steps",
                 "diverged_steps", "last_reprobe_step", "reprobe_pending", "num_reprobes")
_HISTORY_FIELDS = ("rates", "counts", "num_updates")


def export_state(policy: LockstepPolicy | None) -> dict | None:
    if policy is None:
        return None
    inner = policy.inner
    state = {"kind": type(inner).__name__,
             "fields": {f: copy.deepcopy(getattr(inner, f)) for f in SHARED_FIELDS
                        if hasattr(inner, f)}}
    shared = policy.agreement.shared
    if shared is not None:
        state["acceptance"] = {f: copy.deepcopy(getattr(shared, f)) for f in _HISTORY_FIELDS}
    return state


def import_state(policy: LockstepPolicy | None, state: dict | None) -> None:
    """Make this rank's policy decide as the exporter's does."""
    if policy is None or state is None:
        return
    fields = state["fields"]
    if type(policy.inner).__name__ != state["kind"]:
        from dynaspec.dp.agreement import follow_rank0

        cost = fields.get("cost_model")
        follow_rank0(policy, policy.inner, cost.to_json() if cost is not None else None)
    for name, value in fields.items():
        setattr(policy.inner, name, copy.deepcopy(value))
    shared = policy.agreement.shared
    if shared is not None and "acceptance" in state:
        for name, value in state["acceptance"].items():
            setattr(shared, name, copy.deepcopy(value))
