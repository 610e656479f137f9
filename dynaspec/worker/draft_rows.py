"""A step's drafts as frozen rows: what the grammar forced and the drafter proposed, cut to each
request's cap, then (after the grammar's cut) padded to the planned width, one `DraftRow` per
scheduled request.

`propose` takes the grammar's forced drafts (spec_decode/drafters/grammar_draft.py) and asks
the drafter; the runner then admits trees (worker/tree_step.py: the chains that stand in for the
others) and lets the grammar check the drafts (structured/step.py: where it cuts each); `build`
lays the survivors out as the rows the forward computes and `worker/verify.py` verifies. Each of
those returns a value: no one edits the drafter's drafts, and nothing changes a row once built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from dynaspec.draft_tree import DraftTree
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.synthetic import SyntheticVerifier
from dynaspec.spec_decode.drafters.base import Drafts, Proposer
from dynaspec.spec_decode.drafters.grammar_draft import (
    GrammarDrafter,
    drafter_cap,
    propose_with_grammar,
    without_forced,
)
from dynaspec.spec_decode.plan import step_width as width
from dynaspec.step_plan import ScheduledRequest, StepPlan


@dataclass(frozen=True, kw_only=True)
class StepDrafts:
    """What the drafter gave a step, per request id (real drafts only, before any padding)."""

    tokens: dict[str, list[int]]
    probs: dict[str, torch.Tensor | None]  # [len(tokens), vocab] q where the drafter has one
    skips: dict[str, str]  # request id -> why it got no draft
    trees: dict[str, DraftTree]  # drafts that are a real tree (not a chain)
    fallback: frozenset[str] = frozenset()  # requests the fallback drafted
    setup_seconds: float = 0.0  # Drafts.setup_seconds
    fallback_seconds: float = 0.0
    forced: dict[str, int] = field(default_factory=dict)  # request id -> drafts its grammar forced
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)  # Drafts.sources by id


@dataclass(frozen=True, kw_only=True)
class DraftRow:
    """One scheduled request's part of the step's verification."""

    request_id: str
    sample: int | None  # its entry in the step's SamplingMetadata; None: no token this step
    tokens: tuple[int, ...] = ()  # drafts verified, -1 pads included (a tree: its nodes)
    probs: torch.Tensor | None = None  # [len(tokens), vocab] draft q (pad rows 0); None one-hot
    tree: DraftTree | None = None  # the drafts are this tree's nodes, verified as a tree
    num_valid: int = 0  # real drafts in the row (after the grammar's cut)
    num_cut: int = 0  # drafts the grammar cut
    num_async_invalid: int = 0  # budgeted slots found invalid under async scheduling
    from_fallback: bool = False  # drafted by the drafter's fallback
    num_forced: int = 0  # of the valid drafts, the first ones its grammar forced (§4d)
    sources: tuple[str, ...] = ()  # each valid draft's source (Drafts.sources); (): the drafter
    skip_reason: str | None = None  # the plan's reason, else the drafter's when it drafted none


@dataclass(frozen=True)
class DraftRows:
    """Every scheduled request's row, in StepPlan.scheduled order, and the sampling settings
    of those that sample (`None` when none does)."""

    rows: tuple[DraftRow, ...]
    sampling: SamplingMetadata | None

    @property
    def layout(self) -> list[tuple[int, int]]:
        """(scheduled index, drafts verified) per sampling row: logits rows lie request after
        request, drafts + 1 each."""
        return [(i, len(r.tokens)) for i, r in enumerate(self.rows) if r.sample is not None]

    def drafts(self) -> dict[str, list[int]]:
        """Request id -> its row's drafts (pads included), for the rows that have any."""
        return {r.request_id: list(r.tokens) for r in self.rows if r.tokens}


def propose(proposer: Proposer | None, out: StepPlan, synthetic: SyntheticVerifier | None,
            grammar: GrammarDrafter | None = None) -> StepDrafts:
    """Real drafts only, at most each request's cap; padding comes after the grammar. With a
    grammar drafter, forced tokens come first (grammar_draft.py) and the drafter drafts the
    requests the grammar forced nothing for, under its own cap."""
    sched = [s for s in out.scheduled if s.draft_budget > 0]
    if not sched or (proposer is None and grammar is None):
        return StepDrafts(tokens={}, probs={}, skips={}, trees={})
    forced = propose_with_grammar(grammar, proposer, sched) if grammar is not None else None
    if forced is not None:
        sched = without_forced(sched, forced)
    got = _propose_drafter(proposer, sched, synthetic, grammar is not None)
    if forced is None:
        return got
    # Forced drafts are one-hot (deterministic): no probs.
    return replace(got, tokens={**got.tokens, **forced.tokens},
                   probs={**got.probs, **dict.fromkeys(forced.tokens)}, forced=forced.num_forced,
                   setup_seconds=got.setup_seconds + forced.setup_seconds)


