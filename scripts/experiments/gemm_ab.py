"""int8 gemm, before against after (as
scripts/experiments/attention_ab.py): the module built at install against
this tree's sources, on SmolLM2-135M's shapes with Q4_1-like weights, per row count M; prints
ms per call summed over one layer's matrices, GMAC/s, and whether the outputs are bit-identical."""

import importlib
import os
import sys
import time

import torch

from dynaspec import cpu_kernels
from dynaspec.models.int8_dot import pack
from dynaspec.models.quant import quantize_int4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down (N, K)


def main() -> None:
    torch.set_num_threads(2)
    exts = {"old": importlib.import_module("dynaspec._cpu_kernels"),
            "new": cpu_kernels.extension()}
    ms = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,5,16,64,512,2048").split(",")]
    g = torch.Generator().manual_seed(0)
    # DYNASPEC_GEMM_LAYERS=30: that many layers of distinct weights, so they stream from memory
    # as the real model's do (one layer's 1.8 MB stays in cache and hides memory time).
    layers = int(os.environ.get("DYNASPEC_GEMM_LAYERS", "1"))
    mats = []
    for n, k in SHAPES * layers:
        packed, scales, mins, bits = pack(quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32))
        mats.append((n, k, packed, scales, mins, bits, scales.float(),
                     None if mins is None else mins.float()))

    def run(ext, x: torch.Tensor, m: tuple) -> torch.Tensor:
        n, _, packed, scales, mins, bits = m[:6]
        if os.environ.get("DYNASPEC_GEMM_OLD_FP32") and ext is exts["old"]:
            # the old arm predates fp16 scales: the same values as fp32 (cached below)
            scales, mins = m[6], m[7]
        return ext.int8_gemm(x, packed, scales, mins, n, 32, bits, -1)

    for rows in ms:
        xs = [torch.randn(rows, k, generator=g).bfloat16() for (_, k, *_) in mats]
        best = {}
        for name in ("old", "new") * 2:
            for x, m in zip(xs, mats):
                run(exts[name], x, m)
            reps = max(3, 4000 // rows // layers)
            t0 = time.perf_counter()
            for _ in range(reps):
                for x, m in zip(xs, mats):
                    run(exts[name], x, m)
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / reps)
        same = all(torch.equal(run(exts["old"], x, m), run(exts["new"], x, m))
                   for x, m in zip(xs, mats))
        macs = sum(rows * n * k for (n, k, *_) in mats)
        o, nw = best["old"], best["new"]
        print(f"M={rows:5d}: old {o * 1e3:8.3f} ms ({macs / o / 1e9:5.0f} GMAC/s)  "
              f"new {nw * 1e3:8.3f} ms ({macs / nw / 1e9:5.0f} GMAC/s)  new/old {nw / o:.2f}  "
              f"identical {same}")


if __name__ == "__main__":
    main()
