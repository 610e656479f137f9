"""Anonymous memory in 2 MB transparent huge pages (CPU, Linux), for the big tensors a step streams.

A step reads all of the packed weights and, in decode, the KV blocks of every running request,
which sit at random places in a pool of ~1 GB. In 4 KB pages each block is a new TLB miss (a
nested page walk in a VM) and the hardware prefetchers stop at every page boundary: c64 decode
attention over a 637 MB pool ran in 0.83x the time with the pool in huge pages
(docs/history/benchmarks-waves-1-4.md, seventeenth session). Where the system refuses huge pages
(THP off, not Linux) callers get ordinary allocations.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14


def thp_allowed() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_block(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """(an anonymous mapping of nbytes + 2 MB, the offset of its first 2 MB boundary), advised
    as huge pages; None where that is refused."""
    if not sys.platform.startswith("linux") or not thp_allowed():
        return None
    block = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(block))
    start = (-addr) % HUGE
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(addr + start), ctypes.c_size_t(nbytes), MADV_HUGEPAGE) != 0:
        return None
    return block, start


def zeros(shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype, device), in huge pages where the device is the CPU and the system
    allows them. Written once here, so every page is faulted in now rather than by a step."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    got = huge_block(nbytes) if nbytes >= HUGE else None
    if got is None:
        return torch.zeros(shape, dtype=dtype)
    block, off = got
    # The tensor keeps the mapping alive.
    t = torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=off)
    return t.view(dtype).view(shape).zero_()
