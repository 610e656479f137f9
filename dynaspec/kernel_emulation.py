"""Every C++ kernel path on any CPU, for the tests: csrc built a second time against SIMDe.

A path no CPU in the loop has is a path nobody tests (docs/design.md §6f). This builds the same
kernel sources, test-only, as a separately named module (`dynaspec_cpu_kernels_emulated`) with
-DDYNASPEC_EMULATED: csrc/simd.h then takes the intrinsics from SIMDe's portable implementations
(native aliases; csrc/simd_emulated.h writes the ones SIMDe 0.7.4 lacks, and those whose bits it
gets wrong, from Intel's definitions), compiles every ISA path in, and no function targets an ISA.
The build has no -m flags: plain x86-64, so it runs on every machine, and where the CPU has a
path's flags the tests run it both ways and require equal bits (the test of the emulation).

The engine never selects it: the tests reach it through `active()`, which makes it the module
cpu_kernels serves, with a selection that allows every path. Built once per source hash into the
install's cache (as cpu_kernels' JIT fallback), several minutes on two cores, and several times
slower than the native module: keep emulated test cases small.

SIMDe is header-only: Debian's `libsimde-dev` (.ci/run installs it), or a directory holding
`simde/x86/avx512.h` named by $DYNASPEC_SIMDE_INCLUDE.
"""

from __future__ import annotations

import hashlib
import os
import re
from contextlib import contextmanager
from functools import lru_cache

from dynaspec import cpu_features, cpu_kernels

EXT_NAME = "dynaspec_cpu_kernels_emulated"
_HEADER = os.path.join("simde", "x86", "avx512.h")
_SEARCH = ("/usr/include", "/usr/local/include")
# Every flag any path needs: the emulated module runs them all.
ALL_FLAGS = frozenset(f for paths in cpu_features.KERNELS.values() for p in paths for f in p.flags)
# Not -O3: the operations and their order are the source's at any level (no -ffast-math, no
# contraction); -O1 halves a build that is several minutes on two cores. Its symbols are its own:
# GCC makes an inline variable (cpu_paths.h's g_cpu_paths) a process-wide "unique" symbol, so the
# two modules in one process shared their allowed paths (the native module's set_cpu_paths took
# avx_vnni from the emulated one on a Zen 4).
CFLAGS = ("-O1", "-ffp-contract=off", "-fopenmp", "-fopenmp-simd", "-fno-gnu-unique",
          "-fvisibility=hidden", "-DDYNASPEC_EMULATED")


def simde_include() -> str | None:
    """The include directory holding SIMDe's headers, or None."""
    env = os.environ.get("DYNASPEC_SIMDE_INCLUDE")
    for root in ([env] if env else []) + list(_SEARCH):
        if os.path.isfile(os.path.join(root, _HEADER)):
            return root
    return None


def simde_version(include: str) -> str:
    with open(os.path.join(include, "simde", "simde-common.h"), encoding="utf-8") as f:
        text = f.read()
    parts = [re.search(rf"#define SIMDE_VERSION_{k} (\d+)", text) for k in ("MAJOR", "MINOR",
                                                                          "MICRO")]
    return ".".join(m.group(1) for m in parts if m) or "unknown"


def selection() -> cpu_features.Selection:
    """What the emulated module runs: every path of every kernel allowed, the AVX-512 build."""
    return cpu_features.select(ALL_FLAGS)


def emulated(kernel: str, name: str) -> bool:
    """Whether `kernel.name` runs emulated in this module (a path this CPU lacks flags for)
    rather than natively (the plain x86-64 paths, fp32 and scalar)."""
    return bool(cpu_features.path(kernel, name).flags)


def source_hash(include: str) -> str:
    """The kernel sources', SIMDe's version and the build flags' hash (what a rebuild follows)."""
    return hashlib.sha256(f"{cpu_kernels.source_hash('base')}|{simde_version(include)}|"
                          f"{' '.join(CFLAGS)}".encode()).hexdigest()[:16]


def _flags(include: str) -> list[str]:
    return [*CFLAGS, f"-I{include}", f"-DDYNASPEC_SRC_HASH=e{source_hash(include)}",
            "-DDYNASPEC_ISA_TAG=emulated", "-DDYNASPEC_BUILD_FLAGS="]


@lru_cache(maxsize=1)
def _load():
    """The configured module, or why it cannot be had (a str)."""
    include = simde_include()
    if include is None:
        return ("SIMDe's headers are not installed (apt-get install libsimde-dev, or set "
                "DYNASPEC_SIMDE_INCLUDE to a directory holding simde/x86/avx512.h)")
    where = cpu_kernels.build_dir("emulated", source_hash(include))
    try:
        mod = cpu_kernels.jit_build(EXT_NAME, _flags(include), where,
                                    "every path, emulated (SIMDe)")
    except Exception as exc:  # no compiler or ninja, a build error: the emulated tests skip
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    sel = selection()
    mod.set_cpu_paths(sel.allowed(), sel.chosen["int8_gemm"])
    return mod


def available() -> tuple[bool, str]:
    mod = _load()
    return (False, mod) if isinstance(mod, str) else (True, "")


@contextmanager
def active():
    """The emulated module as the one cpu_kernels serves (every path allowed) until exit."""
    mod = _load()
    if isinstance(mod, str):
        raise RuntimeError(f"the emulated kernels could not be built: {mod}")
    with cpu_kernels.serving(mod, selection()) as served:
        yield served
