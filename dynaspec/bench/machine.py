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
    mask = cpu_features.mask()
    record = {
        "cpu_model": cpu_features.cpu_model_name() or platform.processor() or None,
        "machine": platform.machine(),
        "cpu_flags": sorted(sel.flags),
        # $DYNASPEC_CPU_FLAGS: the CPU was masked as another (cpu_features.mask), so its paths
        # are that CPU's, not this one's
        "cpu_flags_mask": None if mask is None else sorted(mask),
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



def _cpu_ticks() -> tuple[int, int, int] | None:
    """(all, idle, stolen) clock ticks of every CPU since boot (/proc/stat); None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(v), v[3] + v[4], v[7]  # idle + iowait; steal


def _own_ticks() -> float:
    t = os.times()
    return (t.user + t.system) * os.sysconf("SC_CLK_TCK")


class LoadMeter:
    """How busy the machine was with others' work while a benchmark ran: the share of all CPUs'
    time the hypervisor gave elsewhere (steal) and the share other processes ran (busy time not
    this process's). A run whose numbers disagree with the next one's can then be told apart
    from one that ran beside a neighbour. The tick readers are parameters for the tests."""

    def __init__(self, ticks=_cpu_ticks, own=_own_ticks) -> None:
        self._ticks, self._own = ticks, own
        self.start, self.own = ticks(), own()

    def read(self) -> dict | None:
        """{"steal_pct", "others_busy_pct"} since the meter started; None off Linux."""
        end = self._ticks()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        total, idle, steal = (e - s for e, s in zip(end, self.start))
        others = total - idle - steal - (self._own() - self.own)
        return {"steal_pct": round(100 * steal / total, 2),
                "others_busy_pct": round(100 * max(others, 0) / total, 2)}
