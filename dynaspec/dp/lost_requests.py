"""What becomes of a lost rank's requests (§7d), on the front end's engine thread.

A request that had streamed nothing is sent again, whole, to the least-loaded serving rank:
the client sees only the delay (counted as re-queued). While no rank serves (one rank, or all
lost) it is parked until a replacement joins, and failed if none can be started. A request
that had streamed tokens ends with ``finish_reason "error"`` and a message naming the rank and
the cause. It is not resumed from its streamed tokens: the exact continuation is known only for
greedy requests without stop strings, logprobs or a grammar's state, and a resumed stream that
is silently different from the reference path is worse than a clear error a client can retry.
"""

from __future__ import annotations

import logging

from dynaspec.outputs import RequestOutput

log = logging.getLogger("dynaspec.dp")

PARKED = -1  # a record's rank while no rank serves


class LostRequests:
    def __init__(self, eng) -> None:
        self.eng = eng  # the DPEngine: its records, routing, backlog and counts
        self.parked: dict[str, str] = {}  # request id -> the loss it waits out

    def settle(self, rank: int, why: str) -> None:
        """A rank was declared lost (and killed): re-queue what it had not streamed, fail the
        rest with its name and cause (module docstring)."""
        eng = self.eng
        eng.snapshots.pop(rank, None)
        eng.free_blocks.pop(rank, None)
        if eng.metrics is not None:
            eng.metrics.rank_lost(rank)
        serving = eng.roster.serving - {rank}
        for rid, rec in list(eng.records.items()):
            if rec.rank != rank:
                continue
            eng.load[rank] -= 1
            if rec.token_ids:
                self.fail(rid, f"{why} (after {len(rec.token_ids)} streamed token(s); "
                                "not resumed)")
                continue
            eng.resilience.requeued += 1
            if serving:
                eng._route(rid, eng._least_loaded(serving))
            else:  # no rank serves now: held for the replacement (``unpark``)
                rec.rank = PARKED
                self.parked[rid] = why
        if eng.resilience.requeued or eng.resilience.failed:
            log.warning("%s: %d request(s) re-queued, %d failed so far", why,
                        eng.resilience.requeued, eng.resilience.failed)

    def unpark(self) -> None:
        """Requests held while no rank served: routed once one does, failed once none will."""
        eng = self.eng
        serving = eng.roster.serving
        if not serving and eng.roster.recovering():
            return
        for rid, why in list(self.parked.items()):
            del self.parked[rid]
            if rid not in eng.records:
                continue  # aborted meanwhile
            if serving:
                eng._route(rid, eng._least_loaded(serving))
            else:
                eng.resilience.requeued -= 1  # it was never served again after all
                self.fail(rid, f"{why} (and no data-parallel rank could be started)")

    def fail(self, rid: str, error: str) -> None:
        eng = self.eng
        rec = eng.records.pop(rid)
        eng.resilience.failed += 1
        eng._backlog.append(RequestOutput(rid, rec.prompt_ids, rec.token_ids, [],
                                           finished=True, finish_reason="error", error=error))
