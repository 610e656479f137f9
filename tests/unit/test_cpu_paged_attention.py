"""The in-place CPU attention kernel against the eager backend on random paged layouts."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention import cpu_paged
from dynaspec.attention.backend import AttentionBatch, get_backend

ok, why = cpu_paged.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the kernel: {why}")

BS, NUM_BLOCKS = 4, 64


def _case(query_lens, ctx, hkv, g_heads, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # fragmented: blocks out of order
    tables = [[free.pop() for _ in range(-(-c // BS))] for c in ctx]
    T = sum(query_lens)
    q = torch.randn(T, hkv * g_heads, d, generator=gen).to(dtype)
    k = torch.randn(T, hkv, d, generator=gen).to(dtype)
    v = torch.randn(T, hkv, d, generator=gen).to(dtype)
    cache = torch.randn(2, NUM_BLOCKS * BS, hkv, d, generator=gen).to(dtype)
    return tables, q, k, v, cache


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens,ctx,hkv,g_heads,d", [
    ([1], [1], 1, 1, 8),  # a first token: its own key only
    ([1, 1, 1], [5, 17, 33], 2, 3, 64),  # plain decodes, ragged contexts
    ([3, 1, 9, 16], [3, 40, 12, 16], 3, 3, 64),  # mixed widths: kernel rows and wide verify rows
    ([2, 3], [9, 30], 2, 3, 64),  # verifies the kernel takes
    ([2, 20, 1], [7, 29, 50], 2, 2, 16),  # a prefill chunk (long path) between decodes
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
