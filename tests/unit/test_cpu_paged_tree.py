"""The in-place kernel's ancestor mask for token trees (docs/design.md §4c): against the eager
reference, and row invariance: a tree row gives the bits its own root path gives as a chain."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention import cpu_paged
from dynaspec.attention.backend import AttentionBatch, get_backend
from dynaspec.draft_tree import DraftTree
from dynaspec.worker.tree_step import visibility

from .. import kernel_modes
from .test_cpu_paged_attention import _case

ok, why = cpu_paged.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the kernel: {why}")

# root -> 0 -> {1, 2 -> 3}; root -> 4 -> 5 ; root -> 6
TREE = DraftTree((40, 41, 42, 43, 50, 51, 60), (-1, 0, 0, 2, -1, 4, -1))
BS = 16
# Each path natively where this CPU has its flags, emulated wherever it needs any.
PATH_MODES = kernel_modes.cases("attention", cpu_paged.PATHS)


def _forward(backend, q, k, v, cache, query_lens, ctx, tables, masks, window=None, **kw):
    batch = AttentionBatch(query_lens, ctx, tables, BS, torch.device("cpu"), tree_masks=masks)
    return backend.forward(q, k, v, cache, backend.build_metadata(batch), 0.125, window, **kw)


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


# Every path, since each sums a row its own way (avx512_bf16 with bf16 KV: value pairs, which
# pair keys by position, so a tree row must lay its path out as the chain does; a Zen 4 showed
# a tree row differing from its chain there while every AVX2 machine passed).
@pytest.mark.parametrize("path,mode", PATH_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c0", [37, 38])  # the path's first key at an odd and an even position
# Sliding windows (Gemma-3's local layers) count a tree row's keys in its path's chain positions:
# 8 reaches into the context; 2 is shorter than the deepest path, so it drops ancestors too.
@pytest.mark.parametrize("window", [None, 8, 2])
def test_a_tree_row_gives_the_bits_of_its_path_as_a_chain(path, mode, dtype, c0, window, request):
    kernel_modes.enter(request, "attention", path, mode)
    fast, n = get_backend("cpu_paged"), len(TREE)
    q_lens, ctx = [1 + n], [c0 + 1 + n]
    tables, q, k, v, cache = _case(q_lens, ctx, 2, 3, 64, dtype, seed=5, bs=BS)
    out = _forward(fast, q, k, v, cache.clone(), q_lens, ctx, tables,
                   [visibility(1, TREE)], window, path=path)  # [1 + n, H, D]
    for node in range(n):
        rows = [0] + [1 + p for p in TREE.path_to(node)]  # root, then the path's nodes
        w = len(rows)
        chain = _forward(fast, q[rows], k[rows], v[rows], cache.clone(), [w], [c0 + w], tables,
                         None, window, path=path)
        assert torch.equal(chain[-1], out[1 + node]), f"node {node}"


@pytest.mark.parametrize("window", [8, 2])
def test_windowed_tree_rows_match_the_eager_reference(window):
    q_lens, ctx = [1 + len(TREE), 1], [31 + len(TREE), 17]
    tables, q, k, v, cache = _case(q_lens, ctx, 2, 3, 64, torch.float32, seed=9, bs=BS)
    masks = [visibility(1, TREE), None]
    want = _forward(get_backend("eager"), q, k, v, cache.clone(), q_lens, ctx, tables, masks,
                    window)
    got = _forward(get_backend("cpu_paged"), q, k, v, cache.clone(), q_lens, ctx, tables, masks,
                   window)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    unwindowed = _forward(get_backend("cpu_paged"), q, k, v, cache.clone(), q_lens, ctx, tables,
                          masks)
    assert not torch.allclose(unwindowed, want, rtol=2e-5, atol=2e-5)  # the window matters


@pytest.mark.parametrize("path,mode", PATH_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_beside_a_tree_keeps_its_bits(path, mode, dtype, request):
    """A step with a tree in it must not change how the other requests' rows are summed."""
    kernel_modes.enter(request, "attention", path, mode)
    fast, n = get_backend("cpu_paged"), len(TREE)
    q_lens, ctx = [1 + n, 5], [30 + n, 21]
    tables, q, k, v, cache = _case(q_lens, ctx, 2, 3, 64, dtype, seed=7, bs=BS)
    both = _forward(fast, q, k, v, cache.clone(), q_lens, ctx, tables,
                    [visibility(1, TREE), None], path=path)
    alone = _forward(fast, q[1 + n:], k[1 + n:], v[1 + n:], cache.clone(), [5], [21],
                     tables[1:], None, path=path)
    assert torch.equal(both[1 + n:], alone)
