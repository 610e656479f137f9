"""Tree drafting: n-gram branches on the distinct continuations of its matches, suffix expands
its most likely continuations greedily; where the evidence agrees both give today's chain."""

from __future__ import annotations

import numpy as np

from dynaspec.draft_tree import DraftTree
from dynaspec.spec_decode.drafters.ngram import ngram_match, ngram_tree
from dynaspec.spec_decode.drafters.suffix_index import SuffixIndex


def test_ngram_tree_branches_where_matches_disagree():
    # "1 2" is followed by 3 4 (twice, earlier) and by 7 8 (most recent); the context ends "1 2"
    toks = np.array([1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 7, 8, 9, 1, 2])
    # the budget goes by weight: the two agreeing matches' 3 4 9 1 2 first, then (ties: the
    # most recent match first) the 7 branch
    assert ngram_tree(toks, 2, 2, 5) == DraftTree((3, 4, 9, 1, 2), (-1, 0, 1, 2, 3))
    t = ngram_tree(toks, 2, 2, 6)
    assert isinstance(t, DraftTree) and not t.is_chain
    assert t.tokens[:2] == (3, 4) and t.parents[:2] == (-1, 0), "the heavier branch first"
    assert (7, -1) in zip(t.tokens, t.parents), "the most recent continuation is a branch"
    assert len(t) == 6


def test_ngram_tree_is_the_chain_when_matches_agree():
    toks = np.array([5, 6, 7, 8, 1, 5, 6, 7, 8, 2, 5, 6])
    t = ngram_tree(toks, 2, 3, 3)  # 7 8 agree; at the split the most recent match's 2 wins
    assert t.is_chain and list(t.tokens) == ngram_match(toks, 2, 3, 3).tolist() == [7, 8, 2]
    assert ngram_tree(toks[:-1], 2, 3, 3) == ngram_match(toks[:-1], 2, 3, 3).tolist()
    assert ngram_tree(np.array([1, 2, 3]), 2, 3, 3) == []


def test_suffix_follow_tree_expands_by_estimated_probability():
    idx = SuffixIndex()
    # after "1 2": 3 three times, 5 once; after "1 2 3": 4 twice, 6 once
    idx.append([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 6, 0, 1, 2, 5, 0, 1, 2])
    ends, m = idx.match(np.array([1, 2]), before=idx.length - 1)
    toks, parents, probs = idx.follow_tree(ends, 4, 5, 0.1)
    t = DraftTree(tuple(toks), tuple(parents))
    assert toks[0] == 3 and parents[0] == -1 and abs(probs[0] - 0.75) < 1e-9
    assert toks[1] == 4 and parents[1] == 0 and abs(probs[1] - 0.5) < 1e-9
    assert sorted(zip(toks, parents))[:] == sorted(zip(t.tokens, t.parents))
    assert 5 not in toks and 6 not in toks, "the 0.25 branches wait for the 0.5 path (depth 5)"
    toks, parents, probs = idx.follow_tree(ends, 8, 5, 0.1)
    assert len(toks) == 8 and (5, -1) in set(zip(toks, parents))
    assert (6, toks.index(3)) in set(zip(toks, parents))
    DraftTree(tuple(toks), tuple(parents))  # depth-first, parents first
    chain, cprobs = idx.follow(ends, 2, 0.1)
    assert chain == toks[:2] and cprobs == probs[:2], "the first path is follow()'s chain"
    # min_prob prunes: at 0.3 the 0.25 branches never join
    toks, parents, _ = idx.follow_tree(ends, 8, 5, 0.3)
    assert 5 not in toks and 6 not in toks


def test_a_tree_drafter_gives_the_shape_asked_for_each_request():
    """The K policy chooses chain or tree per request (`propose(..., trees=)`): a tree-drafting
    n-gram proposer asked for a chain gives exactly the chain drafter's draft."""
    from dynaspec.request import Request
    from dynaspec.sampling_params import SamplingParams
    from dynaspec.spec_decode.drafters.ngram import NgramProposer

    toks = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 7, 8, 9, 1, 2]
    reqs = [Request(f"r{i}", list(toks), SamplingParams(max_tokens=8)) for i in range(2)]
    tree, chain = NgramProposer(2, 2, tree=True), NgramProposer(2, 2)
    assert tree.drafts_trees and not chain.drafts_trees
    got = tree.propose(reqs, [6, 6], trees=[True, False])
    assert got.trees is not None and got.trees[0] is not None and not got.trees[0].is_chain
    assert got.trees[1] is None
    assert got.token_ids[1] == chain.propose(reqs[1:], [6]).token_ids[0]
    assert tree.propose(reqs, [6, 6]).trees[1] is not None, "unasked: trees, as built"
