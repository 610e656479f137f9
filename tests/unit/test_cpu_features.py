"""Kernel path selection from CPU flags: recorded flag sets of real CPUs get the paths their
flags allow, never one that needs a flag they lack, and a forced missing path is a Python
error naming the flags."""

from __future__ import annotations

import pytest

from dynaspec import cpu_features as cf
from tests.unit.recorded_cpus import CPUS, cpuinfo

# What each recorded CPU runs: build tag, then one path per kernel.
EXPECTED = {
    "zen3": {"build": "avx2", "int8_gemm": "avx2", "bf16_convert": "scalar",
             "attention": "avx2", "exp": "scalar", "row_max": "scalar"},
    "zen4": {"build": "avx512", "int8_gemm": "avx512_vnni", "bf16_convert": "avx512_bf16",
             "attention": "avx512_bf16", "exp": "avx512", "row_max": "avx512"},
    "icelake_server": {"build": "avx512", "int8_gemm": "avx512_vnni", "bf16_convert": "avx512",
                       "attention": "avx512", "exp": "avx512", "row_max": "avx512"},
    "skylake_server": {"build": "avx512", "int8_gemm": "avx2", "bf16_convert": "avx512",
                       "attention": "avx512", "exp": "avx512", "row_max": "avx512"},
    "alder_lake": {"build": "avx2", "int8_gemm": "avx_vnni", "bf16_convert": "scalar",
                   "attention": "avx2", "exp": "scalar", "row_max": "scalar"},
    "sapphire_rapids": {"build": "avx512", "int8_gemm": "avx512_vnni",
                        "bf16_convert": "avx512_bf16", "attention": "avx512_bf16",
                        "exp": "avx512", "row_max": "avx512"},
    "sandy_bridge": {"build": "base", "int8_gemm": "scalar", "bf16_convert": "scalar",
                     "attention": "fp32", "exp": "scalar", "row_max": "scalar"},
}


def _flags(name: str) -> cf.Flags:
    return cf.parse_cpuinfo(cpuinfo(name))


def test_cpuinfo_flags_are_read_from_the_flags_line(tmp_path, monkeypatch):
    monkeypatch.delenv(cf.MASK_ENV, raising=False)  # (a masked run of the suite)
    assert "avx512_vnni" in _flags("zen4") and "avx_vnni" not in _flags("zen4")
    f = tmp_path / "cpuinfo"
    f.write_text(cpuinfo("alder_lake"))
    assert cf.cpu_flags(str(f)) == _flags("alder_lake")
    assert cf.cpu_flags(str(tmp_path / "absent")) == frozenset()  # unreadable: scalar everywhere
    assert cf.select(frozenset()).chosen == EXPECTED["sandy_bridge"]


@pytest.mark.parametrize("masked_as", ["zen3", "alder_lake"])
def test_a_mask_withholds_flags_but_never_adds_one(masked_as, tmp_path, monkeypatch):
    """A Zen 4 masked as an AVX2-only (Zen 3) or an AVX-VNNI (Alder Lake) machine runs what an
    AVX2-only machine runs: the mask's avx_vnni, which the Zen 4 lacks, is never taken up, but
    masked_as() says what the masked CPU itself would select."""
    f = tmp_path / "cpuinfo"
    f.write_text(cpuinfo("zen4"))
    monkeypatch.setenv(cf.MASK_ENV, ",".join(sorted(_flags(masked_as))))
    flags = cf.cpu_flags(str(f))
    assert flags == _flags("zen4") & _flags(masked_as)
    assert "avx_vnni" not in flags and "avx512f" not in flags
    assert cf.select(flags).chosen == EXPECTED["zen3"]
    assert cf.masked_as().chosen == EXPECTED[masked_as]
    monkeypatch.setenv(cf.MASK_ENV, "avx avx2,  fma f16c")  # spaces or commas
    assert cf.cpu_flags(str(f)) == frozenset({"avx", "avx2", "fma", "f16c"})
    monkeypatch.delenv(cf.MASK_ENV)
    assert cf.cpu_flags(str(f)) == _flags("zen4") and cf.masked_as() is None


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_each_recorded_cpu_runs_the_paths_its_flags_allow(cpu):
    sel = cf.select(_flags(cpu))
    assert sel.chosen == EXPECTED[cpu]
    build = sel.build
    assert build.flags <= sel.flags  # the whole-file build needs nothing the CPU lacks
    for kernel, name in sel.chosen.items():
        p = cf.path(kernel, name)
        assert p.flags <= sel.flags, (kernel, name)
        if p.build:
            assert p.flags <= build.flags, (kernel, name)  # compiled into this build


