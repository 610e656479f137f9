"""A step's verification, read top to bottom: the target's logits and the step's frozen draft rows
in, one frozen `RequestResult` per scheduled request out (docs/design.md §4, §4c, §7c).

In order: the grammar masks its rows, logits processors adjust theirs (both in place, on the
step's own logits), every sampling row is verified, the grammar advances over what each request
accepted, and each result is built once from its row and its tokens. Which rule a row takes:
- a row whose drafts are a tree: the tree walk (sample/tree_sampler.py), greedy or random;
- the other rows together: the batched chain rule (sample/rejection_sampler.py), greedy or
  random, with the drafter's q where it gave one; `--rejection-mode synthetic` (NOT lossless)
  by its rates; rows without a draft by the plain sampler (the same draws);
- a greedy CUDA-graph step: the chain rule over the argmax its graph computed.
The math lives in those modules; this file decides which a row takes and what it counts.
"""

from __future__ import annotations

import torch

from dynaspec.draft_tree import tree_walk
from dynaspec.outputs import RequestResult
from dynaspec.sample.logits_processor import LogitsProcessing
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.rejection_sampler import greedy_from_argmax, rejection_sample
from dynaspec.sample.sampler import Sampler, row_logprobs
from dynaspec.sample.synthetic import SyntheticVerifier
from dynaspec.sample.tree_sampler import verify_tree
from dynaspec.spec_decode.plan.step_width import num_padding
from dynaspec.structured.step import GrammarStep
from dynaspec.worker.draft_rows import DraftRow, DraftRows

# Per sampling row: the step's tokens (accepted drafts + one) and a tree's accepted path.
Verdict = tuple[list[int], tuple[int, ...] | None]


def verify(logits: torch.Tensor, rows: DraftRows, *, grammar: GrammarStep | None = None,
           processing: LogitsProcessing | None = None,
           synthetic: SyntheticVerifier | None = None,
           graph_argmax: torch.Tensor | None = None) -> tuple[RequestResult, ...]:
    """logits: [R, vocab], the sampling rows' drafts + 1 rows each, request after request.
    `graph_argmax`: [R] each row's argmax, computed by a CUDA-graph step (on the device)."""
    sampled, md = [r for r in rows.rows if r.sample is not None], rows.sampling
    if md is None:  # only prefill chunks: nothing to verify
        return tuple(RequestResult(request_id=r.request_id, token_ids=(),
                                   skip_reason=r.skip_reason) for r in rows.rows)
    if grammar is not None:
        grammar.mask(logits, rows.layout)
    if processing is not None:
        processing.apply(logits)
    if graph_argmax is not None and md.all_greedy and synthetic is None \
            and processing is None and grammar is None and not any(r.tree for r in sampled):
        verdicts: list[Verdict] = [(t, None) for t in greedy_from_argmax(
            graph_argmax.tolist(), [list(r.tokens) for r in sampled])]
    else:
        verdicts = _verdicts(logits, sampled, md, synthetic)
    results, at = [], 0
    for i, r in enumerate(rows.rows):
        if r.sample is None:
            results.append(RequestResult(request_id=r.request_id, token_ids=(),
                                         skip_reason=r.skip_reason))
            continue
        tokens, path = verdicts[r.sample]
        n_acc = len(tokens) - 1
        lp = md.num_logprobs[r.sample]
        logprobs = row_logprobs(logits[at: at + len(tokens)], tokens, lp) \
            if lp is not None else None
        at += len(r.tokens) + 1
        g = grammar.commit(i, tokens, n_acc) if grammar is not None else None
        results.append(RequestResult(
            request_id=r.request_id, token_ids=g.token_ids if g else tuple(tokens),
            num_draft_tokens=r.num_valid, num_accepted_tokens=n_acc,
            skip_reason=r.skip_reason, logprobs=logprobs,
            # Slots cut (by the grammar, or found invalid under async scheduling) are pads on
            # a fixed-shape row and not in the row at all on eager; each counts under its reason.
            num_padding_tokens=num_padding(len(r.tokens), r.num_valid,
                                           r.num_cut + r.num_async_invalid),
            num_grammar_invalid_tokens=g.num_invalid if g else 0,
            grammar_terminated=g.terminated if g else False,
            grammar_dead_end=g.dead_end if g else False,
            num_async_invalid_tokens=r.num_async_invalid, drafts_from_fallback=r.from_fallback,
            num_forced_tokens=r.num_forced,
            drafts_by_source=_by_source(r.sources, path, n_acc),
            num_tree_nodes=len(r.tree) if r.tree else 0, tree_depth=r.tree.depth if r.tree else 0,
            tree_path=path,
            tree_walk=None if r.tree is None or path is None else tree_walk(r.tree, list(path))))
    return tuple(results)


def _by_source(sources: tuple[str, ...], path: tuple[int, ...] | None,
               n_acc: int) -> tuple[tuple[str, int, int], ...]:
    """(source, drafts verified, drafts accepted) per source of a row whose drafts carry
    sources: the accepted ones are a tree's path nodes, or a chain's first n_acc."""
    if not sources:
        return ()
    accepted = path if path is not None else range(n_acc)
    got: dict[str, list[int]] = {}
    for src in sources:
        got.setdefault(src, [0, 0])[0] += 1
    for node in accepted:
        got[sources[node]][1] += 1
    return tuple((src, d, a) for src, (d, a) in got.items())


def _verdicts(logits: torch.Tensor, sampled: list[DraftRow], md: SamplingMetadata,
              synthetic: SyntheticVerifier | None) -> list[Verdict]:
    """Trees walked on their own rows; every other row through the batched chain rule."""
    verdicts: dict[int, Verdict] = {}  # by position in `sampled`
    chains: list[int] = []
    chain_rows: list[int] = []
    at = 0
    for k, r in enumerate(sampled):
        n = len(r.tokens) + 1
        if r.tree is not None:
            path, tokens = verify_tree(logits[at: at + n], r.tree, md, k)
            verdicts[k] = (tokens, tuple(path))
        else:
            chains.append(k)
            chain_rows.extend(range(at, at + n))
        at += n
    if len(chains) < len(sampled) and chains:
        logits = logits[torch.tensor(chain_rows, dtype=torch.long, device=logits.device)]
        md = md.subset(chains)
    if chains:
        for k, tokens in zip(chains, _chains(logits, [sampled[k] for k in chains], md, synthetic)):
            verdicts[k] = (tokens, None)
    return [verdicts[k] for k in range(len(sampled))]


def _chains(logits: torch.Tensor, rows: list[DraftRow], md: SamplingMetadata,
            synthetic: SyntheticVerifier | None) -> list[list[int]]:
    num_draft, drafts = [len(r.tokens) for r in rows], [list(r.tokens) for r in rows]
    if not any(num_draft):
        return [[t] for t in Sampler()(logits, md).token_ids.tolist()]
    if synthetic is not None:
        return synthetic(logits, num_draft, drafts, md, [r.request_id for r in rows])
    q = [r.probs for r in rows]
    return rejection_sample(logits, num_draft, drafts, q if any(x is not None for x in q)
                            else None, md)
