"""Which C++ kernel paths this CPU can run, decided once from the flags it reports.

Every path is described by the set of CPU flags its code needs (as /proc/cpuinfo names them),
never by a rung on a ladder: Zen 4, Ice Lake and Cascade Lake have AVX-512 VNNI without the
VEX-encoded AVX-VNNI, and "the best path or anything below it" ran vpdpbusd (VEX) there and
died of SIGILL. A path is selected or forced only where every flag it needs is present; asking
for one that is not raises `PathUnavailable` naming the path and the missing flags.

Two kinds of path: `target` paths are compiled into every build behind a function target
attribute and chosen at run time (the int8 GEMM's tiles, the bf16 conversions, attention's
bf16 dot products); `build` paths exist only where the whole module was compiled with their
flags (the AVX-512 attention, fused ops, exp and row max), so they run where the build's flags
do (attention's is still switched per call, so a test can run its other paths there too). The
build itself (the compiler's -m flags) is chosen here too, from the same flag sets.

Pure Python, no torch: setup.py loads it in a bare build environment, and the tests feed it
recorded flag sets of real CPUs.

$DYNASPEC_CPU_FLAGS (flags separated by spaces or commas) masks the CPU: only the flags this CPU
reports that are also listed are used, so a Zen 4 runs the suite as an AVX2-only or an AVX-VNNI
machine would (scripts/cpu_kernel_check.sh --as): paths the masked CPU lacks run emulated in the
tests, and asking for one natively is refused. It only ever withholds flags, never adds one the
CPU lacks, so it cannot lead to SIGILL and is honoured anywhere (the engine too, which then runs
slower paths; a warning says so and bench results record it). Listed flags this CPU lacks (the
masked CPU's avx_vnni on a Zen 4) stay withheld: `masked_as()` is what that CPU would select.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

Flags = frozenset[str]
MASK_ENV = "DYNASPEC_CPU_FLAGS"
log = logging.getLogger("dynaspec")

# The compiler option for each flag a build can enable (gcc -m names differ from cpuinfo's).
COMPILER_OPTIONS = {
    "avx": "-mavx", "avx2": "-mavx2", "fma": "-mfma", "f16c": "-mf16c",
    "avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
}


@dataclass(frozen=True)
class KernelPath:
    kernel: str  # the C++ entry point family (KERNELS' keys)
    name: str
    flags: Flags  # every CPU flag the path's code needs
    build: bool = False  # compiled only into a build whose flags include `flags`
    note: str = ""


def _paths(kernel: str, *rows: tuple) -> tuple[KernelPath, ...]:
    return tuple(KernelPath(kernel, name, frozenset(flags), *rest) for name, flags, *rest in rows)


_AVX2 = ("avx", "avx2", "fma", "f16c")
_AVX512 = ("avx512f", "avx512bw", "avx512vl")
_BF16 = (*_AVX512, "avx512dq", "avx512_bf16")

# Each kernel's paths, preferred first. Preference only orders the paths whose flags are all
# present; it never implies one path's flags from another's.
KERNELS: dict[str, tuple[KernelPath, ...]] = {
    # The whole module's compiler flags (setup.py and the JIT build).
    "build": _paths(
        "build",
        ("avx512", (*_AVX2, *_AVX512)),
        ("avx2", _AVX2),
        ("base", ()),
    ),
    # int8_gemm's tiles; the AVX-512 VNNI path also quantizes activations with AVX-512 into
    # the tiles' block layout, so the quantizer follows this choice.
    "int8_gemm": _paths(
        "int8_gemm",
        ("avx512_vnni", (*_AVX512, "avx512_vnni", "fma")),
        ("avx_vnni", ("avx2", "fma", "f16c", "avx_vnni")),
        ("avx2", ("avx2", "fma", "f16c"), False, "8-bit weights as two 4-bit nibble dots"),
        ("scalar", ()),
    ),
    # fp32 -> bf16 stores: vcvtneps2bf16, else the integer rounding on 16 lanes, else scalar.
    "bf16_convert": _paths(
        "bf16_convert",
        ("avx512_bf16", _BF16),
        ("avx512", ("avx512f", "avx512bw")),
        ("scalar", ()),
    ),
    # paged attention (csrc/paged_decode.cpp's AttnPath, in reverse): bf16 dot products (scores;
    # value sums in pairs where the build is AVX-512 too), else the fp32 rows with AVX-512 value
    # sums (compiled into an AVX-512 build, switched at run time), else the fp32 rows as loops
    # the compiler vectorises for the build; scalar is the plain-loop reference, never preferred.
    "attention": _paths(
        "attention",
        ("avx512_bf16", (*_BF16, "fma")),
        ("avx512", _AVX512, True),
        ("avx2", ("avx2", "fma", "f16c"), False, "fp32 rows in AVX2 + FMA intrinsics"),
        ("fp32", ()),
        ("scalar", ()),
    ),
    "exp": _paths("exp", ("avx512", _AVX512, True), ("scalar", ())),
    "row_max": _paths("row_max", ("avx512", _AVX512, True), ("scalar", ())),  # and argmax_rows
}


# Every flag some path needs (what a mask's warning names).
_VECTOR_FLAGS = frozenset(f for paths in KERNELS.values() for p in paths for f in p.flags)


class PathUnavailable(RuntimeError):
    """A kernel path was asked for on a CPU (or build) without every flag it needs."""


def parse_cpuinfo(text: str) -> Flags:
    """The flags of /proc/cpuinfo's first processor (x86: "flags"; empty where none is listed)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def parse_model_name(text: str) -> str | None:
    """The "model name" of /proc/cpuinfo's first processor (None where none is listed)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def mask() -> Flags | None:
    """The flags $DYNASPEC_CPU_FLAGS lists (the CPU it masks this one as); None where unset."""
    text = os.environ.get(MASK_ENV)
    return None if text is None else frozenset(f for f in re.split(r"[\s,]+", text) if f)


_warned: set[Flags] = set()


def cpu_flags(path: str = "/proc/cpuinfo") -> Flags:
    """This CPU's flags, less those $DYNASPEC_CPU_FLAGS leaves out; none where the file cannot
    be read (every choice is then scalar)."""
    text = _read(path)
    flags = frozenset() if text is None else parse_cpuinfo(text)
    masked = mask()
    if masked is None:
        return flags
    if flags - masked and flags not in _warned:
        _warned.add(flags)
        log.warning("%s withholds CPU flags %s: the kernels take slower paths", MASK_ENV,
                    " ".join(sorted(f for f in flags - masked if f in _VECTOR_FLAGS)) or "(none "
                    "a kernel path uses)")
    return flags & masked


def masked_as() -> Selection | None:
    """What the CPU $DYNASPEC_CPU_FLAGS describes would select (None where unset): where it
    lists flags this CPU lacks, more than this CPU runs under the mask."""
    masked = mask()
    return None if masked is None else select(masked)


def cpu_model_name(path: str = "/proc/cpuinfo") -> str | None:
    """This CPU's model name; None where the file cannot be read or lists none (not Linux, or
    an architecture whose cpuinfo names it otherwise)."""
    text = _read(path)
    return None if text is None else parse_model_name(text)


def path(kernel: str, name: str) -> KernelPath:
    for p in KERNELS[kernel]:
        if p.name == name:
            return p
    names = ", ".join(p.name for p in KERNELS[kernel])
    raise ValueError(f"{kernel} has no path {name!r} (paths: {names})")


def missing(p: KernelPath, flags: Flags, build_flags: Flags | None = None) -> list[str]:
    """The flags p needs that the CPU lacks (or, for a build path, that the build lacks)."""
    have = flags if not p.build or build_flags is None else flags & build_flags
    return sorted(p.flags - have)


def runnable(kernel: str, flags: Flags, build_flags: Flags | None = None) -> list[KernelPath]:
    """kernel's paths this CPU (and build) can run, preferred first."""
    return [p for p in KERNELS[kernel] if not missing(p, flags, build_flags)]


