"""Sliding-window attention (Gemma-3's local layers) on the paged backends: a query at position p
sees keys max(0, p - window + 1)..p, checked against a naive per-request reference, for prefill
chunks (first and later), decodes and verifies in one mixed batch."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention.backend import AttentionBatch, MetadataBuffers, get_backend

BS, HKV, G, D = 4, 2, 2, 8
NUM_BLOCKS = 40
CPU = torch.device("cpu")


def _reference(q, cache, tables, qlens, ctx, window, scale):
    """Per request, per query: softmax over the visible slots of its own context."""
    out, t = torch.empty_like(q), 0
    for table, ql, c in zip(tables, qlens, ctx):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(c)])
        keys, vals = cache[0][slots], cache[1][slots]  # [c, Hkv, D]
        for j in range(ql):
            p = c - ql + j
            lo = 0 if window is None else max(0, p - window + 1)
            kk = keys[lo:p + 1].repeat_interleave(G, dim=1)  # [n, H, D]
            vv = vals[lo:p + 1].repeat_interleave(G, dim=1)
            att = torch.softmax(torch.einsum("hd,nhd->hn", q[t + j], kk) * scale, dim=-1)
            out[t + j] = torch.einsum("hn,nhd->hd", att, vv)
        t += ql
    return out


def _case(qlens, ctx, seed):
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // BS))] for c in ctx]
    T = sum(qlens)
    return (
        tables,
        torch.randn(T, HKV * G, D, generator=g),
        torch.randn(T, HKV, D, generator=g),
        torch.randn(T, HKV, D, generator=g),
        torch.randn(2, (NUM_BLOCKS + 1) * BS, HKV, D, generator=g),
    )


def _written(cache, k, v, tables, qlens, ctx):
    """The cache after the step's own K/V are written (what the reference reads)."""
    cache, t = cache.clone(), 0
    for table, ql, c in zip(tables, qlens, ctx):
        for j in range(ql):
            p = c - ql + j
            s = table[p // BS] * BS + p % BS
            cache[0, s], cache[1, s] = k[t + j], v[t + j]
        t += ql
    return cache


@pytest.mark.parametrize("window", [None, 1, 3, 6, 64])
def test_eager_window_matches_reference_on_a_mixed_batch(window):
    # a first prefill chunk (query = context), a later chunk, a decode, two verifies
    qlens, ctx = [20, 18, 1, 5, 3], [20, 30, 13, 11, 3]
    tables, q, k, v, cache = _case(qlens, ctx, seed=1)
    ref = _reference(q, _written(cache, k, v, tables, qlens, ctx), tables, qlens, ctx, window, 0.4)
    eager = get_backend("eager")
    md = eager.build_metadata(AttentionBatch(qlens, ctx, tables, BS, CPU))
    for _ in range(2):  # the second call reuses the masks the first one built
        out = eager.forward(q, k, v, cache.clone(), md, 0.4, window=window)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 2, 5])
def test_uniform_window_matches_reference(window):
    width, ctx = 3, [5, 12, 9]
    qlens = [width] * len(ctx)
    tables, q, k, v, cache = _case(qlens, ctx, seed=2)
    ref = _reference(q, _written(cache, k, v, tables, qlens, ctx), tables, qlens, ctx, window, 0.4)
    uni = get_backend("uniform")
    bufs = MetadataBuffers.allocate(4, 8, 4 * width, NUM_BLOCKS, CPU)
    batch = AttentionBatch(
        qlens, ctx, tables, BS, CPU, num_reqs_padded=4, width=width, buffers=bufs
    )
    pad = lambda x: torch.cat([x, torch.zeros(width, *x.shape[1:])])  # noqa: E731
    out = uni.forward(
        pad(q), pad(k), pad(v), cache.clone(), uni.build_metadata(batch), 0.4, window=window
    )
    torch.testing.assert_close(out[: q.shape[0]], ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def test_window_changes_the_result_when_context_exceeds_it():
    # Guards the test itself: with context > window the windowed output must differ.
    qlens, ctx = [1], [12]
    tables, q, k, v, cache = _case(qlens, ctx, seed=3)
    eager = get_backend("eager")
    md = eager.build_metadata(AttentionBatch(qlens, ctx, tables, BS, CPU))
    full = eager.forward(q, k, v, cache.clone(), md, 0.4)
    local = eager.forward(q, k, v, cache.clone(), md, 0.4, window=4)
    assert (full - local).abs().max() > 1e-3
