"""Paged attention, before against after: the module built at install (dynaspec._cpu_kernels,
from the last `pip install -e .`) against this tree's sources (JIT-built when they differ).
Times one step's 30 layers of SmolLM2-135M heads (9 query, 3 KV, dim 64, bf16) per (batch,
context, query tokens per request), best of 3, on random fragmented block tables, one KV cache
per layer (a step streams all 30 layers' KV from memory)."""

import importlib
import time

import torch

from dynaspec import cpu_kernels

H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
CASES = [(1, 128, 1), (1, 400, 1), (1, 128, 5), (1, 1024, 1), (32, 128, 1), (32, 400, 1),
         (16, 256, 16), (8, 256, 256)]


def setup(batch: int, ctx: int, width: int, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    nb = (ctx + BS - 1) // BS
    slots = batch * nb * BS + BS
    kvs = [(torch.randn(2, slots, HKV, D, generator=g) * 0.5).bfloat16() for _ in range(LAYERS)]
    tables = torch.randperm(batch * nb, generator=g).reshape(batch, nb).long()
    ctx_t = torch.full((batch,), ctx, dtype=torch.long)
    qlen = torch.full((batch,), width, dtype=torch.long)
    qstart = torch.arange(batch, dtype=torch.long) * width
    q = torch.randn(batch * width, H, D, generator=g).bfloat16()  # [T, H, D]
    return q, kvs, (tables, ctx_t, qstart, qlen)


def best_ms(ext, q, kvs, meta, reps: int) -> tuple[float, torch.Tensor]:
    out = torch.empty_like(q)

    def step() -> None:
        for kv in kvs:
            ext.paged_decode(q, kv, *meta, BS, D ** -0.5, out)

    step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        times.append((time.perf_counter() - t0) / reps)
    return min(times) * 1e3, out


def main() -> None:
    torch.set_num_threads(2)
    new = cpu_kernels.extension()
    old = importlib.import_module("dynaspec._cpu_kernels")
    for batch, ctx, width in CASES:
        q, kvs, meta = setup(batch, ctx, width)
        reps = max(2, 1000 // (batch * ctx * width))
        t_old, o_old = best_ms(old, q, kvs, meta, reps)
        t_new, o_new = best_ms(new, q, kvs, meta, reps)
        diff = (o_old.float() - o_new.float()).abs().max().item()
        print(f"B={batch:2d} C={ctx:4d} W={width:3d}: old {t_old:8.2f} ms  new {t_new:8.2f} ms  "
              f"new/old {t_new / t_old:.2f}  max|diff| {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
