"""Runner results -> metric records: where each draft slot of a step is accounted for.

One `RequestStepSpec` per request in a step (docs/design.md §5). Every slot of a request's draft row
is
exactly one of: a valid draft (`num_draft_tokens`), or an invalid one by reason: `padding` (-1 on
a fixed-shape row), `grammar` (cut by the request's grammar before verification) or
`async_placeholder` (docs/design.md §7b: budgeted while the previous step was in flight, then found
skipped). A request-step with no valid draft but some invalid ones is an `all_invalid` skip (the
fold counts it so); one with neither keeps the runner's skip reason.

`orphan_spec` covers the request that ended (an abort, a failure) while its step was in
flight or before that step's outputs were returned: the step's result for it is thrown away, so
every slot of its row, verified or not, goes down the invalid-draft channel and it emits nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynaspec.metrics.records import RequestStepSpec
from dynaspec.outputs import RequestResult
from dynaspec.step_plan import ScheduledRequest

ASYNC_PLACEHOLDER = "async_placeholder"


def prompt_tokens(scheduled: Sequence[ScheduledRequest]) -> int:
    """Prompt tokens (recomputed ones included) a step computes: every new token except a
    decoding request's one, the token it sampled last step. Read before the step's result
    changes the requests' counters (both paths call it then)."""
    return sum(s.num_new_tokens for s in scheduled
               if s.request.num_computed_tokens < s.request.num_prompt_tokens)


def request_spec(r: RequestResult, num_emitted: int) -> RequestStepSpec:
    """The record of a request whose step result was applied."""
    invalid = {}
    for reason, n in (("padding", r.num_padding_tokens), ("grammar", r.num_grammar_invalid_tokens),
                      (ASYNC_PLACEHOLDER, r.num_async_invalid_tokens)):
        if n:
            invalid[reason] = n
    skip = r.skip_reason if not r.num_draft_tokens and not invalid else None
    return RequestStepSpec(r.request_id, r.num_draft_tokens, r.num_accepted_tokens, num_emitted,
                           skip, invalid, num_tree_nodes=r.num_tree_nodes,
                           num_forced_tokens=r.num_forced_tokens,
                           drafts_by_source=r.drafts_by_source)


def orphan_spec(s: ScheduledRequest, r: RequestResult, k: int | None) -> RequestStepSpec | None:
    """The record of a request whose step result `r` was thrown away because it had ended.
    None when there is nothing to account (speculation off, or no draft slot and no reason)."""
    if k is None:
        return None
    slots = (r.num_draft_tokens + r.num_padding_tokens + r.num_grammar_invalid_tokens
             + r.num_async_invalid_tokens)
    if slots:
        return RequestStepSpec(s.request.request_id, 0, 0, 0, None, {ASYNC_PLACEHOLDER: slots})
    if r.skip_reason is None:
        return None
    return RequestStepSpec(s.request.request_id, 0, 0, 0, r.skip_reason)
