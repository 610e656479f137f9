"""HybridTreeProposer: the lookup's chain as the tree's first path, the head's chain sharing its
agreeing prefix and branching off where they part, within the node budget; sources per node;
chains (lookup first) where a chain is asked for; both drafters told of every end."""

from __future__ import annotations

import pytest

from dynaspec.draft_tree import DraftTree
from dynaspec.spec_decode.drafters.base import Drafts
from dynaspec.spec_decode.drafters.hybrid_tree import HybridTreeProposer, head_budget, merge
from tests.unit.drafter_fakes import FakeDrafter, request


def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root path's tokens (what the tree can accept)."""
    return {tuple(tree.tokens[n] for n in tree.path_to(i)) for i in range(len(tree))}


def test_merge_shares_the_agreeing_prefix_and_branches_where_they_part():
    tree, src = merge([5, 6, 7, 8], [5, 6, 9], 8, "ngram")
    assert tree.first_path() == [5, 6, 7, 8]  # the lookup's chain first
    assert (5, 6, 9) in _paths(tree) and len(tree) == 5  # the head's 9 a sibling of the 7
    assert src == ("ngram",) * 4 + ("eagle",)


def test_merge_keeps_the_budget_lookup_first_but_keeps_the_heads_branch():
    tree, src = merge([5, 6, 7, 8], [4], 4, "suffix")
    assert len(tree) == 4 and tree.first_path() == [5, 6, 7]  # the deepest copy gave way
    assert (4,) in _paths(tree) and src == ("suffix",) * 3 + ("eagle",)
    tree, src = merge([5, 6, 7, 8], [5], 4, "suffix")  # agreeing: nothing to give way for
    assert tree.is_chain and list(tree.tokens) == [5, 6, 7, 8] and src == ("suffix",) * 4


def test_merge_extends_a_lookup_chain_the_head_agrees_with_and_falls_back_to_the_head():
    tree, src = merge([5, 6], [5, 6, 7, 8], 8, "ngram")
    assert tree.is_chain and list(tree.tokens) == [5, 6, 7, 8]
    assert src == ("ngram", "ngram", "eagle", "eagle")
    tree, src = merge([], [3, 4], 8, "ngram")
    assert tree.is_chain and list(tree.tokens) == [3, 4] and src == ("eagle", "eagle")
    tree, src = merge([], [], 8, "ngram")
    assert len(tree) == 0 and src == ()


@pytest.mark.parametrize("budget", range(1, 7))
def test_merge_never_exceeds_the_budget(budget):
    for look in ([], [1], [1, 2, 3, 4, 5, 6]):
        for head in ([], [1], [9], [1, 2, 9, 9], [9, 9, 9, 9, 9, 9]):
            tree, src = merge(look, head, budget, "ngram")
            assert len(tree) == len(src) <= budget
            if look:  # the lookup's first token always stays, leading the first path
                assert tree.tokens[0] == look[0] and src[0] == "ngram"
            # the head's tokens kept are one prefix of its chain, on one root path
            kept = [tree.tokens[i] for i, s in enumerate(src) if s == "eagle"]
            if kept:
                path = tree.path_to(len(tree) - 1)  # the head's branch is the last
                assert [tree.tokens[n] for n in path] == list(head[: len(path)])


def test_head_budget():
    assert head_budget(8, 0, True, 3) == 3  # no match: the head, to the depth it chains
    assert head_budget(2, 0, True, 3) == 2
    assert head_budget(8, 6, True, 3) == 2  # past a short match: the rest of the budget
    assert head_budget(8, 3, True, 3) == 3
    assert head_budget(8, 8, True, 3) == 0  # a full match: the lookup's alone
    assert head_budget(8, 3, False, 3) == 0  # a chain: the lookup's alone
    assert head_budget(0, 0, True, 3) == 0


def test_a_self_sizing_lookup_keeps_its_pricing():
    lookup = FakeDrafter({}, hidden=False)
    lookup.sizes_own_drafts = True  # as suffix decoding declares
    assert HybridTreeProposer(lookup, FakeDrafter({}, hidden=True), "suffix").sizes_own_drafts
    assert not HybridTreeProposer(FakeDrafter({}, hidden=False), FakeDrafter({}, hidden=True),
                                  "ngram").sizes_own_drafts


def test_propose_trees_chains_sources_and_skips():
    lookup = FakeDrafter({"a": [7, 8, 9], "c": [1, 2]}, hidden=False)
    head = FakeDrafter({"a": [6], "b": [4, 5], "c": [1, 3]}, hidden=True)
    p = HybridTreeProposer(lookup, head, "ngram")
    assert p.drafts_trees and p.reads_hidden_states
    reqs = [request("a"), request("b"), request("c"), request("d"), request("e")]
    d = p.propose(reqs, [4, 2, 3, 2, 0], trees=[True, True, False, True, True])
    assert head.asked == [("a", 1), ("b", 2), ("d", 2)]  # c: a chain was asked; e: k=0
    assert d.trees is not None and d.trees[0] is not None
    assert _paths(d.trees[0]) >= {(7, 8, 9), (6,)}
    assert d.token_ids[1:] == [[4, 5], [1, 2], [], []]
    assert d.trees[1:] == [None] * 4  # chains are not trees
    assert d.sources == [("ngram",) * 3 + ("eagle",), ("eagle",) * 2, ("ngram",) * 2, (), ()]
    assert d.skip_reasons == [None, None, None, "no_match", None]
    p.observe_hidden("hs")
    assert head.seen == ["hs"]
    p.forget("a")
    p.preempt("b")
    assert lookup.ended == head.ended == ["a", "b"]


def test_built_without_trees_it_drafts_lookup_first_chains():
    lookup = FakeDrafter({"a": [7, 8]}, hidden=False)
    head = FakeDrafter({"a": [6], "b": [4, 5]}, hidden=True)
    d = HybridTreeProposer(lookup, head, "suffix", tree=False).propose([request("a"), request("b")],
                                                                      [3, 3])
    assert d.token_ids == [[7, 8], [4, 5]] and d.trees is None
    assert head.asked == [("b", 3)]


def test_refuses_pairs_in_the_wrong_roles_and_a_probabilistic_head():
    with pytest.raises(ValueError, match="lookup drafter"):
        HybridTreeProposer(FakeDrafter({}, hidden=True), FakeDrafter({}, hidden=True), "ngram")
    head = FakeDrafter({"a": [1]}, hidden=True)
    inner = head.propose
    head.propose = lambda reqs, ks, **_: Drafts(inner(reqs, ks).token_ids, [None], [None])
    with pytest.raises(ValueError, match="deterministic head"):
        HybridTreeProposer(FakeDrafter({}, hidden=False), head, "ngram").propose(
            [request("a")], [2])