def require(kernel: str, name: str, flags: Flags,
            build_flags: Flags | None = None) -> KernelPath:
    """The path, or PathUnavailable naming it and the flags it needs that are missing."""
    p = path(kernel, name)
    lacking = missing(p, flags, build_flags)
    if lacking:
        cpu_lacks = sorted(p.flags - flags)
        where = ("this CPU lacks" if cpu_lacks == lacking else
                 "the kernels' build lacks" if not cpu_lacks else
                 "this CPU or the kernels' build lacks")
        raise PathUnavailable(f"{kernel} path {name!r} needs CPU flags {', '.join(lacking)}, "
                              f"which {where}")
    return p


@dataclass(frozen=True)
class Selection:
    """One choice per kernel for a CPU's flags: what runs when no path is forced."""

    flags: Flags
    chosen: dict[str, str] = field(hash=False)

    @property
    def build(self) -> KernelPath:
        return path("build", self.chosen["build"])

    def compiler_options(self) -> list[str]:
        return [COMPILER_OPTIONS[f] for f in sorted(self.build.flags)]

    def allowed(self) -> list[str]:
        """Every "kernel.path" this CPU and the selected build can run (what the C++ side is
        told it may use)."""
        return [f"{k}.{p.name}" for k in KERNELS if k != "build"
                for p in runnable(k, self.flags, self.build.flags)]


def select(flags: Flags) -> Selection:
    build = runnable("build", flags)[0]
    chosen = {"build": build.name}
    for kernel in KERNELS:
        if kernel != "build":
            chosen[kernel] = runnable(kernel, flags, build.flags)[0].name
    return Selection(frozenset(flags), chosen)
