"""The engine's own small C++ CPU kernels (csrc/), built on first use on the machine that runs them.

torch's extension tooling compiles csrc/*.cpp once per ISA tag into its cache (~1 minute the
first time, then loaded in well under a second). The vector flags come from what this CPU
reports in /proc/cpuinfo at run time (AVX-512 / AVX2 / baseline), never from the machine that
built a wheel, so an instruction the CPU lacks can never be emitted (llama.cpp built natively
on one machine died with SIGILL on another). Without a compiler or ninja (`pip install
'dynaspec[cpu-kernels]'` provides ninja) the kernels are unavailable, `available()` says why,
and every caller keeps its plain PyTorch path. Built with -ffp-contract=off: no fused
multiply-adds the eager ops would not do, so the fused ops round exactly like them.
"""

from __future__ import annotations

import os
from functools import lru_cache

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ("paged_decode.cpp", "fused_ops.cpp", "int8_gemm.cpp")


def isa_flags() -> tuple[str, list[str]]:
    """(tag, compiler flags) for the vector ISA this CPU reports."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        pass
    if {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"} <= flags:
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "base", []


@lru_cache(maxsize=1)
def _load():
    """The compiled module, or the reason it cannot be built (a str)."""
    if os.environ.get("DYNASPEC_NO_CPU_KERNELS"):
        return "disabled by DYNASPEC_NO_CPU_KERNELS"
    try:
        from torch.utils.cpp_extension import load

        tag, isa = isa_flags()
        return load(name=f"dynaspec_cpu_kernels_{tag}", sources=[os.path.join(_CSRC, s) for s in _SOURCES],
                    extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp", "-fopenmp-simd", *isa], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: callers keep plain torch
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def available() -> tuple[bool, str]:
    mod = _load()
    return (False, mod) if isinstance(mod, str) else (True, "")


def extension():
    """The module (paged_decode, rms_norm, add_rms_norm, silu_mul); raises if unavailable."""
    mod = _load()
    if isinstance(mod, str):
        raise RuntimeError(f"the dynaspec CPU kernels could not be built: {mod}")
    return mod
