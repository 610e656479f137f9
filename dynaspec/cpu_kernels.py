"""The engine's C++ CPU kernels (csrc/): built at install, loaded at run time, JIT only as a
fallback.

`pip install` compiles csrc/*.cpp into `dynaspec._cpu_kernels` (setup.py) with the compiler
flags cpu_features selects from the installing machine's CPU flags, so a first start loads them
in well under a second. Before that module is imported its build facts (tag, the CPU flags it
was compiled for, hash of the sources and flags), kept as a string in the file, are read from
the file: a module built for flags this CPU lacks (a venv or container image copied from another
machine) is never imported, since any of its code, static initializers included, may use them.
That, a hash mismatch (edited sources) or a missing module falls back to a JIT build for this
CPU with torch's extension tooling into a directory of this install's own (never shared with
another install or checkout), announced in the log, under a lock that gives up after a bounded
wait instead of hanging on a lock file a killed process left behind. Once loaded, the module is
told which run-time paths this CPU may take (set_cpu_paths; cpu_features decides, the C++ side
asks the CPU nothing). Without a compiler or ninja (`pip install 'dynaspec[cpu-kernels]'`) the
kernels are unavailable, `available()` says why, and every caller keeps its plain PyTorch path.
Built with -ffp-contract=off: no fused multiply-adds the eager ops would not do, so the fused ops
round exactly like them.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib
import importlib.util
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from dynaspec import cpu_features

log = logging.getLogger("dynaspec")
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = ("module.cpp", "paged_decode.cpp", "fused_ops.cpp", "int8_gemm.cpp", "layer_stack.cpp",
           "head_step.cpp")
HEADERS = ("cpu_paths.h", "vec_exp.h", "attn_avx2.h", "attn_tree.h", "attn_avx2_item.h",
           "attn_bf16_item.h", "attn_call.h", "attn_fp32.h", "attn_fp32_item.h", "attn_item.h",
           "attn_pairs.h", "attn_prefetch.h", "attn_reference.h", "attn_rows.h", "attn_schedule.h",
           "row_max.h", "int8_quant.h", "int8_tiles.h", "qlinear.h", "simd.h", "simd_emulated.h")
EXT_MODULE = "dynaspec._cpu_kernels"
BUILD_WAIT_S = float(os.environ.get("DYNASPEC_KERNEL_BUILD_WAIT", "900"))


@lru_cache(maxsize=1)
def _cpu_selection() -> cpu_features.Selection:
    return cpu_features.select(cpu_features.cpu_flags())


# Kernels serving in place of this CPU's own, with the selection they run (kernel_emulation's
# test-only build, where every path is allowed); None: this CPU's module and selection.
_serving: tuple[object, cpu_features.Selection] | None = None


def selection() -> cpu_features.Selection:
    """The kernel paths for this CPU's flags, chosen once (cpu_features); the serving module's
    inside `serving`."""
    return _serving[1] if _serving is not None else _cpu_selection()


@contextmanager
def serving(mod, sel: cpu_features.Selection):
    """Every caller of extension() and selection() gets `mod` and `sel` until exit: how the
    tests run the kernel wrappers (attention, int8 GEMM, fused ops) on the emulated build. Not
    reentrant, not for the engine."""
    global _serving
    if _serving is not None:
        raise RuntimeError("the kernels are already being served by another module")
    _serving = (mod, sel)
    try:
        yield mod
    finally:
        _serving = None


def _options(tag: str) -> list[str]:
    build = cpu_features.path("build", tag)
    return [cpu_features.COMPILER_OPTIONS[f] for f in sorted(build.flags)]


def isa_flags() -> tuple[str, list[str]]:
    """(tag, compiler flags) of the build this CPU's flags select."""
    sel = selection()
    return sel.chosen["build"], sel.compiler_options()


def compile_flags(tag: str) -> list[str]:
    return ["-O3", "-ffp-contract=off", "-fopenmp", "-fopenmp-simd", *_options(tag),
            f"-DDYNASPEC_SRC_HASH=h{source_hash(tag)}", f"-DDYNASPEC_ISA_TAG={tag}",
            f"-DDYNASPEC_BUILD_FLAGS={','.join(sorted(cpu_features.path('build', tag).flags))}"]


