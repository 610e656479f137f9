"""The fused C++ small ops round exactly like the eager PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch

from dynaspec import cpu_kernels
from dynaspec.models.layers import FusedOps, RotaryCache, apply_rope, rms_norm, silu_and_mul

from ..kernel_modes import BUILD_MODES, run_build

ok, why = cpu_kernels.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the kernels: {why}")
DTYPES = [torch.bfloat16, torch.float32]


def _tol(dtype) -> dict:
    # bf16: bit-exact. fp32: the sum of squares is added in another order (last-bit differences).
    return dict(rtol=0, atol=0) if dtype != torch.float32 else dict(rtol=1e-6, atol=1e-5)


def _x(*shape, dtype, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("mode", BUILD_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_match_eager(dtype, mode):
    x, d, w = _x(7, 576, dtype=dtype), _x(7, 576, dtype=dtype, seed=1), _x(576, dtype=dtype, seed=2)

    def body():
        ops = FusedOps(enabled=True)
        return ops.rms_norm(x, w, 1e-5), *ops.add_rms_norm(x.clone(), d, w, 1e-5)

    # fp32: the sum of squares is an omp simd reduction, in the order of the build's vector width
    # (16 lanes natively on AVX-512, 4 in the emulated plain x86-64 build): held to _tol, not bits
    normed, new_x, h = run_build(mode, body, _tol(dtype) if dtype == torch.float32 else None)
    torch.testing.assert_close(normed, rms_norm(x, w, 1e-5), **_tol(dtype))
    ref_x = x + d
    torch.testing.assert_close(new_x, ref_x, rtol=0, atol=0)
    torch.testing.assert_close(h, rms_norm(ref_x, w, 1e-5), **_tol(dtype))


@pytest.mark.parametrize("mode", BUILD_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_eager(dtype, mode):
    gu = _x(5, 2 * 96, dtype=dtype, seed=3)
    got, ref = run_build(mode, lambda: FusedOps(enabled=True).silu_and_mul(gu)), silu_and_mul(gu)
    # exp differs from torch's vectorised one in the last bit at most; bf16 rounding hides it
    torch.testing.assert_close(
        got,
        ref,
        rtol=1e-6 if dtype == torch.float32 else 0,
        atol=1e-6 if dtype == torch.float32 else 1e-2,
    )


def _exp_vec(x: torch.Tensor) -> torch.Tensor:
    """vec_exp.h's exp_vec in fp32 torch ops, one IEEE rounding per C operation (the kernels
    build with -ffp-contract=off), so its bits are the kernels' bits on every path."""
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    x = x.clamp(-87.0, 88.0)
    n = torch.floor(x * f(1.44269504) + f(0.5))
    r = (x - n * f(0.693359375)) + n * f(2.12194440e-4)
    p = f(1.3981999507e-3)
    for c in (8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = ((p * r) * r + r) + f(1.0)
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return p * scale


@pytest.mark.parametrize("mode", BUILD_MODES)
@pytest.mark.parametrize("inter", [96, 100])  # 96: every vector width's path; 100: the scalar loop
def test_silu_mul_bf16_has_the_scalar_loops_bits(inter, mode):
    # silu(gate) rounded to bf16, times up, rounded: the 8- and 16-lane loops (chosen by the
    # build) must give the scalar loop's bits, which this rebuilds from its C operations.
    g = torch.Generator().manual_seed(inter)
    gu = (torch.randn(7, 2 * inter, generator=g) * torch.logspace(-2, 2, 7)[:, None]).bfloat16()
    gu[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 3.0, -3.0])
    gate, up = gu[:, :inter].float(), gu[:, inter:].float()
    silu = (gate / (1.0 + _exp_vec(-gate))).bfloat16().float()
    ref = (silu * up).bfloat16()
    got = run_build(mode, lambda: FusedOps(enabled=True).silu_and_mul(gu))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("mode", BUILD_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 64])  # 64: the 16-lane path (half a head a multiple of 16)
def test_rope_in_place_matches_eager(dtype, D, mode):
    T, H, Hkv = 6, 4, 2
    rope = RotaryCache(D, 10000.0, None, 64, torch.device("cpu"))
    cos, sin = rope.lookup(torch.tensor([0, 3, 7, 8, 30, 63]), dtype)
    qkv = _x(T, (H + 2 * Hkv) * D, dtype=dtype, seed=4)
    ref = apply_rope(qkv[:, : (H + Hkv) * D].reshape(T, H + Hkv, D), cos, sin)
    v_before = qkv[:, (H + Hkv) * D:].clone()

    def body():  # in place: each run on its own copy (an emulated one is repeated natively)
        c = qkv.clone()
        return FusedOps(enabled=True).rope_qk(c, cos, sin, H + Hkv, D), c

    got, qkv = run_build(mode, body)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(qkv[:, (H + Hkv) * D:], v_before, rtol=0, atol=0)  # v untouched


def test_kernels_release_the_gil():
    """A kernel call lets other Python threads run (the server's event loop answered /health
    ~90 s late behind a long prefill while the kernels held the GIL): a thread that stamps the
    time every millisecond keeps stamping during one long call (holding the GIL, the call froze
    it for most of its length)."""
    import threading
    import time

    ext = cpu_kernels.extension()
    x, w = _x(8192, 8192, dtype=torch.float32), torch.ones(8192)  # one call of ~0.1-0.5 s
    stamps, done = [], threading.Event()

    def stamp() -> None:
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=stamp)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    ext.rms_norm(x, w, 1e-6)
    t1 = time.perf_counter()
    done.set()
    th.join()
    # Holding the GIL, the first stamp after t0 came ~75% into the call (old kernels).
    edges = [t0, *[s for s in stamps if t0 < s < t1], t1]
    gap = max(b - a for a, b in zip(edges, edges[1:]))
    assert gap < (t1 - t0) / 2, (round(t1 - t0, 3), round(gap, 3))
