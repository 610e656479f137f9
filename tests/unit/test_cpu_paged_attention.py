"""The in-place CPU attention kernel against the eager backend on random paged layouts."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention import cpu_paged
from dynaspec.attention.backend import AttentionBatch, get_backend

ok, why = cpu_paged.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the kernel: {why}")

BS, NUM_BLOCKS = 4, 64


def _case(query_lens, ctx, hkv, g_heads, d, dtype, seed, bs=BS):
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # fragmented: blocks out of order
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    T = sum(query_lens)
    q = torch.randn(T, hkv * g_heads, d, generator=gen).to(dtype)
    k = torch.randn(T, hkv, d, generator=gen).to(dtype)
    v = torch.randn(T, hkv, d, generator=gen).to(dtype)
    cache = torch.randn(2, NUM_BLOCKS * bs, hkv, d, generator=gen).to(dtype)
    return tables, q, k, v, cache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens,ctx,hkv,g_heads,d", [
    ([1], [1], 1, 1, 8),  # a first token: its own key only
    ([1, 1, 1], [5, 17, 33], 2, 3, 64),  # plain decodes, ragged contexts
    ([3, 1, 9, 16], [3, 40, 12, 16], 3, 3, 64),  # mixed widths: kernel rows and wide verify rows
    ([2, 3], [9, 30], 2, 3, 64),  # verifies the kernel takes
    ([9], [40], 3, 3, 64),  # a batch-1 verify: its queries split in two tiles for the threads
    ([2, 20, 1], [7, 29, 50], 2, 2, 16),  # a prefill chunk (long path) between decodes
    ([1, 1, 3, 1, 2, 1], [9, 30, 17, 4, 22, 13], 3, 3, 64),  # a batch wider than the threads
])
def test_cpu_paged_matches_eager(query_lens, ctx, hkv, g_heads, d, dtype, tol):
    tables, q, k, v, cache = _case(query_lens, ctx, hkv, g_heads, d, dtype, seed=len(ctx) + d)
    batch = AttentionBatch(query_lens, ctx, tables, BS, torch.device("cpu"))
    eager, fast = get_backend("eager"), get_backend("cpu_paged")
    c1, c2 = cache.clone(), cache.clone()
    out1 = eager.forward(q, k, v, c1, eager.build_metadata(batch), d ** -0.5)
    out2 = fast.forward(q, k, v, c2, fast.build_metadata(batch), d ** -0.5)
    torch.testing.assert_close(out2.float(), out1.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(c2, c1, rtol=0, atol=0)  # the same slots written, nothing else


def test_cpu_paged_is_registered_and_supports_cpu_batches():
    fast = get_backend("cpu_paged")
    assert fast.supports(AttentionBatch([1], [3], [[0]], BS, torch.device("cpu")))


def _run(fast, q, k, v, cache, query_lens, ctx, tables, window=None, bs=BS):
    batch = AttentionBatch(query_lens, ctx, tables, bs, torch.device("cpu"))
    return fast.forward(q, k, v, cache, fast.build_metadata(batch), 0.125, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "bs,d,C", [(BS, 64, 37), (16, 64, 37), (16, 128, 37), (16, 64, 150), (16, 128, 150)]
)
def test_a_rows_result_does_not_depend_on_its_step(dtype, bs, d, C):
    """Row invariance: the same token attended in a C-token prefill chunk, a 5- or 33-token verify,
    alone, or beside other requests gives bit-identical output. With 16-slot blocks a row's keys
    come in full groups of 16 in one call and a partial group in another (the kernel's two score
    paths); its value sums run block by block (a decode's rows) or over chunks of 8 blocks (many
    rows: at C = 150 a row's keys cross a chunk), in groups of four rows or alone."""
    fast = get_backend("cpu_paged")
    hkv, g = 2, 3
    tables, q, k, v, cache = _case([C, 3], [C, 11], hkv, g, d, dtype, seed=7, bs=bs)
    cache0 = cache.clone()
    # One prefill of all C tokens of request 0 (2 or 5 tiles of 32) beside a 3-token request.
    full = _run(fast, q, k, v, cache, [C, 3], [C, 11], tables, bs=bs)[:C]
    for width in (1, 2, 5, 16, 33):
        for end in range(width, C + 1, 7):  # the last `width` tokens up to position end-1
            c = cache0.clone()
            _run(fast, q[:C], k[:C], v[:C], c, [C], [C], tables[:1], bs=bs)  # KV of the prompt
            rows = slice(end - width, end)
            got = _run(fast, q[rows], k[rows], v[rows], c, [width], [end], tables[:1], bs=bs)
            assert torch.equal(got, full[rows]), (width, end)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wide_decode_batch_gives_each_row_what_it_gets_alone(dtype):
    """A decode/verify batch wider than the threads (each thread a contiguous range of
    (request, KV head) items) gives each row the bits the same request's step alone gives (its
    queries then split in two tiles for the threads)."""
    fast = get_backend("cpu_paged")
    widths, ctx = [1, 1, 3, 1, 2, 1, 1, 4], [37, 5, 60, 16, 23, 41, 9, 30]
    tables, q, k, v, cache = _case(widths, ctx, 3, 3, 64, dtype, seed=11, bs=16)
    out = _run(fast, q, k, v, cache.clone(), widths, ctx, tables, bs=16)
    start = 0
    for w, c, table in zip(widths, ctx, tables):
        rows = slice(start, start + w)
        alone = _run(fast, q[rows], k[rows], v[rows], cache.clone(), [w], [c], [table], bs=16)
        assert torch.equal(out[rows], alone), (w, c)
        start += w


def test_sliding_window_matches_a_masked_reference():
    fast = get_backend("cpu_paged")
    C, hkv, g, d, window = 30, 1, 2, 16, 8
    tables, q, k, v, cache = _case([C], [C], hkv, g, d, torch.float32, seed=3)
    out = _run(fast, q, k, v, cache, [C], [C], tables, window=window)
    pos = torch.arange(C)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [C, C]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [C, H, D]
    s = torch.einsum("qhd,khd->hqk", q, kk) * 0.125
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", p, vv)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(
        out, _run(fast, q, k, v, cache.clone(), [C], [C], tables)
    )  # the window matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_read_in_place_from_the_fused_qkv_rows(dtype):
    """The layer stack hands the kernel q as a view of the qkv rows (tokens strided by the fused
    width, each token's heads contiguous): the same bits as a contiguous copy. Heads that are not
    contiguous within a token are refused by name."""
    from dynaspec import cpu_kernels

    op = cpu_kernels.extension().paged_decode
    widths, ctx, hkv, g, d, bs = [20, 1, 3], [29, 50, 7], 3, 3, 64, 16
    tables, q, _, _, cache = _case(widths, ctx, hkv, g, d, dtype, seed=5, bs=bs)
    T, H = q.shape[0], hkv * g
    qkv = torch.randn(T, (H + 2 * hkv) * d, generator=torch.Generator().manual_seed(6)).to(dtype)
    qkv[:, : H * d] = q.reshape(T, H * d)
    view = qkv.narrow(1, 0, H * d).view(T, H, d)
    assert not view.is_contiguous()
    nb = max(len(t) for t in tables)
    meta = (torch.tensor([t + [0] * (nb - len(t)) for t in tables]), torch.tensor(ctx),
            torch.tensor([0, 20, 21]), torch.tensor(widths))
    out_view, out_copy = torch.empty_like(q), torch.empty_like(q)
    op(view, cache, *meta, bs, d ** -0.5, out_view)
    op(q.contiguous(), cache, *meta, bs, d ** -0.5, out_copy)
    assert torch.equal(out_view, out_copy)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        op(q.transpose(0, 1).contiguous().transpose(0, 1), cache, *meta, bs, d ** -0.5, out_copy)


@pytest.mark.parametrize("d", [64, 128])
def test_slots_past_the_context_never_reach_a_row(d):
    """The bf16 value sums take keys two at a time, so a context of odd length pairs its last key
    with a slot nobody has written yet (stale KV of a freed block, or anything): NaN there leaves
    every output as it is."""
    fast = get_backend("cpu_paged")
    # Odd contexts: each one's last key pairs with an unwritten slot.
    widths, ctx, bs = [1, 3, 21, 1], [7, 13, 21, 31], 16
    tables, q, k, v, cache = _case(widths, ctx, 3, 3, d, torch.bfloat16, seed=13, bs=bs)
    clean = _run(fast, q, k, v, cache.clone(), widths, ctx, tables, bs=bs)
    dirty = cache.clone()
    for c, table in zip(ctx, tables):
        for pos in range(c, len(table) * bs):  # the unwritten tail of the last block
            dirty[:, table[pos // bs] * bs + pos % bs] = float("nan")
    out = _run(fast, q, k, v, dirty, widths, ctx, tables, bs=bs)
    assert not out.isnan().any()
    assert torch.equal(out, clean)