@pytest.mark.parametrize("cpu", sorted(CPUS))
def test_no_path_is_allowed_or_forceable_that_needs_a_missing_flag(cpu):
    flags = _flags(cpu)
    sel = cf.select(flags)
    allowed = set(sel.allowed())
    for kernel, paths in cf.KERNELS.items():
        for p in paths:
            lacking = set(p.flags - flags)
            if kernel != "build" and p.build:
                lacking |= p.flags - sel.build.flags
            if kernel != "build":
                assert (f"{kernel}.{p.name}" in allowed) == (not lacking), (kernel, p.name)
            if lacking:
                with pytest.raises(cf.PathUnavailable) as err:
                    cf.require(kernel, p.name, flags, sel.build.flags)
                for flag in lacking:
                    assert flag in str(err.value)
                assert repr(p.name) in str(err.value)
            else:
                assert cf.require(kernel, p.name, flags, sel.build.flags) is p


def test_zen4_has_avx512_vnni_but_forcing_avx_vnni_names_the_missing_flag():
    # The SIGILL of issue 47: a ladder took AVX-512 VNNI to imply the VEX-encoded AVX-VNNI.
    flags = _flags("zen4")
    with pytest.raises(cf.PathUnavailable, match="int8_gemm path 'avx_vnni' needs CPU flags "
                                                 "avx_vnni, which this CPU lacks"):
        cf.require("int8_gemm", "avx_vnni", flags)
    assert [p.name for p in cf.runnable("int8_gemm", flags)] == ["avx512_vnni", "avx2", "scalar"]
    # Alder Lake is the mirror image: AVX-VNNI, no AVX-512 at all.
    assert [p.name for p in cf.runnable("int8_gemm", _flags("alder_lake"))] == [
        "avx_vnni", "avx2", "scalar"]


def test_attention_avx2_runs_on_avx2_cpus_and_is_refused_without_avx2():
    # Target-attributed AVX2 + FMA rows: preferred below the AVX-512 rows, above the fp32 loops.
    assert [p.name for p in cf.runnable("attention", _flags("zen3"))] == ["avx2", "fp32", "scalar"]
    assert "attention.avx2" in cf.select(_flags("sapphire_rapids")).allowed()
    with pytest.raises(cf.PathUnavailable, match="attention path 'avx2' needs CPU flags avx2, "
                                                 "f16c, fma, which this CPU lacks"):
        cf.require("attention", "avx2", _flags("sandy_bridge"))


def test_build_paths_need_the_build_as_well_as_the_cpu():
    # An AVX-512 CPU running an AVX2 build (not what select() picks, but what an old module
    # gives): the AVX-512 attention rows were not compiled in, the target-attributed paths were.
    flags, avx2_build = _flags("sapphire_rapids"), cf.path("build", "avx2").flags
    assert cf.missing(cf.path("attention", "avx512"), flags, avx2_build) == [
        "avx512bw", "avx512f", "avx512vl"]
    with pytest.raises(cf.PathUnavailable, match="which the kernels. build lacks"):
        cf.require("exp", "avx512", flags, avx2_build)
    assert cf.require("int8_gemm", "avx512_vnni", flags, avx2_build).name == "avx512_vnni"


def test_unknown_paths_are_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"int8_gemm has no path 'amx' \(paths: avx512_vnni, "):
        cf.path("int8_gemm", "amx")


def test_compiler_options_follow_the_build_flags():
    assert cf.select(_flags("zen4")).compiler_options() == [
        "-mavx", "-mavx2", "-mavx512bw", "-mavx512f", "-mavx512vl", "-mf16c", "-mfma"]
    assert cf.select(_flags("zen3")).compiler_options() == ["-mavx", "-mavx2", "-mf16c", "-mfma"]
    assert cf.select(_flags("sandy_bridge")).compiler_options() == []


def test_the_model_name_is_read_from_the_first_processor(tmp_path):
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\nflags\t\t: avx2\n"
            "processor\t: 1\nmodel name\t: another\n")
    assert cf.parse_model_name(text) == "AMD EPYC 9R14 96-Core Processor"
    assert cf.parse_model_name(cpuinfo("zen4")) is None  # the recorded excerpts list none
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    assert cf.cpu_model_name(str(f)) == "AMD EPYC 9R14 96-Core Processor"
    assert cf.cpu_model_name(str(tmp_path / "missing")) is None
    assert cf.cpu_flags(str(tmp_path / "missing")) == frozenset()
