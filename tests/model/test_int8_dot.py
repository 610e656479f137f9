"""The int8 dot-product linear kernel: exact against its scalar reference on every ISA path,
row-invariant, and close to the dequantized weights."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dynaspec import cpu_features, cpu_kernels
from dynaspec.models import int8_dot
from dynaspec.models.int8_dot import (
    Int8DotHead,
    Int8DotLinear,
    activation_residual,
    quantize_grouped_int8,
)
from dynaspec.models.layers import FusedOps
from dynaspec.models.quant import QuantizedTensor, quantize_int4

from .. import kernel_modes

pytestmark = pytest.mark.skipif(
    int8_dot.kernel_isa() == "unavailable", reason="the C++ kernels are not built"
)
# Every vector path, natively where this CPU has every flag it needs (forcing one it lacks
# raised SIGILL on Zen 4, avx_vnni there) and emulated everywhere (tests/kernel_modes.py).
VECTOR_PATHS = [p.name for p in cpu_features.KERNELS["int8_gemm"] if p.name != "scalar"]
PATH_MODES = kernel_modes.cases("int8_gemm", VECTOR_PATHS)


def _against_scalar(w: QuantizedTensor, x: torch.Tensor, path: str, mode: str):
    """(path's output, the scalar reference's) for x @ w^T, with `mode`'s kernels."""
    def body():
        lin = Int8DotLinear(w, None)  # binds the serving module's op
        return lin(x, path=path), lin(x, path="scalar")

    return kernel_modes.run("int8_gemm", path, mode, body)


