"""The emulation itself, intrinsic by intrinsic: each intrinsic the kernels' ISA paths use, as the
emulated build compiles it (SIMDe + csrc/simd_emulated.h, no -m flags) against this CPU's own
instruction, on 4,000 random input sets of any bits (NaNs, infinities, denormals included).
The kernels' tests compare whole paths native against emulated too (tests/kernel_modes.py); this
names the intrinsic when they differ. It needs the hardware to compare with: an AVX-512 CPU with
BF16 and VNNI (a Zen 4's flags); AVX-VNNI's VEX dot product is compared with its EVEX twin."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from dynaspec import cpu_features, kernel_emulation

HERE = os.path.join(os.path.dirname(__file__), "simd_intrinsics")
CSRC = os.path.join(os.path.dirname(cpu_features.__file__), "csrc")
HARDWARE = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 "
                     "avx512_vnni".split())
NATIVE_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                "-mavx512dq", "-mavx512bf16", "-mavx512vnni"]


def test_every_emulated_intrinsic_gives_this_cpus_bits(tmp_path):
    lacking = sorted(HARDWARE - cpu_features.cpu_flags())
    if lacking:
        pytest.skip(f"the hardware to compare the emulation with is missing ({', '.join(lacking)});"
                    " the kernels' emulated tests run all the same")
    include = kernel_emulation.simde_include()
    cxx = shutil.which("c++") or shutil.which("g++")
    if include is None or cxx is None:
        pytest.skip("needs SIMDe's headers (libsimde-dev) and a C++ compiler")
    # -O1 -ffp-contract=off as the emulated kernel build (kernel_emulation.CFLAGS)
    common = ["-std=c++17", "-O1", "-ffp-contract=off", f"-I{HERE}", f"-I{CSRC}", f"-I{include}"]
    objs = []
    for src, flags in (("native.cpp", NATIVE_FLAGS), ("emulated.cpp", [])):
        obj = str(tmp_path / (src + ".o"))
        subprocess.run([cxx, *common, *flags, "-w", "-c", os.path.join(HERE, src), "-o", obj],
                       check=True)
        objs.append(obj)
    exe = str(tmp_path / "check")
    subprocess.run([cxx, *common, os.path.join(HERE, "main.cpp"), *objs, "-o", exe], check=True)
    out = subprocess.run([exe], capture_output=True, text=True)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, "\n".join(line for line in lines if "same" not in line)
    assert len([line for line in lines if " same " in line]) >= 60
