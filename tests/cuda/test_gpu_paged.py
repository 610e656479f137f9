"""The GPU paged backend (Triton kernel) against the eager reference: decode, verify, mixed
prefill, sliding windows, fixed-shape (graph) metadata, and row invariance.

On a GPU it runs the compiled kernel; on the CPU the same kernel under TRITON_INTERPRET=1 (set
here before the kernel module is imported), skipped with the reason where Triton is absent."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (the GPU image has it)")

from dynaspec.attention.backend import AttentionBatch, MetadataBuffers  # noqa: E402
from dynaspec.attention.gpu_paged import GpuPagedBackend  # noqa: E402
from dynaspec.attention.paged import EagerPagedBackend  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS, HKV, G, D = 4, 2, 3, 16
NUM_BLOCKS = 64  # + 1 scratch block


def _case(qlens: list[int], ctx: list[int], seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // BS))] for c in ctx]
    T = sum(qlens)

    def r(*s):
        return torch.randn(*s, generator=g).to(DEV, dtype)

    return tables, r(T, HKV * G, D), r(T, HKV, D), r(T, HKV, D), r(2, (NUM_BLOCKS + 1) * BS, HKV, D)


def _both(qlens, ctx, seed, window=None):
    tables, q, k, v, cache = _case(qlens, ctx, seed)
    b = AttentionBatch(qlens, ctx, tables, BS, DEV)
    ref_c, got_c = cache.clone(), cache.clone()
    eager, gpu = EagerPagedBackend(), GpuPagedBackend()
    ref = eager.forward(q, k, v, ref_c, eager.build_metadata(b), 0.25, window)
    got = gpu.forward(q, k, v, got_c, gpu.build_metadata(b), 0.25, window)
    return ref, got, ref_c, got_c


@pytest.mark.parametrize("qlens,ctx,window", [
    ([1, 1, 1], [5, 17, 30], None),  # decode
    ([5, 5], [9, 23], None),  # verify, causal inside the span
    ([3, 40, 1, 2], [3, 70, 12, 66], None),  # mixed: a fresh prefill, a chunk, decode, verify
    ([1, 4, 25], [50, 44, 90], 7),  # sliding window
])
def test_matches_eager(qlens, ctx, window):
    ref, got, ref_c, got_c = _both(qlens, ctx, seed=sum(ctx), window=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_c, ref_c, rtol=0, atol=0)  # the same slots written


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical on the GPU. The CPU interpreter's dot is numpy's BLAS, whose rounding may
    depend on where a row sits in the tile; there only ulp-level agreement is checkable."""
    if DEV.type == "cuda":
        assert torch.equal(a, b), (a - b).abs().max()
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_row_invariant_across_width_and_batch():
    """A row's output is bit-identical whether it is decoded alone, verified in a span, or
    batched with other requests."""
    tables, q, k, v, cache = _case([4, 1], [60, 33], seed=3)
    gpu = GpuPagedBackend()
    span = gpu.forward(q, k, v, cache.clone(), gpu.build_metadata(
        AttentionBatch([4, 1], [60, 33], tables, BS, DEV)), 0.25)
    c = cache.clone()  # the span's first three tokens written, then its last one decoded alone
    gpu.forward(q[:3], k[:3], v[:3], c, gpu.build_metadata(
        AttentionBatch([3], [59], tables[:1], BS, DEV)), 0.25)
    alone = gpu.forward(q[3:4], k[3:4], v[3:4], c, gpu.build_metadata(
        AttentionBatch([1], [60], tables[:1], BS, DEV)), 0.25)
    _same(alone[0], span[3])
    other = gpu.forward(q[4:], k[4:], v[4:], cache.clone(), gpu.build_metadata(
        AttentionBatch([1], [33], tables[1:], BS, DEV)), 0.25)
    _same(other[0], span[4])


def test_fixed_shape_metadata_matches_ragged():
    """The graph path's metadata (persistent buffers, pad rows on the scratch block) gives the
    real rows the ragged result; pad rows stay finite and touch only the scratch block."""
    W, n, B = 3, 2, 4
    ctx = [20, 9]
    tables, q, k, v, cache = _case([W] * B, ctx + [W, W], seed=5)
    tables = tables[:n]
    bufs = MetadataBuffers.allocate(8, 32, 8 * W, NUM_BLOCKS, DEV)
    bufs.block_tables.fill_(7)  # stale columns from an earlier step: never read
    gpu = GpuPagedBackend()
    ref_c, got_c = cache.clone(), cache.clone()
    ref = gpu.forward(q[: n * W], k[: n * W], v[: n * W], ref_c, gpu.build_metadata(
        AttentionBatch([W] * n, ctx, tables, BS, DEV)), 0.25)
    md = gpu.build_metadata(AttentionBatch([W] * n, ctx, tables, BS, DEV, B, W, bufs))
    got = gpu.forward(q, k, v, got_c, md, 0.25)
    assert torch.equal(got[: n * W], ref)
    assert torch.isfinite(got).all()
    real = torch.ones(got_c.shape[1], dtype=torch.bool)
    real[NUM_BLOCKS * BS:] = False
    assert torch.equal(got_c[:, real], ref_c[:, real])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton needs a GPU")
def test_bf16_close_to_eager():
    tables, q, k, v, cache = _case([1, 5, 30], [40, 45, 30], 9, torch.bfloat16)
    b = AttentionBatch([1, 5, 30], [40, 45, 30], tables, BS, DEV)
    eager, gpu = EagerPagedBackend(), GpuPagedBackend()
    ref = eager.forward(q, k, v, cache.clone(), eager.build_metadata(b), 0.25).float()
    got = gpu.forward(q, k, v, cache.clone(), gpu.build_metadata(b), 0.25).float()
    assert (got - ref).norm() / ref.norm() < 1e-2
