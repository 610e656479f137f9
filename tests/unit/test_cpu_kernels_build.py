"""Kernel loading: the install-time build is used where this CPU has every flag it was built
for (judged from its file, before it is imported), a JIT fallback builds per install and never
waits forever on another process's lock, and the loaded module runs only this CPU's paths."""

from __future__ import annotations

import fcntl
import logging
import os
from types import SimpleNamespace

import pytest

from dynaspec import cpu_features, cpu_kernels
from dynaspec.models import int8_dot
from tests.unit.recorded_cpus import CPUS, cpuinfo


def test_lock_gives_up_with_a_clear_error_instead_of_hanging(tmp_path):
    path = str(tmp_path / "dynaspec.lock")
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another "process" mid-build
    try:
        with pytest.raises(TimeoutError, match="building the kernels.*DYNASPEC_KERNEL_BUILD_WAIT"):
            cpu_kernels._lock(path, wait_s=1.0)
    finally:
        os.close(holder)
    fd = cpu_kernels._lock(path, wait_s=1.0)  # released (as when the holder dies): acquired at once
    os.close(fd)


def test_jit_directory_is_per_install_and_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    tag, _ = cpu_kernels.isa_flags()
    where = cpu_kernels.build_dir(tag)
    assert where.startswith(str(tmp_path)) and cpu_kernels.source_hash(tag) in where
    monkeypatch.setattr(cpu_kernels, "__file__", "/elsewhere/site-packages/dynaspec/cpu_kernels.py")
    assert cpu_kernels.build_dir(tag) != where  # a second install never shares the build files


def test_loaded_module_matches_this_cpu_and_these_sources():
    ok, why = cpu_kernels.available()
    if not ok:
        pytest.skip(f"kernels unavailable here: {why}")
    tag, _ = cpu_kernels.isa_flags()
    assert cpu_kernels.extension().build_info() == (tag, "h" + cpu_kernels.source_hash(tag))


def _facts_file(tmp_path, tag: str, hash_: str = "h0123") -> str:
    """A stand-in for a built module's file: its facts among other bytes, as module.cpp
    stores them."""
    flags = ",".join(sorted(cpu_features.path("build", tag).flags))
    so = tmp_path / "_cpu_kernels.cpython-311-x86_64-linux-gnu.so"
    so.write_bytes(b"\x7fELF\0\0junk" + cpu_kernels.FACTS_MARK
                   + f" tag={tag} hash={hash_} flags={flags} ;".encode() + b"\0more")
    return str(so)


def _flags(cpu: str) -> cpu_features.Flags:
    return cpu_features.parse_cpuinfo(cpuinfo(cpu))


def test_build_facts_are_read_from_the_file(tmp_path):
    facts = cpu_kernels.read_facts(_facts_file(tmp_path, "avx512", "habc"))
    avx512 = cpu_features.path("build", "avx512").flags
    assert facts == cpu_kernels.BuildFacts("avx512", "habc", avx512)
    bare = tmp_path / "old.so"
    bare.write_bytes(b"\x7fELF no facts here")
    assert cpu_kernels.read_facts(str(bare)) is None


@pytest.mark.parametrize("cpu", sorted(CPUS))
@pytest.mark.parametrize("built_for", ["avx512", "avx2", "base"])
def test_a_module_built_elsewhere_runs_here_only_if_this_cpu_has_its_flags(tmp_path, cpu,
                                                                           built_for):
    # A venv copied between machines: the module's build flags against this CPU's, and only a
    # module built for the tag this CPU selects, from these sources, is used; anything else is
    # rebuilt (with a log line naming why).
    flags = _flags(cpu)
    here = cpu_features.select(flags).chosen["build"]
    facts = cpu_kernels.read_facts(_facts_file(tmp_path, built_for, "hsame"))
    why = cpu_kernels.refusal(facts, flags, here, "hsame")
    lacking = sorted(facts.flags - flags)
    if lacking:
        assert "could end in SIGILL" in why and ", ".join(lacking) in why
    elif built_for != here:
        assert f"built as {built_for}/hsame, this CPU and source need {here}/hsame" in why
    else:
        assert why == ""
    assert cpu_kernels.refusal(facts, flags, built_for, "hother") != ""  # other sources: rebuilt
    assert "record no build facts" in cpu_kernels.refusal(None, flags, here, "hsame")


def test_an_avx512_module_on_an_avx2_cpu_is_refused_before_it_is_imported(tmp_path, monkeypatch,
                                                                           caplog):
    so = _facts_file(tmp_path, "avx512", "h" + cpu_kernels.source_hash("avx512"))
    monkeypatch.setattr(cpu_kernels.importlib.util, "find_spec",
                        lambda name: SimpleNamespace(origin=so) if name == cpu_kernels.EXT_MODULE
                        else None)

    def no_import(name):
        raise AssertionError(f"{name} was imported: its static initializers would have run")

    monkeypatch.setattr(cpu_kernels.importlib, "import_module", no_import)
    monkeypatch.setattr(cpu_kernels, "selection", lambda: cpu_features.select(_flags("zen3")))
    with caplog.at_level(logging.INFO, logger="dynaspec"):
        assert cpu_kernels._prebuilt("avx2") is None
    assert "avx512bw, avx512f, avx512vl" in caplog.text and "rebuilding for avx2" in caplog.text


def test_the_loaded_module_records_its_facts_and_takes_only_this_cpus_paths():
    ok, why = cpu_kernels.available()
    if not ok:
        pytest.skip(f"kernels unavailable here: {why}")
    ext, sel = cpu_kernels.extension(), cpu_kernels.selection()
    tag = sel.chosen["build"]
    assert cpu_kernels.read_facts(ext.__file__) == cpu_kernels.BuildFacts(
        tag, "h" + cpu_kernels.source_hash(tag), sel.build.flags)
    # the paths the C++ side switches at run time: every int8_gemm and attention path (the
    # attention's AVX-512 rows too, where compiled in), the others' vector ones
    runtime = {f"{k}.{p.name}" for k, paths in cpu_features.KERNELS.items() for p in paths
               if k in ("int8_gemm", "attention") or (k != "build" and not p.build and p.flags)}
    assert set(ext.cpu_paths()) == runtime & set(sel.allowed())
    assert int8_dot.ISA_NAMES[ext.int8_gemm_isa()] == sel.chosen["int8_gemm"]
    with pytest.raises(RuntimeError, match="no kernel path int8_gemm.amx"):
        ext.set_cpu_paths(["int8_gemm.amx"], "scalar")
    assert set(ext.cpu_paths()) == runtime & set(sel.allowed())  # a refused set changes nothing
