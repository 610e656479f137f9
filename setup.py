"""Builds dynaspec's C++ CPU kernels (dynaspec/csrc) when the package is installed.

The kernels are compiled here, once, with the compiler flags dynaspec.cpu_features selects from
this machine's CPU flags (the same choice `dynaspec.cpu_kernels.isa_flags` makes at run time),
so a first start needs no compiler and no JIT build. Where no compiler is found the install still
succeeds: the engine then builds the kernels on first use into a per-install directory, or runs
plain PyTorch (see cpu_kernels.py).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_kernels():
    """dynaspec.cpu_kernels (and the pure-Python cpu_features it reads) without running the
    package's __init__: the package's other imports are not in the build env."""
    pkg = types.ModuleType("dynaspec")
    pkg.__path__ = [os.path.join(HERE, "dynaspec")]
    saved = sys.modules.get("dynaspec")
    sys.modules["dynaspec"] = pkg
    try:
        return importlib.import_module("dynaspec.cpu_kernels")
    finally:
        if saved is None:
            for name in [n for n in sys.modules if n == "dynaspec" or n.startswith("dynaspec.")]:
                del sys.modules[name]
        else:
            sys.modules["dynaspec"] = saved


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
