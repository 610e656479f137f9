"""Kernel loading: the install-time build is used, a JIT fallback builds per install and never
waits forever on another process's lock."""

from __future__ import annotations

import fcntl
import os

import pytest

from dynaspec import cpu_kernels


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
