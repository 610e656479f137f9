"""Microbenchmark of the CPU matmul candidates for verification on the default model's shapes.

ms per call (median of rounds), 2 threads, M = 1..16 rows, each matrix rotated over 30 copies
(one per layer; the lm_head over 2) so weights stream from memory as in a real step:
- int4: torch's `_weight_int4pack_mm_for_cpu` (bf16 activations), the wave-2 path;
- bf16: oneDNN prepacked bf16 linear;
- _int_mm: torch's u8s8 `torch._int_mm` on pre-quantized int8 activations (quantization and
  rescale not included; int8 weights: twice the bytes of 4-bit);
- torchao: 0.18 `Int8DynamicActivationInt8WeightConfig` on nn.Linear (if importable, e.g.
  PYTHONPATH=/tmp/taolib), activation quantization included;
- int8dot: dynaspec's kernel (csrc/int8_gemm.cpp), 4-bit weights, activation quantization included.
Run on an idle machine: python scripts/experiments/kernel_candidates.py
"""

from __future__ import annotations

import statistics
import time

import torch

from dynaspec.models.int8_dot import Int8DotLinear
from dynaspec.models.layers import Linear
from dynaspec.models.quant import quantize_int4
from dynaspec.models.quant_linear import Int4Linear

SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}
MS = (1, 2, 4, 5, 8, 9, 16)


def _torchao_linear(w: torch.Tensor):
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
    lin.weight.data.copy_(w)
    try:
        quantize_(lin, Int8DynamicActivationInt8WeightConfig())
        lin(torch.randn(1, w.shape[1], dtype=torch.bfloat16))
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"
    return lin, ""


def _time(fns, xs, rounds=7, reps=10) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(reps):
            fns[i % len(fns)](xs[i % len(xs)])
        samples.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(samples)


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    rows = []
    ao_note = ""
    for name, (n, k) in SHAPES.items():
        copies = 2 if n > 10000 else 30
        ws = [torch.randn(n, k, generator=g) * 0.05 for _ in range(copies)]
        q4 = [quantize_int4(w) for w in ws]
        arms = {"int4": [Int4Linear(q, None) for q in q4],
                "bf16": [Linear(w.to(torch.bfloat16).contiguous()) for w in ws],
                "int8dot": [Int8DotLinear(q, None) for q in q4]}
        w8 = [
            (w / (w.abs().amax(1, keepdim=True) / 127))
            .round()
            .clamp(-127, 127)
            .to(torch.int8)
            .t()
            .contiguous()
            for w in ws
        ]
        arms["_int_mm"] = [(lambda x, w=w: torch._int_mm(x, w)) for w in w8]
        ao = [_torchao_linear(w.to(torch.bfloat16)) for w in ws[:copies]]
        if all(a[0] is not None for a in ao):
            arms["torchao"] = [a[0] for a in ao]
        else:
            ao_note = next(a[1] for a in ao if a[0] is None)
        for m in MS:
            xb = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _ in range(4)]
            xi = [
                torch.randint(-127, 128, (max(m, 17), k), generator=g, dtype=torch.int8)[
                    :m
                ].contiguous()
                for _ in range(4)
            ]
            row = {"shape": name, "M": m}
            for arm, fns in arms.items():
                for f in fns[:2]:
                    f(xi[0] if arm == "_int_mm" else xb[0])
                try:
                    row[arm] = _time(fns, xi if arm == "_int_mm" else xb)
                except RuntimeError as exc:
                    row[arm] = float("nan")
                    ao_note = ao_note or f"{arm}: {exc}"
            rows.append(row)
            print(row, flush=True)
    arms = [a for a in ("int4", "bf16", "_int_mm", "torchao", "int8dot") if a in rows[0]]
    print("\n| matmul | M | " + " | ".join(arms) + " |")
    print("|---|---|" + "---|" * len(arms))
    for r in rows:
        print(f"| {r['shape']} | {r['M']} | " + " | ".join(f"{r[a]:.3f}" for a in arms) + " |")
    if ao_note:
        print(f"\ntorchao not measured: {ao_note}")


if __name__ == "__main__":
    main()
