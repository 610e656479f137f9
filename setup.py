"""Builds dynaspec's C++ CPU kernels (dynaspec/csrc) when the package is installed.

The kernels are compiled here, once, for the vector ISA this machine reports (the same choice
`dynaspec.cpu_kernels.isa_flags` makes at run time; the int8 matmul also dispatches per call
between its scalar/AVX2/AVX-VNNI/AVX-512 paths), so a first start needs no compiler and no JIT
build. Where no compiler is found the install still succeeds: the engine then builds the
kernels on first use into a per-install directory, or runs plain PyTorch (see cpu_kernels.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_kernels():
    """dynaspec/cpu_kernels.py alone: the package's other imports are not in the build env."""
    spec = importlib.util.spec_from_file_location(
        "_dynaspec_cpu_kernels", os.path.join(HERE, "dynaspec", "cpu_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _extensions():
    if os.environ.get("DYNASPEC_NO_CPU_KERNELS") or os.environ.get("DYNASPEC_SKIP_KERNEL_BUILD"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # torch is a build requirement; without it, JIT on first use
        return [], {}
    ck = _cpu_kernels()
    tag, _ = ck.isa_flags()

    class LenientBuild(BuildExtension):
        """A failed kernel build (no compiler) must not fail the install: the engine falls back."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any toolchain failure
                print(f"dynaspec: the C++ CPU kernels were not built ({exc}); they will be "
                      "built on first use if a compiler appears, else plain PyTorch runs",
                      file=sys.stderr)

    ext = CppExtension(
        ck.EXT_MODULE, [os.path.join("dynaspec", "csrc", s) for s in ck.SOURCES],
        extra_compile_args=ck.compile_flags(tag),
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": LenientBuild.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
