"""The step's drafts as the plan allows them (worker/draft_rows.py): at most each request's
budget, and a request the K policy cut verifies only a draft as deep as it asked."""

from __future__ import annotations

from dynaspec.draft_tree import DraftTree
from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.base import Drafts, Proposer
from dynaspec.step_plan import BatchDescriptor, ScheduledRequest, StepPlan
from dynaspec.worker.draft_rows import propose


class Fixed(Proposer):
    """Hands out the drafts it was given, per request id."""

    drafts_trees = True

    def __init__(self, drafts: dict) -> None:
        self.drafts = drafts

    def propose(self, requests, k_per_request, *, fallback_k=None, trees=None):  # type: ignore[no-untyped-def]
        got = [self.drafts[r.request_id] for r in requests]
        ids = [list(d.tokens) if isinstance(d, DraftTree) else d for d in got]
        trees_out = [d if isinstance(d, DraftTree) else None for d in got]
        return Drafts(ids, None, [None if d else "no_match" for d in ids], trees=trees_out)

    def forget(self, request_id: str) -> None:
        pass

    def preempt(self, request_id: str) -> None:
        pass

    def num_cached(self) -> int:
        return 0


def _row(rid: str, budget: int, min_depth: int) -> ScheduledRequest:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=32))
    return ScheduledRequest(request=req, num_new_tokens=1, draft_budget=budget, skip_reason=None,
                            block_table=[0], sampling=True, num_lookahead=budget,
                            min_draft_depth=min_depth)


def test_a_draft_shallower_than_the_policy_asked_is_dropped_as_a_short_match():
    bushy = DraftTree((5, 6, 7, 8), (-1, 0, -1, 2))  # 4 nodes, 2 deep (depth-first)
    deep = DraftTree((5, 6, 7, 8), (-1, 0, 1, 2))  # a chain of 4
    proposer = Fixed({"short": [5, 6], "full": [5, 6, 7, 8], "bushy": bushy, "deep": deep,
                      "none": [], "free": [5, 6]})
    rows = (_row("short", 4, 4), _row("full", 4, 4), _row("bushy", 4, 4), _row("deep", 4, 4),
            _row("none", 4, 4), _row("free", 4, 0))
    plan = StepPlan(scheduled=rows, step_k=4, num_batched_tokens=len(rows),
                    batch=BatchDescriptor("eager", len(rows), 5, 5 * len(rows)))
    got = propose(proposer, plan, None)
    assert got.skips == {"short": "short_match", "bushy": "short_match", "none": "no_match"}
    assert got.tokens == {"full": [5, 6, 7, 8], "deep": [5, 6, 7, 8], "free": [5, 6]}
    assert got.trees == {}  # the deep tree is a chain: verified as one
