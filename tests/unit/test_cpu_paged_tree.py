"""The in-place kernel's ancestor mask for token trees (docs/design.md §4c): against the eager
reference, and row invariance: a tree row gives the bits its own root path gives as a chain."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention import cpu_paged
from dynaspec.attention.backend import AttentionBatch, get_backend
from dynaspec.draft_tree import DraftTree
from dynaspec.worker.tree_step import visibility

from .test_cpu_paged_attention import _case

ok, why = cpu_paged.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the kernel: {why}")

# root -> 0 -> {1, 2 -> 3}; root -> 4 -> 5 ; root -> 6
TREE = DraftTree((40, 41, 42, 43, 50, 51, 60), (-1, 0, 0, 2, -1, 4, -1))
BS = 16


def _forward(backend, q, k, v, cache, query_lens, ctx, tables, masks):
    batch = AttentionBatch(query_lens, ctx, tables, BS, torch.device("cpu"), tree_masks=masks)
    return backend.forward(q, k, v, cache, backend.build_metadata(batch), 0.125)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_tree_rows_match_the_eager_reference(dtype, tol):
    # a tree verify, a plain decode, a chain verify, a second tree (1 + 8 nodes: two tiles)
    big = DraftTree(tuple(range(8)), (-1, 0, 0, -1, 3, 4, 3, -1))
    q_lens, ctx = [8, 1, 4, 9], [30, 17, 21, 40]
    masks = [visibility(1, TREE), None, None, visibility(1, big)]
    tables, q, k, v, cache = _case(q_lens, ctx, 2, 3, 64, dtype, seed=3, bs=BS)
    eager, fast = get_backend("eager"), get_backend("cpu_paged")
    c1, c2 = cache.clone(), cache.clone()
    want = _forward(eager, q, k, v, c1, q_lens, ctx, tables, masks)
    got = _forward(fast, q, k, v, c2, q_lens, ctx, tables, masks)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(c2, c1, rtol=0, atol=0)
    # the mask matters: without it the tree's rows differ
    plain = _forward(fast, q, k, v, cache.clone(), q_lens, ctx, tables, None)
    assert not torch.allclose(plain[:8].float(), want[:8].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_row_gives_the_bits_of_its_path_as_a_chain(dtype):
    fast = get_backend("cpu_paged")
    c0, n = 37, len(TREE)
    q_lens, ctx = [1 + n], [c0 + 1 + n]
    tables, q, k, v, cache = _case(q_lens, ctx, 2, 3, 64, dtype, seed=5, bs=BS)
    out = _forward(fast, q, k, v, cache.clone(), q_lens, ctx, tables,
                   [visibility(1, TREE)])  # [1 + n, H, D]
    for node in range(n):
        rows = [0] + [1 + p for p in TREE.path_to(node)]  # root, then the path's nodes
        w = len(rows)
        chain = _forward(fast, q[rows], k[rows], v[rows], cache.clone(), [w], [c0 + w], tables,
                         None)
        assert torch.equal(chain[-1], out[1 + node]), f"node {node}"
