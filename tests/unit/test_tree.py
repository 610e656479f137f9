"""Draft trees: depth-first validation, depths, visibility among the query rows, K/V moves."""

from __future__ import annotations

import pytest
import torch

from dynaspec.draft_tree import DraftTree, kv_moves

# root -> a(0) -> c(1), d(2) -> e(3) ; root -> b(4) -> f(5)
TREE = DraftTree((10, 12, 13, 14, 11, 15), (-1, 0, 0, 2, -1, 4))


def test_depths_children_and_paths():
    assert TREE.depths == (0, 1, 1, 2, 0, 1)
    assert TREE.depth == 3 and not TREE.is_chain
    assert TREE.children(-1) == [0, 4] and TREE.children(0) == [1, 2] and TREE.children(1) == []
    assert TREE.path_to(3) == [0, 2, 3] and TREE.path_to(5) == [4, 5]
    assert TREE.position_offsets() == [0, 1, 2, 2, 3, 1, 2]
    assert TREE.first_path() == [10, 12]
    assert TREE.cut(3) == DraftTree((10, 12, 13), (-1, 0, 0))


def test_chain_is_the_tree_with_one_child_each():
    c = DraftTree.chain([5, 6, 7])
    assert c.is_chain and c.depth == 3 and c.first_path() == [5, 6, 7]
    assert torch.equal(c.visibility(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert DraftTree.chain([]).depth == 0


def test_visibility_is_root_ancestors_and_self():
    vis = TREE.visibility()  # rows/cols: root, then node i at 1 + i
    for i in range(len(TREE)):
        seen = {0} | {1 + n for n in TREE.path_to(i)}
        assert {j for j in range(len(TREE) + 1) if vis[1 + i, j]} == seen, f"node {i}"
    assert vis[0].tolist() == [True] + [False] * len(TREE)


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, -1, 0), (-1, 0, 5)])
def test_not_depth_first_is_refused(parents):
    with pytest.raises(ValueError, match="draft tree"):
        DraftTree(tuple(range(len(parents))), parents)


def test_token_and_parent_counts_must_agree():
    with pytest.raises(ValueError, match="2 tokens but 1 parents"):
        DraftTree((1, 2), (-1,))


def test_kv_moves_put_the_path_at_its_depths():
    assert kv_moves([0, 2, 3]) == [(3, 2), (4, 3)]
    assert kv_moves([0, 1]) == []  # the first branch is already in place
    assert kv_moves([4, 5]) == [(5, 1), (6, 2)]
    # moving in order never overwrites a row still to be read
    for path in ([0, 2, 3], [4, 5], [1, 3, 6, 9]):
        rows = list(range(12))
        for src, dst in kv_moves(path):
            rows[dst] = rows[src]
        assert rows[1:1 + len(path)] == [1 + p for p in path]


@pytest.mark.parametrize("speculator,says", [("suffix", "node budget"), ("draft", "refused")])
def test_schedule_explain_describes_draft_trees(speculator, says):
    import argparse
    import io
    import json

    from dynaspec.cli import schedule_cmd

    for as_json in (False, True):
        args = argparse.Namespace(speculator=speculator, num_spec_tokens=8, k_schedule="4",
                                  drafter_max_k=None, json=as_json, draft_tree=True)
        out, err = io.StringIO(), io.StringIO()
        assert schedule_cmd.explain(args, out, err) == 0, err.getvalue()
        text = json.loads(out.getvalue())["draft_tree"] if as_json else out.getvalue()
        assert says in text
