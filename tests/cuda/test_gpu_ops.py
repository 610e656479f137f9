"""The CUDA small-op kernels (models/gpu_ops.py) against the eager ops they replace; on the CPU
under TRITON_INTERPRET=1, skipped where Triton is absent."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the GPU image has it)")

from dynaspec.models.gpu_ops import TritonFusedOps  # noqa: E402
from dynaspec.models.layers import apply_rope, rms_norm, silu_and_mul  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _r(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV)


def test_rms_and_add_rms():
    ops = TritonFusedOps()
    x, d, w = _r(5, 48, seed=1), _r(5, 48, seed=2), _r(48, seed=3)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    s, h = ops.add_rms_norm(x, d, w, 1e-5)
    torch.testing.assert_close(s, x + d)
    torch.testing.assert_close(h, rms_norm(x + d, w, 1e-5))


def test_rope_qk_reads_q_and_k_of_qkv():
    ops = TritonFusedOps()
    T, H, Hkv, D = 3, 4, 2, 16
    qkv = _r(T, (H + 2 * Hkv) * D, seed=4)
    cos, sin = _r(T, 1, D // 2, seed=5), _r(T, 1, D // 2, seed=6)
    got = ops.rope_qk(qkv, cos, sin, H + Hkv, D)
    want = apply_rope(qkv[:, : (H + Hkv) * D].reshape(T, H + Hkv, D), cos, sin)
    torch.testing.assert_close(got, want)


def test_silu_and_mul():
    ops = TritonFusedOps()
    x = _r(4, 2 * 1100, seed=7)  # more than one 1024-wide block per row
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul(x), rtol=1e-5, atol=1e-5)
