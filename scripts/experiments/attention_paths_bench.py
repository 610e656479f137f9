"""Per-call paged attention time by path, at the default model's shapes (SmolLM2-135M: 9 query
heads, 3 KV heads, dim 64, bf16 KV, block 16), batch 1, context 128 and 1024, 1 / 5 / 9 query
rows per request. One call is one layer (a step is 30 of them, each over its own KV cache, so
a pass streams all 30 layers' KV); min and median per call over 10 passes, with 2 threads and 1.
The machine is shared, so the load average is printed with the numbers.

    PYTHONPATH=<checkout> python scripts/experiments/attention_paths_bench.py [path ...]

No path: the CPU's selected one. Paths this CPU lacks are refused (PathUnavailable)."""

from __future__ import annotations

import os
import sys
import time

import torch

from dynaspec import cpu_kernels
from dynaspec.attention import cpu_paged

H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
CASES = [(128, 1), (128, 5), (128, 9), (1024, 1), (1024, 5), (1024, 9)]  # (context, rows)
REPEATS = 10


def setup(ctx: int, width: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    nb = (ctx + BS - 1) // BS
    slots = nb * BS + BS
    kvs = [(torch.randn(2, slots, HKV, D, generator=g) * 0.5).bfloat16() for _ in range(LAYERS)]
    tables = torch.randperm(nb, generator=g).reshape(1, nb).long()  # fragmented blocks
    meta = (tables, torch.tensor([ctx]), torch.tensor([0]), torch.tensor([width]))
    q = torch.randn(width, H, D, generator=g).bfloat16()  # [T, H, D]
    return q, kvs, meta


def call_us(ext, q, kvs, meta, path: int) -> tuple[float, float]:
    """Min and median of one layer's call over REPEATS passes of the 30 layers, in us. Per call:
    on a shared 2-core machine a step of 30 calls nearly always holds one in which the other
    thread was descheduled for a time slice."""
    out = torch.empty_like(q)
    times = []
    for rep in range(REPEATS + 1):
        for kv in kvs:
            t0 = time.perf_counter()
            ext.paged_decode(q, kv, *meta, BS, D ** -0.5, out, 0, None, path, -1)
            if rep:  # the first pass warms up
                times.append(time.perf_counter() - t0)
    times.sort()
    return times[0] * 1e6, times[len(times) // 2] * 1e6


def main(paths: list[str]) -> None:
    ext = cpu_kernels.extension()
    chosen = cpu_kernels.selection().chosen["attention"]
    paths = paths or [chosen]
    print(f"dynaspec from {os.path.dirname(cpu_kernels.__file__)}; selected path {chosen}; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'path':>6} {'thr':>3} {'ctx':>5} {'rows':>4} {'min us':>8} {'median us':>9}")
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for ctx, width in CASES:
            q, kvs, meta = setup(ctx, width)
            for name in paths:
                lo, mid = call_us(ext, q, kvs, meta, cpu_paged.path_index(name))
                print(f"{name:>6} {threads:>3} {ctx:>5} {width:>4} {lo:8.1f} {mid:9.1f}")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
