"""The eager paged backend on sliding-window layers with token trees (docs/design.md §4c): a
tree row, windowed at its depth, gives what its own root path gives as a chain."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention.backend import AttentionBatch, get_backend
from dynaspec.attention.paged import row_positions
from dynaspec.draft_tree import DraftTree
from dynaspec.worker.tree_step import visibility

BS, BLOCKS, HKV, G, D = 4, 64, 2, 2, 16
WINDOW = 4
# root -> 0 -> {1, 2 -> 3}; root -> 4 -> 5 ; root -> 6: 8 rows, the short (padded) group
SMALL = DraftTree((40, 41, 42, 43, 50, 51, 60), (-1, 0, 0, 2, -1, 4, -1))
# root -> a chain of 10; root -> a chain of 9: 20 rows, the long (one SDPA call) path
LONG = DraftTree(tuple(range(19)), (-1, *range(9), -1, *range(10, 18)))


def _tensors(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HKV * G, D, generator=gen)
    k = torch.randn(rows, HKV, D, generator=gen)
    v = torch.randn(rows, HKV, D, generator=gen)
    cache = torch.randn(2, BLOCKS * BS, HKV, D, generator=gen)
    return q, k, v, cache


def _run(q, k, v, cache, q_lens, ctx, tables, masks=None, window=WINDOW):
    eager = get_backend("eager")
    md = eager.build_metadata(AttentionBatch(q_lens, ctx, tables, BS, torch.device("cpu"),
                                             tree_masks=masks))
    return eager.forward(q, k, v, cache, md, 0.25, window=window)


def _chain_row(tree: DraftTree, node: int, q, k, v, cache, c0: int, table, window=WINDOW):
    """Tree row 1 + node computed as a chain: the root, then the node's root path."""
    rows = [0] + [1 + n for n in tree.path_to(node)]
    n = len(rows)
    return _run(q[rows], k[rows], v[rows], cache.clone(), [n], [c0 + n], [table],
                window=window)[-1]


def test_row_positions_put_tree_rows_at_their_depth():
    vis = visibility(2, SMALL)  # one new token, then the root and the tree
    assert row_positions(vis, 30).tolist() == [21, 22, 23, 24, 24, 25, 23, 24, 23]


@pytest.mark.parametrize("tree,c0", [(SMALL, 13), (LONG, 11)])
def test_a_windowed_tree_row_matches_its_path_as_a_chain(tree, c0):
    q_len = 1 + len(tree)
    table = list(range(-(-(c0 + q_len) // BS)))
    q, k, v, cache = _tensors(q_len, seed=len(tree))
    got = _run(q, k, v, cache.clone(), [q_len], [c0 + q_len], [table], [visibility(1, tree)])
    for node in range(len(tree)):
        want = _chain_row(tree, node, q, k, v, cache, c0, table)
        torch.testing.assert_close(got[1 + node], want, rtol=1e-5, atol=1e-5,
                                   msg=f"node {node}")
    # The window matters here: the deepest rows would differ with the whole context visible.
    deep = max(range(len(tree)), key=lambda n: len(tree.path_to(n)))
    whole = _chain_row(tree, deep, q, k, v, cache, c0, table, window=None)
    assert not torch.allclose(got[1 + deep], whole, rtol=1e-3, atol=1e-3)


def test_a_tree_beside_decodes_and_chains_keeps_their_rows():
    # a decode, the tree, a chain verify of 3, in one padded short group
    q_lens, ctx = [1, 1 + len(SMALL), 3], [9, 18, 14]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11]]
    q, k, v, cache = _tensors(sum(q_lens), seed=5)
    masks = [None, visibility(1, SMALL), None]
    got = _run(q, k, v, cache.clone(), q_lens, ctx, tables, masks)
    alone = _run(q, k, v, cache.clone(), q_lens, ctx, tables, None)  # no tree in the group
    torch.testing.assert_close(got[:1], alone[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[-3:], alone[-3:], rtol=1e-5, atol=1e-5)
    tq, tk, tv = (t[1:1 + q_lens[1]] for t in (q, k, v))
    for node in range(len(SMALL)):
        want = _chain_row(SMALL, node, tq, tk, tv, cache, ctx[1] - q_lens[1], tables[1])
        torch.testing.assert_close(got[2 + node], want, rtol=1e-5, atol=1e-5,
                                   msg=f"node {node}")
