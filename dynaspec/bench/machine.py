"""What machine and build a benchmark ran on, recorded beside its numbers.

Width ratios and step times differ by CPU (AVX2, AVX-VNNI, AVX-512 take different kernel paths)
and by commit, so a result file carries them: two files whose records differ are not one series.
The CPU is read once, through cpu_features (the one reader of /proc/cpuinfo), and the kernel
paths are the ones cpu_kernels chose from those flags.
"""

from __future__ import annotations

import os
import platform
import subprocess

import torch

from dynaspec import cpu_features, cpu_kernels

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(directory: str = _PACKAGE_DIR) -> dict | None:
    """{"commit": HEAD, "dirty": tracked files differ from it} of the checkout holding
    `directory`; None outside a checkout or without git (an installed wheel)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", directory, *args], capture_output=True, text=True,
                              timeout=10, check=False)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": head.stdout.strip(),
            "dirty": dirty.returncode != 0 or bool(dirty.stdout.strip())}


def machine_record(device: torch.device | None = None) -> dict:
    """JSON-ready facts of this machine and build: CPU model and flags, the kernel paths chosen
    for them and whether the kernels are loaded, torch's version, dispatch and threads, the git
    commit; the GPU's name where `device` is a CUDA device."""
    sel = cpu_kernels.selection()
    record = {
        "cpu_model": cpu_features.cpu_model_name() or platform.processor() or None,
        "machine": platform.machine(),
        "cpu_flags": sorted(sel.flags),
        "kernel_paths": dict(sel.chosen),
        # loaded() never builds: a run that never needed the kernels says so instead of paying
        # a build here.
        "kernels_loaded": cpu_kernels.loaded() is not None,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "git": git_commit(),
    }
    if device is not None and device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    return record

