"""Every run-time kernel path this CPU can run, against its reference: the int8 GEMM's bf16
stores (vcvtneps2bf16, integer rounding on 16 lanes) against the scalar reference's bits (the
attention's paths, forced per call: test_cpu_paged_paths.py). A path this CPU (or this build)
cannot run is skipped with the reason; none is forced."""

from __future__ import annotations

import pytest
import torch

from dynaspec import cpu_features as cf
from dynaspec import cpu_kernels
from dynaspec.models import int8_dot
from dynaspec.models.int8_dot import Int8DotLinear
from dynaspec.models.layers import FusedOps
from dynaspec.models.quant import quantize_int4

from .. import kernel_modes

ok, why = cpu_kernels.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"the C++ kernels are not built: {why}")


def _reach(kernel: str, name: str):
    """The kernels running path `name` of `kernel`: the paths this CPU prefers over it withheld
    (paths_without), or a skip naming why it cannot run here."""
    sel = cpu_kernels.selection()
    target = cf.path(kernel, name)
    lacking = cf.missing(target, sel.flags, sel.build.flags)
    if lacking:
        pytest.skip(f"{kernel} path {name} needs {', '.join(lacking)}, which this CPU or the "
                    f"{sel.chosen['build']} build lacks")
    paths = cf.KERNELS[kernel]
    ahead = [p for p in paths[: paths.index(target)]
             if not cf.missing(p, sel.flags, sel.build.flags)]
    compiled = [p.name for p in ahead if p.build]
    if compiled:
        pytest.skip(f"the {sel.chosen['build']} build runs {kernel} path {compiled[0]} wherever "
                    f"{name} would run: {name} is compiled only into builds without it")
    return cpu_kernels.paths_without(*[f"{kernel}.{p.name}" for p in ahead])


@pytest.mark.parametrize("path,mode", kernel_modes.cases("bf16_convert", ["avx512_bf16", "avx512"]))
def test_every_bf16_store_path_gives_the_scalar_references_bits(path, mode):
    g = torch.Generator().manual_seed(41)
    w = quantize_int4(torch.randn(64, 128, generator=g) * 1e-4)
    # outputs from ~1e-38 (subnormal in bf16: vcvtneps2bf16 alone would flush them) to ~1e2
    x = (torch.randn(24, 128, generator=g) * torch.logspace(-35, 2, 24)[:, None]).bfloat16()

    def body():
        sel = cpu_kernels.selection()
        if sel.chosen["int8_gemm"] != "avx512_vnni":  # (native only: the emulation has it)
            pytest.skip(f"the int8 GEMM stores bf16 with vector code only on its avx512_vnni "
                        f"path; this CPU runs {sel.chosen['int8_gemm']}")
        lin = Int8DotLinear(w, None)
        ref = lin(x, path="scalar")
        composed = FusedOps(enabled=True).silu_and_mul(ref)
        with _reach("bf16_convert", path):
            got, fused = lin(x), lin.silu_mul(x)
        return got, fused, ref, composed

    got, fused, ref, composed = kernel_modes.run("bf16_convert", path, mode, body)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(fused.view(torch.int16), composed.view(torch.int16))


def test_only_this_cpus_paths_can_be_withheld_and_the_selection_comes_back():
    ext = cpu_kernels.extension()
    before = ext.cpu_paths()
    with pytest.raises(cf.PathUnavailable, match="not among this CPU's paths: attention.amx"):
        with cpu_kernels.paths_without("attention.amx"):
            pass
    build_paths = [n for n in cpu_kernels.selection().allowed()  # attention's is switched per call
                   if cf.path(*n.split(".")).build and not n.startswith("attention.")]
    if build_paths:  # compiled in: withholding one would claim a path the build cannot drop
        with pytest.raises(RuntimeError, match="compiled in, but not all allowed"):
            with cpu_kernels.paths_without(build_paths[0]):
                pass
    chosen = cpu_kernels.selection().chosen["int8_gemm"]
    if chosen != "scalar":
        with cpu_kernels.paths_without(f"int8_gemm.{chosen}") as mod:
            assert f"int8_gemm.{chosen}" not in mod.cpu_paths()
            assert int8_dot.ISA_NAMES[mod.int8_gemm_isa()] != chosen
    assert ext.cpu_paths() == before
    assert int8_dot.ISA_NAMES[ext.int8_gemm_isa()] == chosen


def _force_int8(path: str):
    w = quantize_int4(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)))
    return Int8DotLinear(w, None)(torch.randn(2, 128), path=path)


def _force_attention(path: str):
    from .test_cpu_paged_paths import _attend

    return _attend("decodes", torch.float32, path=path)


@pytest.mark.parametrize("kernel,force", [("int8_gemm", _force_int8),
                                          ("attention", _force_attention)])
def test_a_path_this_cpu_lacks_is_refused_in_python_before_the_kernel_runs(kernel, force):
    """This CPU's own selection, not a patched one: under $DYNASPEC_CPU_FLAGS (an AVX2-only or
    AVX-VNNI machine on a Zen 4) every path the mask withholds is refused by PathUnavailable, a
    Python error raised before the C++ call (the kernel's own refusal is a RuntimeError), so on
    the machine itself it could never reach an instruction the CPU lacks."""
    sel = cpu_kernels.selection()
    for p in cf.KERNELS[kernel]:
        lacking = cf.missing(p, sel.flags, sel.build.flags)
        if lacking:
            with pytest.raises(cf.PathUnavailable, match=f"'{p.name}' needs CPU flags "
                                                         f"{', '.join(lacking)}"):
                force(p.name)
        else:
            assert force(p.name) is not None
