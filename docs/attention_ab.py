"""Paged attention, before against after: the module built at install (dynaspec._cpu_kernels,
from the last `pip install -e .`) against this tree's sources (JIT-built when they differ).
Times one step's 30 layers of SmolLM2-135M heads (9 query, 3 KV, dim 64, bf16) per (batch,
context, query tokens per request), best of 3, on random fragmented block tables."""
import importlib, sys, time, torch
from dynaspec import cpu_kernels
new = cpu_kernels.extension()
old = importlib.import_module("dynaspec._cpu_kernels")
torch.set_num_threads(2)
H, Hkv, D, BS = 9, 3, 64, 16
def setup(B, C, W, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = (C + BS - 1) // BS
    slots = B * nb * BS + BS
    # One cache per layer, as a model has: a step streams all 30 layers' KV from memory.
    kv = [(torch.randn(2, slots, Hkv, D, generator=g) * 0.5).bfloat16() for _ in range(30)]
    tables = torch.randperm(B * nb, generator=g).reshape(B, nb).long()
    ctx = torch.full((B,), C, dtype=torch.long)
    qlen = torch.full((B,), W, dtype=torch.long)
    qstart = torch.arange(B, dtype=torch.long) * W
    q = torch.randn(B * W, H, D, generator=g).bfloat16()
    return q, kv, tables, ctx, qstart, qlen
def t(ext, args, reps):
    q, kvs, rest = args[0], args[1], args[2:]
    out = torch.empty_like(q)
    def f():
        for kv in kvs:
            ext.paged_decode(q, kv, *rest, BS, D ** -0.5, out)
    for _ in range(2): f()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps): f()
        ts.append((time.perf_counter() - t0) / reps)
    return min(ts) * 1e3, out
cases = [(1,128,1),(1,400,1),(1,128,5),(1,1024,1),(32,128,1),(32,400,1),(16,256,16),(8,256,256)]
for B, C, W in cases:
    args = setup(B, C, W)
    reps = max(2, int(1000 / (B * C * W)))
    to, oo = t(old, args, reps)
    tn, on = t(new, args, reps)
    err = (oo.float() - on.float()).abs().max().item()
    print(f"B={B:2d} C={C:4d} W={W:3d}: old {to:8.2f} ms  new {tn:8.2f} ms  new/old {tn/to:.2f}  max|diff| {err:.3g}", flush=True)
