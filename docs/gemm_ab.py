"""int8 gemm, before against after (as docs/attention_ab.py): the module built at install against
this tree's sources, on SmolLM2-135M's shapes with Q4_1-like weights, per row count M; prints
ms per call summed over one layer's matrices, GMAC/s, and whether the outputs are bit-identical."""
import importlib, sys, time, torch
from dynaspec import cpu_kernels
from dynaspec.models.int8_dot import pack
from dynaspec.models.quant import quantize_int4
new = cpu_kernels.extension()
old = importlib.import_module("dynaspec._cpu_kernels")
torch.set_num_threads(2)
shapes = [(576 * 3 // 2 - 96, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
Ms = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,5,16,64,512,2048").split(",")]
g = torch.Generator().manual_seed(0)
mats = []
for n, k in shapes:
    w = quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32)
    packed, scales, mins, bits = pack(w)
    mats.append((n, k, packed, scales, mins, bits))
def run(ext, x, m):
    n, k, packed, scales, mins, bits = m
    return ext.int8_gemm(x, packed, scales, mins, n, 32, bits, -1)
for M in Ms:
    xs = [torch.randn(M, k, generator=g).bfloat16() for (_, k, *_) in mats]
    res = {}
    for name, ext in (("old", old), ("new", new)) * 2:
        for x, m in zip(xs, mats): run(ext, x, m)
        reps = max(3, int(4000 / M))
        t0 = time.perf_counter()
        for _ in range(reps):
            for x, m in zip(xs, mats): run(ext, x, m)
        res[name] = min(res.get(name, 1e9), (time.perf_counter() - t0) / reps)
    same = all(torch.equal(run(old, x, m), run(new, x, m)) for x, m in zip(xs, mats))
    macs = sum(M * n * k for (n, k, *_) in mats)
    print(f"M={M:5d}: old {res['old']*1e3:8.3f} ms ({macs/res['old']/1e9:5.0f} GMAC/s)  new {res['new']*1e3:8.3f} ms ({macs/res['new']/1e9:5.0f} GMAC/s)  new/old {res['new']/res['old']:.2f}  identical {same}")
