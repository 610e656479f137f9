"""The attention seam: every backend computes the same attention and writes the same KV slots."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention.backend import AttentionBatch, MetadataBuffers, backend_names, get_backend

BS, HKV, G, D = 4, 2, 3, 8
NUM_BLOCKS = 24  # + 1 scratch block at index NUM_BLOCKS


def _case(ctx: list[int], width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tables, free = [], list(torch.randperm(NUM_BLOCKS, generator=g).tolist())
    for c in ctx:
        n = -(-c // BS)
        tables.append([free.pop() for _ in range(n)])
    T = len(ctx) * width
    q = torch.randn(T, HKV * G, D, generator=g)
    k = torch.randn(T, HKV, D, generator=g)
    v = torch.randn(T, HKV, D, generator=g)
    cache = torch.randn(2, (NUM_BLOCKS + 1) * BS, HKV, D, generator=g)
    return tables, q, k, v, cache


@pytest.mark.parametrize("ctx,width,padded", [([5, 9, 13], 4, 4), ([1, 7], 1, 2), ([16], 3, 1),
                                              ([3, 4, 21, 8, 2], 2, 8)])
def test_uniform_matches_eager(ctx, width, padded):
    ctx = [max(c, width) for c in ctx]
    tables, q, k, v, cache = _case(ctx, width)
    eager, uni = get_backend("eager"), get_backend("uniform")
    bufs = MetadataBuffers.allocate(8, 8, 8 * width, NUM_BLOCKS, torch.device("cpu"))
    base = dict(query_lens=[width] * len(ctx), context_lens=ctx, block_tables=tables,
                block_size=BS, device=torch.device("cpu"))
    c1, c2 = cache.clone(), cache.clone()
    out1 = eager.forward(q, k, v, c1, eager.build_metadata(AttentionBatch(**base)), 0.3)
    batch = AttentionBatch(**base, num_reqs_padded=padded, width=width, buffers=bufs)
    assert uni.supports(batch)
    T_pad = padded * width
    qp = torch.cat([q, torch.randn(T_pad - q.shape[0], *q.shape[1:])])
    kp = torch.cat([k, torch.randn(T_pad - k.shape[0], *k.shape[1:])])
    vp = torch.cat([v, torch.randn(T_pad - v.shape[0], *v.shape[1:])])
    out2 = uni.forward(qp, kp, vp, c2, uni.build_metadata(batch), 0.3)
    torch.testing.assert_close(out2[: q.shape[0]], out1, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out2).all(), "padded rows must stay finite"
    real = torch.ones(c1.shape[1], dtype=torch.bool)
    real[NUM_BLOCKS * BS:] = False  # only the scratch block may differ (padded rows' writes)
    torch.testing.assert_close(c2[:, real], c1[:, real], rtol=0, atol=0)


def test_uniform_refuses_ragged_batch():
    uni = get_backend("uniform")
    bufs = MetadataBuffers.allocate(4, 4, 16, NUM_BLOCKS, torch.device("cpu"))
    batch = AttentionBatch([2, 1], [5, 5], [[0, 1], [2, 3]], BS, torch.device("cpu"), 2, 2, bufs)
    assert not uni.supports(batch)
    with pytest.raises(ValueError, match="fixed-shape"):
        uni.build_metadata(batch)


def test_registry_names_and_unknown_backend():
    assert {"eager", "uniform"} <= set(backend_names())
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")
