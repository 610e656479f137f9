"""The emulated kernel build (dynaspec/kernel_emulation.py): every path allowed, served only
inside `active()`, never the engine's; SIMDe found or its absence named. The paths' own
bit-exactness runs in each kernel's tests (tests/kernel_modes.py), natively and emulated."""

from __future__ import annotations

import pytest
import torch

from dynaspec import cpu_features as cf
from dynaspec import cpu_kernels, kernel_emulation

from .. import kernel_modes


def test_every_path_of_every_kernel_is_allowed_in_the_emulated_selection():
    sel = kernel_emulation.selection()
    every = {f"{k}.{p.name}" for k, paths in cf.KERNELS.items() if k != "build" for p in paths}
    assert set(sel.allowed()) == every
    assert sel.chosen["build"] == "avx512" and sel.chosen["int8_gemm"] == "avx512_vnni"
    assert kernel_emulation.emulated("int8_gemm", "avx_vnni")
    assert not kernel_emulation.emulated("attention", "fp32")  # plain code: the same natively


def test_a_missing_simde_is_named_with_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNASPEC_SIMDE_INCLUDE", str(tmp_path))
    monkeypatch.setattr(kernel_emulation, "_SEARCH", ())
    assert kernel_emulation.simde_include() is None
    (tmp_path / "simde" / "x86").mkdir(parents=True)
    (tmp_path / "simde" / "x86" / "avx512.h").write_text("")
    (tmp_path / "simde" / "simde-common.h").write_text(
        "".join(f"#define SIMDE_VERSION_{k} {v}\n" for k, v in (("MAJOR", 0), ("MINOR", 7),
                                                               ("MICRO", 4))))
    assert kernel_emulation.simde_include() == str(tmp_path)
    assert kernel_emulation.simde_version(str(tmp_path)) == "0.7.4"


def test_the_emulated_module_serves_only_inside_active_and_the_cpus_comes_back():
    ok, why = kernel_emulation.available()
    if not ok:
        pytest.skip(f"the emulated kernels cannot be built here: {why}")
    native_sel = cpu_kernels.selection()
    with kernel_emulation.active() as mod:
        assert mod.build_info()[0] == "emulated"
        assert cpu_kernels.extension() is mod and cpu_kernels.selection().flags == (
            kernel_emulation.ALL_FLAGS)
        # (the build's own paths and the scalar bf16 stores are not switched: never listed)
        assert set(mod.cpu_paths()) == {n for n in kernel_emulation.selection().allowed()
                                        if not n.startswith(("exp.", "row_max."))
                                        and n != "bf16_convert.scalar"}
        with pytest.raises(RuntimeError, match="already being served"):
            with kernel_emulation.active():
                pass
    assert cpu_kernels.selection() == native_sel
    if cpu_kernels.available()[0]:
        assert cpu_kernels.extension().build_info()[0] != "emulated"


@pytest.mark.parametrize("path,mode", kernel_modes.cases("attention", ["avx2"]))
def test_an_emulated_run_of_a_path_the_cpu_has_must_give_its_bits(path, mode):
    """kernel_modes.run repeats an emulated run natively where it can and compares the bits: a
    body whose result differs between the two fails there (a tensor with a different bit)."""
    calls = []

    def body():
        calls.append(cpu_kernels.extension().build_info()[0])
        return torch.tensor([float(len(calls))])  # differs from call to call

    if mode == "native" or kernel_modes.native_lacks("attention", path):
        kernel_modes.run("attention", path, mode, body)
        return
    with pytest.raises(AssertionError, match="the emulation differs from this CPU's bits"):
        kernel_modes.run("attention", path, mode, body)
    assert calls[0] == "emulated" and calls[1] != "emulated"


def test_the_native_modules_paths_never_reach_the_emulated_ones():
    """Two kernel modules in one process keep their own allowed paths (an inline variable built
    as a process-wide unique symbol once made them share them: the native module's set_cpu_paths
    took avx_vnni from the emulated one on a Zen 4)."""
    ok, why = kernel_emulation.available()
    if not ok or not cpu_kernels.available()[0]:
        pytest.skip(f"needs both modules: {why or cpu_kernels.available()[1]}")
    with kernel_emulation.active() as emulated:
        pass
    every = emulated.cpu_paths()
    chosen = cpu_kernels.selection().chosen["int8_gemm"]
    if chosen == "scalar":
        pytest.skip("this CPU runs no int8 vector path to withhold")
    with cpu_kernels.paths_without(f"int8_gemm.{chosen}") as native:
        assert f"int8_gemm.{chosen}" not in native.cpu_paths()
        assert emulated.cpu_paths() == every
    assert "int8_gemm.avx_vnni" in every
