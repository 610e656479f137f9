"""What a data-parallel engine says of its health (/health), read from its roster
(dp/roster.py): "ok" while every rank serves, "degraded" while fewer do (with the ranks being
replaced or given up, and the last loss), and why nothing serves when no rank does (a 503).
"""

from __future__ import annotations

from dynaspec.dp.roster import Roster


def failure(roster: Roster, closing: bool) -> str | None:
    """Why nothing serves, None while any rank does."""
    if closing:
        return "the data-parallel engine is shut down"
    if roster.serving:
        return None
    return f"no data-parallel rank is serving (last loss: {roster.last_loss})" \
        if roster.last_loss else "no data-parallel rank is serving"


def health_detail(roster: Roster) -> dict:
    """/health's detail: ``degraded`` while fewer ranks serve than were asked for."""
    serving = sorted(roster.serving)
    status = "ok" if len(serving) == roster.world_size else "degraded"
    out: dict = {"status": status, "ranks_serving": serving,
                 "data_parallel_size": roster.world_size}
    if status != "ok":
        # Read on the HTTP thread while the pump writes: copies made in one C call each.
        out["ranks_starting"] = sorted({*list(roster.starting), *list(roster.joining)})
        out["ranks_given_up"] = sorted(list(roster.given_up))
        out["ranks_awaiting_their_machine"] = sorted(list(roster.awaiting_remote))
        out["last_loss"] = roster.last_loss
    return out