def _weights(kind: str, n: int, k: int, seed: int) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == "q4":
        return quantize_int4(w)
    group = 16 if kind == "q8g16" else 32
    q = quantize_grouped_int8(w, group)
    if kind == "q8zero":  # Q5_x-style: a float minimum per group
        q = QuantizedTensor("q8", q.q, q.scale, torch.randn(n, k // 32, generator=g) * 0.01, 32)
    return q


@pytest.mark.parametrize("path,mode", PATH_MODES)
@pytest.mark.parametrize("kind", ["q4", "q8", "q8g16", "q8zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_path_equals_the_scalar_reference_bit_for_bit(kind, dtype, path, mode):
    w = _weights(kind, 80, 192, seed=1)
    x = torch.randn(21, 192, generator=torch.Generator().manual_seed(2)).to(dtype)
    got, ref = _against_scalar(w, x, path, mode)
    assert torch.equal(got, ref)
    exact = x.float() @ w.dequantize().t()
    rel = ((ref.float() - exact).abs().max() / exact.abs().max()).item()
    assert rel < 0.03, rel  # int8 activations: ~0.5-1.5% of the largest output here


@pytest.mark.parametrize("kind", ["q4", "q8g16"])
def test_activation_blocks_at_their_edges_quantize_as_the_reference(kind):
    # Register blocks of 1..12 rows take the row-by-row quantizer or the one with rows in the
    # vector lanes; both must write the scalar reference's bytes, scales and sums, on blocks
    # that are all zero, hold one value, sit on rounding halves, or are bf16 subnormals.
    w = _weights(kind, 32, 128, seed=11)
    lin = Int8DotLinear(w, None)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(40, 128, generator=g) * torch.logspace(-3, 3, 40)[:, None]
    x[3] = 0.0
    x[5, :32] = 0.0
    x[7] = 0.0
    x[7, 40] = -2.5
    x[11] = torch.arange(128) % 32 - 15.5  # q = v * 127 / 16.5: several land on .5 after scaling
    x[17] = torch.randint(-3, 4, (128,), generator=g) * 1e-39  # subnormal in bf16
    x[23, 64:96] = -1e30
    x = x.to(torch.bfloat16)
    for m in range(1, 26):
        part = x[m: 2 * m + 1]
        assert torch.equal(lin(part), lin(part, path="scalar")), m


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_rows_do_not_depend_on_how_many_share_the_call(kind):
    w = _weights(kind, 96, 256, seed=3)
    lin = Int8DotLinear(w, None)
    x = torch.randn(200, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    full = lin(x)  # row chunks of 96, 96 and 8; register blocks of 12, then one of 8
    for m in (1, 2, 3, 5, 9, 12, 13, 16):
        for start in (0, 7, 61, 190):
            part = x[start: start + m]
            assert torch.equal(lin(part), full[start: start + len(part)]), (m, start)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(5))
    assert torch.equal(lin(x[perm]), full[perm])  # order in the batch changes nothing either


def test_bf16_outputs_round_as_the_scalar_reference_down_to_subnormals():
    # The vector stores round through vcvtneps2bf16 where the CPU has it, which takes subnormal
    # inputs as zero: outputs down to ~1e-38 must still get the scalar reference's bits.
    g = torch.Generator().manual_seed(32)
    lin = Int8DotLinear(quantize_int4(torch.randn(64, 128, generator=g) * 1e-4), None)
    x = torch.randn(24, 128, generator=g) * torch.logspace(-35, 2, 24)[:, None]
    x[9] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref, got = lin(xd, path="scalar"), lin(xd)
        if dtype == torch.bfloat16:
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
            tiny = got.float().abs() < 1.18e-38
            assert (tiny & (got != 0)).any()  # subnormal outputs were stored
        else:
            assert torch.equal(got, ref)
        fused, composed = lin.silu_mul(xd), FusedOps(enabled=True).silu_and_mul(lin(xd))
        assert torch.equal(fused, composed)


@pytest.mark.parametrize("threads", [2, 3])
def test_workers_taking_each_others_tiles_give_every_tile_once(threads):
    # 20 tiles (10 SwiGLU output tiles) split into ranges per worker; from 12 rows up a worker
    # that finishes takes the others' (chunk, tile) units. Rows alone (one row: own ranges only)
    # must match the batch, and every tile must be there (the dequantized product bounds it).
    w = _weights("q4", 320, 256, seed=21)
    lin = Int8DotLinear(w, None)
    x = torch.randn(200, 256, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full, fused = lin(x), lin.silu_mul(x)
        for r in (0, 95, 96, 199):
            assert torch.equal(lin(x[r: r + 1]), full[r: r + 1]), r
            assert torch.equal(lin.silu_mul(x[r: r + 1]), fused[r: r + 1]), r
        assert torch.equal(fused, FusedOps(enabled=True).silu_and_mul(full))
    finally:
        torch.set_num_threads(before)
    exact = x.float() @ w.dequantize().t()
    assert ((full.float() - exact).abs().max() / exact.abs().max()).item() < 0.03


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_up_silu_gives_the_bits_of_the_gemm_then_silu_mul(kind, dtype):
    # 3 tile pairs (gate tiles 0-2, up tiles 3-5); rows across register blocks and row chunks.
    w = _weights(kind, 96, 128, seed=13)
    lin = Int8DotLinear(w, None)
    x = (torch.randn(200, 128, generator=torch.Generator().manual_seed(14)) * 3).to(dtype)
    x[7] = 0.0  # silu(0) * up: exact zeros
    ops = FusedOps(enabled=True)
    for m in (1, 5, 12, 13, 96, 200):
        got = lin.silu_mul(x[:m])
        assert got.shape == (m, 48) and got.dtype == dtype
        assert torch.equal(got, ops.silu_and_mul(lin(x[:m]))), m


def test_fused_gate_up_silu_names_what_it_cannot_take():
    w = _weights("q4", 32, 64, seed=15)
    with pytest.raises(ValueError, match="with a bias is not supported"):
        Int8DotLinear(w, torch.zeros(32)).silu_mul(torch.randn(2, 64))
    lin = Int8DotLinear(w, None)
    with pytest.raises(RuntimeError, match="N must stack gate and up rows"):
        int8_dot._ext().int8_gemm_silu(torch.randn(2, 64), lin.packed, lin.scales, lin.mins, 31,
                                       lin.group_size, lin.bits)


def test_q4_1_minimum_is_recovered_exactly_and_bias_added():
    w = _weights("q4", 32, 64, seed=6)
    packed, scales, mins, bits = int8_dot.pack(w)
    assert bits == 4 and packed.numel() == 32 * 64 // 2
    # The kernel's minimum term is zero - 8 * scale: the Q4_1 "m" behind torch's zero point.
    m = (w.zero.double() - 8 * w.scale.double()).float()
    assert torch.equal(mins, m.reshape(2, 16, 2).permute(0, 2, 1))
    bias = torch.randn(32)
    x = torch.randn(3, 64)
    assert torch.equal(Int8DotLinear(w, bias)(x), Int8DotLinear(w, None)(x) + bias)


def test_shapes_the_kernel_cannot_take_are_reported():
    assert not int8_dot.supports(quantize_int4(torch.randn(24, 64)))  # N not a multiple of 16
    assert int8_dot.supports(quantize_int4(torch.randn(32, 64)))


def test_two_part_head_recovers_what_int8_activations_lose_and_keeps_rows_invariant():
    w = _weights("q4", 96, 256, seed=8)
    lin = Int8DotLinear(w, None)
    head = Int8DotHead(lin)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    exact = x.float() @ w.dequantize().t()  # the weights as stored, activations unrounded
    one, two = lin(x).float(), head(x)
    assert two.dtype == torch.float32
    err1, err2 = (one - exact).abs().max().item(), (two - exact).abs().max().item()
    assert err2 < 0.1 * err1, (err1, err2)  # a mis-replayed quantization would not shrink it
    for i in range(9):
        assert torch.equal(head(x[i:i + 1]), two[i:i + 1])  # a row alone: the same bits
    xf, rest = activation_residual(x)
    assert torch.equal(xf, x.float()) and rest.abs().max() <= xf.abs().max() / 254 + 1e-6


def test_argmax_only_rows_get_the_exact_argmax_and_stay_row_invariant():
    """Rows read only for their argmax skip the second activation part: their logits near the
    maximum are recomputed exactly, so the argmax is the exact matrix's; the other rows keep the
    two-part logits bit for bit; every row's result is the same alone or in any mix."""
    w = _weights("q8", 4096, 256, seed=11)
    head = Int8DotHead(Int8DotLinear(w, None, keep_source=True))
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(12, 256, generator=g) * 3).to(torch.bfloat16)
    exact = x.double() @ w.dequantize().double().t()  # [12, 4096]
    flags = torch.tensor([True, False] * 6)
    got, two = head(x, flags), head(x)
    assert torch.equal(got[~flags], two[~flags])  # full rows: the two-part logits unchanged
    assert torch.equal(got[flags].argmax(-1), exact[flags].argmax(-1))
    top = exact[flags].argmax(-1)
    assert torch.equal(got[flags].gather(1, top[:, None]).squeeze(1),
                       exact[flags].gather(1, top[:, None]).squeeze(1).float())
    for i in range(12):  # alone, and beside rows of the other kind
        alone = head(x[i:i + 1], flags[i:i + 1])
        assert torch.equal(alone, got[i:i + 1]), i
    mixed = head(x.flip(0), flags.flip(0)).flip(0)
    assert torch.equal(mixed, got)
    no_source = Int8DotHead(Int8DotLinear(w, None))  # untied: nothing to recompute from
    assert torch.equal(no_source(x, flags), two)


def test_exact_near_max_names_what_does_not_fit():
    w = _weights("q8", 64, 64, seed=13)
    logits, x, row = torch.zeros(2, 64), torch.zeros(2, 64), torch.tensor([0])
    op = int8_dot._ext().exact_near_max
    with pytest.raises(RuntimeError, match="exact_near_max: shapes disagree"):
        op(logits, row, x, w.q, w.scale[:, :1].contiguous(), 32, 1.0)
    with pytest.raises(RuntimeError, match="exact_near_max: contiguous float32"):
        op(logits.double(), row, x, w.q, w.scale, 32, 1.0)


def _fp16_exact(kind: str) -> QuantizedTensor:
    """GGUF-like groups: every scale (and minimum) an fp16 value, as Q4_0/Q4_1/Q8_0 store them."""
    w = _weights("q8zero" if kind == "q8zero" else kind, 64, 128, seed=8)
    d = w.scale.half().float()
    if kind == "q4":  # Q4_0: w = d * (q - 8), so the kernel's minimum term is -8d
        return QuantizedTensor("q4", w.q, d, torch.zeros_like(d), w.group_size)
    zero = None if w.zero is None else w.zero.half().float()
    return QuantizedTensor("q8", w.q, d, zero, w.group_size)


@pytest.mark.parametrize("path,mode", PATH_MODES)
@pytest.mark.parametrize("kind", ["q4", "q8", "q8zero"])
def test_fp16_scales_where_exact_give_the_same_bits_on_every_isa(kind, path, mode):
    w = _fp16_exact(kind)
    lin = Int8DotLinear(w, None)
    assert lin.scales.dtype == torch.float16
    assert lin.mins is None or lin.mins.dtype == torch.float16
    x = torch.randn(13, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    got, ref = _against_scalar(w, x, path, mode)
    assert torch.equal(got, ref)
    # the same values stored as fp32: the kernel widens fp16 exactly, so not one bit moves
    mins = None if lin.mins is None else lin.mins.float()
    as32 = lin._op(x, lin.packed, lin.scales.float(), mins, lin.out_features, lin.group_size,
                   lin.bits, -1)
    assert torch.equal(as32, lin(x))


def test_scales_that_are_not_fp16_values_stay_fp32():
    w = _weights("q4", 32, 64, seed=10)  # float scales, as the K-quants' products are
    assert not torch.equal(w.scale.half().float(), w.scale)
    _, scales, mins, _ = int8_dot.pack(w)
    assert scales.dtype == torch.float32 and mins.dtype == torch.float32


ZEN4 = frozenset("avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni "
                 "avx512_bf16".split())  # AVX-512 VNNI without AVX-VNNI


def test_a_forced_path_the_cpu_lacks_is_a_python_error_naming_its_flags(monkeypatch):
    lin = Int8DotLinear(_weights("q4", 32, 64, seed=13), None)
    x = torch.randn(3, 64)
    monkeypatch.setattr(cpu_kernels, "selection", lambda: cpu_features.select(ZEN4))
    with pytest.raises(cpu_features.PathUnavailable, match="'avx_vnni' needs CPU flags avx_vnni"):
        lin(x, path="avx_vnni")  # refused before the kernel is called: no SIGILL on Zen 4
    with pytest.raises(ValueError, match="no path 'avx1024'"):
        lin(x, path="avx1024")


@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_the_kernel_itself_refuses_a_path_it_was_not_allowed(path):
    # Where this CPU has the path, it is withheld (as on a CPU without it); either way the
    # kernel, not only Int8DotLinear, refuses it with an error rather than running it.
    lin = Int8DotLinear(_weights("q4", 32, 64, seed=13), None)
    name = f"int8_gemm.{path}"
    withheld = (cpu_kernels.paths_without(name) if name in cpu_kernels.selection().allowed()
                else contextlib.nullcontext())
    refusal = f"int8_gemm: path {path} is not one this CPU can run"
    with withheld, pytest.raises(RuntimeError, match=refusal):
        lin._op(torch.randn(3, 64), lin.packed, lin.scales, lin.mins, lin.out_features,
                lin.group_size, lin.bits, int8_dot.ISA_NAMES.index(path))


@pytest.mark.parametrize("path,mode", PATH_MODES)
@pytest.mark.parametrize("kind, group", [("q4", 32), ("q4", 16), ("q8", 32), ("q8", 16)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_integer_dots_stay_exact_on_every_path(kind, group, sign, path, mode):
    """Every weight at its extreme and every activation at +-127: the AVX2 tile adds a group's
    4-bit products in int16 (at most 8 steps of 2 * 15 * 127) and splits 8-bit weights into
    nibbles; an overflow or a saturation there would change these dots."""
    n, k = 32, 192
    if kind == "q4":
        q = torch.full((n, k), 15, dtype=torch.uint8)
        w = QuantizedTensor("q4", q, torch.ones(n, k // group), torch.zeros(n, k // group), group)
    else:
        q = torch.full((n, k), -127, dtype=torch.int8)
        q[1::2] = 127
        w = QuantizedTensor("q8", q, torch.ones(n, k // group), None, group)
    x = torch.full((7, k), sign)  # quantizes to +-127 in every block
    got, ref = _against_scalar(w, x, path, mode)
    assert torch.equal(got, ref)
    exact = x @ w.dequantize().t()
    assert torch.allclose(ref, exact, rtol=1e-5), (ref[0, :4], exact[0, :4])