def source_hash(tag: str) -> str:
    """Hash of the kernel sources, the ISA flags and the torch version they build against."""
    import torch

    h = hashlib.sha256(f"{tag}|{' '.join(_options(tag))}|{torch.__version__}".encode())
    for name in SOURCES + HEADERS:
        with open(os.path.join(_CSRC, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


FACTS_MARK = b"DYNASPEC-BUILD-FACTS:"  # module.cpp's dynaspec_build_facts


@dataclass(frozen=True)
class BuildFacts:
    tag: str
    hash: str  # "h" + source_hash(tag)
    flags: cpu_features.Flags  # the CPU flags its compiler options assume


def read_facts(so_path: str) -> BuildFacts | None:
    """The facts module.cpp stored in a built module's file, read without loading it."""
    with open(so_path, "rb") as f:
        data = f.read()
    at = data.find(FACTS_MARK)
    if at < 0:
        return None
    text = data[at + len(FACTS_MARK): data.find(b";", at)].decode("ascii", "replace")
    fields = dict(kv.split("=", 1) for kv in text.split() if "=" in kv)
    if "tag" not in fields or "hash" not in fields:
        return None
    return BuildFacts(fields["tag"], fields["hash"],
                      frozenset(f.strip() for f in fields.get("flags", "").split(",") if f.strip()))


def refusal(facts: BuildFacts | None, flags: cpu_features.Flags, tag: str, want_hash: str) -> str:
    """Why a built module must not be imported on a CPU with these flags ("" where it may be):
    its build flags, not its tag, decide, so a module from any machine is judged by what it
    would run here."""
    if facts is None:
        return "they record no build facts, so the CPU flags they need are unknown"
    lacking = sorted(facts.flags - flags)
    if lacking:
        return (f"they were built for {facts.tag}, with CPU flags this CPU lacks "
                f"({', '.join(lacking)}); importing them could end in SIGILL")
    if facts.tag != tag or facts.hash != want_hash:
        return (f"they were built as {facts.tag}/{facts.hash}, this CPU and source need "
                f"{tag}/{want_hash}")
    return ""


def _prebuilt(tag: str):
    """The module built at install, if it exists and matches this CPU and these sources; judged
    from its file before it is imported."""
    import torch  # noqa: F401 - loads libc10/libtorch, which the module links against

    spec = importlib.util.find_spec(EXT_MODULE)
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        log.info("no CPU kernels built at install")
        return None
    why = refusal(read_facts(spec.origin), selection().flags, tag, "h" + source_hash(tag))
    if why:
        log.info("not loading the installed CPU kernels (%s): rebuilding for %s", why, tag)
        return None
    return importlib.import_module(EXT_MODULE)


def _configured(mod, allowed: list[str] | None = None):
    """mod, told which run-time paths it may take: this CPU's (cpu_features' selection), or a
    subset of them; int8_gemm runs its preferred allowed path."""
    allowed = selection().allowed() if allowed is None else allowed
    gemm = next((p.name for p in cpu_features.KERNELS["int8_gemm"]
                 if f"int8_gemm.{p.name}" in allowed), "scalar")
    mod.set_cpu_paths(allowed, gemm)
    return mod


@contextmanager
def paths_without(*names: str):
    """The loaded kernels with these run-time paths ("kernel.path") withheld, so tests reach the
    paths a CPU would otherwise not prefer; never one outside this CPU's selection."""
    mod = extension()
    allowed = selection().allowed()
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise cpu_features.PathUnavailable(f"not among this CPU's paths: {', '.join(unknown)}")
    try:
        yield _configured(mod, [n for n in allowed if n not in names])
    finally:
        _configured(mod)


def build_dir(tag: str, key: str | None = None) -> str:
    """This install's own JIT directory: keyed by the package's path and the source hash (or
    `key`), so two installs (or checkouts) never build over each other's files."""
    root = os.environ.get("DYNASPEC_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "dynaspec"
    )
    install = hashlib.sha256(os.path.abspath(os.path.dirname(__file__)).encode()).hexdigest()[:10]
    return os.path.join(root, "kernels", f"{tag}-{key or source_hash(tag)}-{install}")


def _lock(path: str, wait_s: float):
    """An exclusive flock on `path`, waiting at most wait_s (a dead holder's lock is released by
    the kernel, unlike torch's lock file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline, next_note = time.monotonic() + wait_s, time.monotonic() + 30
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() > deadline:
            os.close(fd)
            raise TimeoutError(
                f"another process has been building the kernels in {os.path.dirname(path)} "
                f"for over {wait_s:.0f} s (DYNASPEC_KERNEL_BUILD_WAIT)"
            )
        if time.monotonic() > next_note:
            log.info(
                "waiting for another process building the CPU kernels in %s", os.path.dirname(path)
            )
            next_note += 30
        time.sleep(0.5)


def _jit(tag: str):
    return jit_build(f"dynaspec_cpu_kernels_{tag}", compile_flags(tag), build_dir(tag), tag)


def jit_build(name: str, cflags: list[str], where: str, what: str):
    """csrc built as module `name` with these flags into `where`, once, under the lock."""
    from torch.utils.cpp_extension import load

    os.makedirs(where, exist_ok=True)
    fd = _lock(os.path.join(where, "dynaspec.lock"), BUILD_WAIT_S)
    try:
        stale = os.path.join(where, "lock")  # torch's own lock file: ours is held, so nobody builds
        if os.path.exists(stale):
            os.remove(stale)
        built = any(f.endswith(".so") for f in os.listdir(where))
        if not built:
            log.info(
                "building the dynaspec CPU kernels for %s into %s (not built at install; ~1-4 min "
                "once)",
                what,
                where,
            )
        t0 = time.perf_counter()
        mod = load(
            name=name,
            sources=[os.path.join(_CSRC, s) for s in SOURCES],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=where,
            verbose=False,
        )
        if not built:
            log.info("CPU kernels built in %.0f s", time.perf_counter() - t0)
        return mod
    finally:
        os.close(fd)


@lru_cache(maxsize=1)
def _load():
    """The compiled module, or the reason it cannot be had (a str)."""
    if os.environ.get("DYNASPEC_NO_CPU_KERNELS"):
        return "disabled by DYNASPEC_NO_CPU_KERNELS"
    tag, _ = isa_flags()
    try:
        return _configured(_prebuilt(tag) or _jit(tag))
    except Exception as exc:  # no compiler, no ninja, a build error: callers keep plain torch
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _module():
    return _serving[0] if _serving is not None else _load()


def available() -> tuple[bool, str]:
    mod = _module()
    return (False, mod) if isinstance(mod, str) else (True, "")


def extension():
    """The module (paged_decode, rms_norm, add_rms_norm, silu_mul, rope_inplace, int8_gemm);
    raises if unavailable."""
    mod = _module()
    if isinstance(mod, str):
        raise RuntimeError(f"the dynaspec CPU kernels could not be built: {mod}")
    return mod


def loaded():
    """The module if something has already loaded it, else None: never builds (callers outside
    the model, such as the sampler, must not start a build the model itself did not need)."""
    if _serving is not None:
        return _serving[0]
    if _load.cache_info().currsize == 0:
        return None
    mod = _load()
    return None if isinstance(mod, str) else mod
