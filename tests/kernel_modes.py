"""Each C++ kernel path's tests on any CPU: natively where the CPU has the path's flags, emulated
(dynaspec.kernel_emulation: the same source against SIMDe) where it does not, and both where it
does, the emulated run then required to give the native run's bits (the test of the emulation).

A test takes `path, mode` from `cases(kernel, paths)` and runs its body through `run`, which
records what ran for the suite's summary (tests/conftest.py prints, per kernel path, natively,
emulated, or not at all)."""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager

import pytest
import torch

from dynaspec import cpu_features as cf
from dynaspec import cpu_kernels, kernel_emulation

# "kernel.path" -> how many of its test cases ran in each mode this session (tests/conftest.py
# prints them).
RAN: dict[str, Counter] = {}


def ran(name: str, mode: str) -> None:
    RAN.setdefault(name, Counter())[mode] += 1


def native_lacks(kernel: str, path: str) -> list[str]:
    """The flags this CPU (or its build) lacks for `path`; ["the kernels"] where none are built."""
    if not cpu_kernels.available()[0]:
        return ["the kernels"]
    sel = cpu_kernels.selection()
    return cf.missing(cf.path(kernel, path), sel.flags, sel.build.flags)


def modes(kernel: str, path: str) -> list[str]:
    """native where this CPU runs `path`; emulated wherever the path needs any CPU flag (a plain
    path is the same code either way)."""
    out = [] if native_lacks(kernel, path) else ["native"]
    if kernel_emulation.emulated(kernel, path):
        out.append("emulated")
    return out or ["native"]  # a plain path with no kernels built: skips as every test does


def cases(kernel: str, paths) -> list:
    """(path, mode) parameters: every path in each mode it can run in on this machine."""
    return [pytest.param(p, m, id=f"{p}-{m}") for p in paths for m in modes(kernel, p)]


@contextmanager
def mode_of(mode: str):
    """The kernels of `mode` serving cpu_kernels' callers; an emulated run skips (naming what to
    install) where SIMDe or a compiler is missing."""
    if mode == "native":
        if not cpu_kernels.available()[0]:
            pytest.skip(f"the C++ kernels are not built: {cpu_kernels.available()[1]}")
        yield
        return
    ok, why = kernel_emulation.available()
    if not ok:
        pytest.skip(f"the emulated kernels cannot be built here: {why}")
    with kernel_emulation.active():
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().flatten().view(torch.uint8)


def _same(a, b) -> bool:
    """Equal bits (NaNs included), tensor by tensor."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def run(kernel: str, path: str, mode: str, body, close: dict | None = None):
    """body() with `mode`'s kernels serving; an emulated run of a path this CPU also runs natively
    must give the native run's bits, or, with `close` (assert_close's rtol and atol), come within
    that bound: for loops whose summation order the compiler picks from the build's vector width
    (an omp simd reduction), which no emulation of intrinsics can give."""
    with mode_of(mode):
        got = body()
    ran(f"{kernel}.{path}", mode)
    if path != "scalar":
        ran(f"{kernel}.scalar", mode)  # the reference each body compares with
    if mode == "emulated" and not native_lacks(kernel, path):
        native = body()
        if close is None:
            assert _same(got, native), (
                f"{kernel}.{path}: the emulation differs from this CPU's bits")
        else:
            torch.testing.assert_close(got, native, **close)
    return got


def enter(request, kernel: str, path: str, mode: str) -> None:
    """`mode`'s kernels serving until the test ends, for a body too long to pass to run() (no
    native comparison: such tests check a property within one mode, as tree rows against their
    chains)."""
    stack = ExitStack()
    stack.enter_context(mode_of(mode))
    request.addfinalizer(stack.close)
    ran(f"{kernel}.{path}", mode)


def build_path(kernel: str, mode: str) -> str:
    """The path of a build-wide kernel (exp, row_max) that `mode`'s module runs."""
    sel = kernel_emulation.selection() if mode == "emulated" else cpu_kernels.selection()
    return sel.chosen[kernel]


# The fused ops run their build's paths: the emulated build's are AVX-512's on every CPU.
BUILD_MODES = ["native", "emulated"]


def run_build(mode: str, body, close: dict | None = None):
    """run() for code on the build's own paths (exp and row_max: the fused ops, softmax)."""
    got = run("exp", build_path("exp", mode), mode, body, close)
    ran(f"row_max.{build_path('row_max', mode)}", mode)
    return got
