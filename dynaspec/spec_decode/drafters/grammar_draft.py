"""The grammar as a drafter (docs/design.md §4d): under structured output, the tokens the grammar
forces from a request's state are drafts that cost no drafter call.

Two sources of forced tokens, tried in turn until k are found or the grammar leaves a choice:
- the library's jump-forward tokens: the text the grammar forces (a JSON key, its quotes and
  colon, the rest of an enum value once its first token is chosen, a closing brace), spelled
  greedily by the longest vocabulary tokens. The target may spell that text otherwise; then
  the verifier rejects the draft (its logits are masked by the grammar, so the token it picks
  instead is one plain constrained decoding would pick): a row lost, never a wrong token;
- a state that allows exactly one token (often a stop token once the grammar is complete):
  that token, which the masked target cannot but choose.

The matcher is borrowed: it advances over the forced tokens and is rolled back before the
function returns, so the step's grammar check (structured/step.py) finds it where it was.

`propose_with_grammar` composes the forced drafts with the request's own drafter: where the
grammar forces nothing, that drafter drafts as it would alone (under its own cap); where it
forces a prefix, the drafter continues after the prefix in the same chain
(`Proposer.continue_after`), up to the request's budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dynaspec.request import Request
from dynaspec.spec_decode.drafters.base import Proposer
from dynaspec.step_plan import ScheduledRequest
from dynaspec.structured.backend import Matcher, allocate_bitmask, single_allowed
from dynaspec.structured.manager import StructuredOutputManager

# The metrics' and policy's name for drafts the grammar forced (label source="grammar").
GRAMMAR_SOURCE = "grammar"


def forced_tokens(matcher: Matcher, k: int, vocab_size: int) -> list[int]:
    """Up to k tokens the grammar forces from `matcher`'s state; the state is left as found."""
    out: list[int] = []
    mask = allocate_bitmask(1, vocab_size)  # [1, words]
    try:
        while len(out) < k and not matcher.is_terminated():
            run = matcher.jump_forward_tokens()[: k - len(out)]
            if not run:
                matcher.fill_bitmask(mask, 0)
                only = single_allowed(mask, 0)
                if only is None:
                    break  # the model chooses here
                run = [only]
            for t in run:
                if not matcher.accept(t):
                    return out  # the library's spelling left its own grammar: stop before it
                out.append(t)
    finally:
        matcher.rollback(len(out))
    return out


class GrammarDrafter:
    """Forced drafts of a step's structured-output requests, from their matchers."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager

    def forced(self, request: Request, k: int) -> list[int]:
        """Up to k forced tokens of `request` (empty without a grammar, or where it ended)."""
        if k <= 0 or request.sampling_params.structured_output is None:
            return []
        m = self.manager.matcher_for(request)
        if m is None or m.is_terminated():
            return []
        return forced_tokens(m, k, self.manager.backend().vocab_size)


@dataclass
class GrammarDrafts:
    """Per request id: the chain drafted after forced tokens (forced first), and how many of
    its tokens were forced; requests the grammar forced nothing for are not in it."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    num_forced: dict[str, int] = field(default_factory=dict)
    setup_seconds: float = 0.0


def drafter_cap(s: ScheduledRequest) -> int:
    """The cap of the request's own drafter (the grammar's may be higher)."""
    return s.draft_budget if s.drafter_budget is None else min(s.drafter_budget, s.draft_budget)


def grammar_cap(s: ScheduledRequest) -> int:
    return s.draft_budget if s.grammar_budget is None else min(s.grammar_budget, s.draft_budget)


def propose_with_grammar(grammar: GrammarDrafter, proposer: Proposer | None,
                         sched: Sequence[ScheduledRequest]) -> GrammarDrafts:
    """The forced chains of `sched`'s requests, each continued by `proposer` where the budget
    leaves room after the forced prefix and the drafter's own cap allows."""
    got = GrammarDrafts()
    cont: list[tuple[ScheduledRequest, list[int], int]] = []
    for s in sched:
        f = grammar.forced(s.request, grammar_cap(s))
        if not f:
            continue
        rid = s.request.request_id
        got.tokens[rid], got.num_forced[rid] = f, len(f)
        room = min(drafter_cap(s), s.draft_budget - len(f))
        if room > 0 and proposer is not None:
            cont.append((s, f, room))
    if cont and proposer is not None:
        more = proposer.continue_after([s.request for s, _, _ in cont], [f for _, f, _ in cont],
                                       [k for _, _, k in cont])
        got.setup_seconds = more.setup_seconds
        for (s, f, room), d in zip(cont, more.token_ids):
            d = list(d[:room])
            if len(d) >= min(s.min_draft_depth, room):  # a cut request: only deep matches
                got.tokens[s.request.request_id] = f + d
    return got


def without_forced(sched: Sequence[ScheduledRequest], forced: GrammarDrafts
                   ) -> list[ScheduledRequest]:
    """The requests the grammar forced nothing for, that their own drafter may draft."""
    return [s for s in sched if s.request.request_id not in forced.tokens]