def _propose_drafter(proposer: Proposer | None, sched: list[ScheduledRequest],
                     synthetic: SyntheticVerifier | None, own_caps: bool) -> StepDrafts:
    """The request's own drafter's drafts (`own_caps`: under its own cap, which the policy may
    set below the grammar's)."""
    tokens: dict[str, list[int]] = {}
    probs: dict[str, torch.Tensor | None] = {}
    skips: dict[str, str] = {}
    trees: dict[str, DraftTree] = {}
    if own_caps:
        for s in sched:
            if drafter_cap(s) <= 0:
                skips[s.request.request_id] = "adaptive"  # the grammar's cap only: it forced none
        sched = [s for s in sched if drafter_cap(s) > 0]
    if not sched or proposer is None:
        return StepDrafts(tokens=tokens, probs=probs, skips=skips, trees=trees)
    reqs = [s.request for s in sched]
    ks = [drafter_cap(s) if own_caps else s.draft_budget for s in sched]
    if proposer.has_fallback:
        fks = [k if s.fallback_budget is None else min(k, s.fallback_budget)
               for s, k in zip(sched, ks)]
        drafts: Drafts = proposer.propose(reqs, ks, fallback_k=fks)
    elif proposer.drafts_trees:  # the K policy chose each request's shape
        drafts = proposer.propose(reqs, ks, trees=[s.draft_tree for s in sched])
    else:
        drafts = proposer.propose(reqs, ks)
    fallback = set()
    sources: dict[str, tuple[str, ...]] = {}
    for j, req in enumerate(reqs):
        rid, d = req.request_id, list(drafts.token_ids[j][: ks[j]])
        tree = drafts.trees[j] if drafts.trees is not None else None
        if tree is not None and len(tree):
            tree = tree.cut(ks[j])  # a node budget, like a chain's cap
            d = list(tree.tokens)
        if d and (tree.depth if tree is not None else len(d)) < sched[j].min_draft_depth:
            skips[rid] = "short_match"  # the policy wanted a longer match of this request
            continue
        if tree is not None and len(tree) and not tree.is_chain:
            trees[rid] = tree
        if synthetic is not None:
            d = synthetic.cut(d)  # no coin-flip EOS (see SyntheticVerifier)
        if d:
            tokens[rid] = d
            probs[rid] = drafts.probs[j] if drafts.probs is not None else None
            if drafts.from_fallback is not None and drafts.from_fallback[j]:
                fallback.add(rid)
            labels = drafts.sources[j] if drafts.sources is not None else None
            if labels:
                sources[rid] = tuple(labels[: len(d)])
        else:
            skips[rid] = drafts.skip_reasons[j] or "no_match"
    return StepDrafts(tokens=tokens, probs=probs, skips=skips, trees=trees,
                      fallback=frozenset(fallback), setup_seconds=drafts.setup_seconds,
                      fallback_seconds=drafts.fallback_seconds, sources=sources)


def build(out: StepPlan, got: StepDrafts, drafts: Mapping[str, Sequence[int]],
          trees: Mapping[str, DraftTree], cuts: Mapping[str, int],
          md: SamplingMetadata | None) -> DraftRows:
    """The step's rows from `drafts` (the drafter's, with the chains that stand in for trees
    not admitted) up to the grammar's `cuts` (request id -> drafts kept). On a fixed-shape step
    every sampling row verifies exactly the planned width: its drafts are padded with -1."""
    rows, k = [], 0
    for s in out.scheduled:
        rid = s.request.request_id
        if not s.sampling:
            rows.append(DraftRow(request_id=rid, sample=None, skip_reason=s.skip_reason))
            continue
        drafted = drafts.get(rid, ())
        valid = cuts.get(rid, len(drafted))
        d = list(drafted[:valid])
        if out.batch.fixed_shape and out.batch.width is not None:
            d = width.pad_row(d, out.batch.width)
        q = got.probs.get(rid) if valid else None
        skip = s.skip_reason
        if skip is None and not d:
            skip = got.skips.get(rid)
        rows.append(DraftRow(
            request_id=rid, sample=k, tokens=tuple(d), tree=trees.get(rid),
            probs=width.pad_probs(q[:valid], len(d)) if q is not None else None,
            num_valid=valid, num_cut=len(drafted) - valid,
            num_async_invalid=s.num_async_invalid, from_fallback=valid > 0 and rid in got.fallback,
            num_forced=min(valid, got.forced.get(rid, 0)),
            sources=_row_sources(got.sources.get(rid, ()), valid, got.forced.get(rid, 0)),
            skip_reason=skip))
        k += 1
    return DraftRows(tuple(rows), md)


def _row_sources(sources: tuple[str, ...], valid: int, forced: int) -> tuple[str, ...]:
    """The sources of a row's valid drafts: the drafter's labels of the nodes the row kept (a
    tree run as its first path, a grammar's cut: both keep leading nodes); () where the grammar
    forced drafts (its own source) or the drafter gave no labels."""
    return sources[:valid] if not forced and len(sources) >= valid else ()
