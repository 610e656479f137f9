"""Where a batch-1 decode step's time goes beyond the matmuls: the step with the C++ layer stack,
with the Python layer loop (same kernels), with torch's int4 path, and the matmuls alone.
Run on an idle machine: python scripts/experiments/step_overhead.py"""

from __future__ import annotations

import statistics
import time

import torch

from dynaspec.config import EngineConfig
from dynaspec.engine.llm_engine import LLMEngine
from dynaspec.spec_decode.policy.cost_profile import synthetic_step


def timed(f, rounds: int = 7, reps: int = 30) -> float:
    for _ in range(10):
        f()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        out.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(out)


def main() -> None:
    for kernel in ("int8dot", "torch"):
        eng = LLMEngine(EngineConfig.from_kwargs(model="default", linear_kernel=kernel))
        p = eng.parts
        m = p.model
        for ctx in (128, 1024):
            step = synthetic_step(m, p.runner.kv_caches, 16, p.kv.num_blocks, 1, ctx, 1)
            rows = {"step": timed(step)}
            if kernel == "int8dot":
                stack, m._stack = m._stack, None
                rows["step, Python layer loop"] = timed(step)
                m._stack = stack
            mats = [m.lm_head] + [
                x for layer in m.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)
            ]
            xs = [torch.randn(1, x.in_features).to(torch.bfloat16) for x in mats]
            rows["matmuls only"] = timed(lambda mats=mats, xs=xs: [f(x) for f, x in zip(mats, xs)])
            print(
                kernel,
                f"ctx {ctx}:",
                ", ".join(f"{k} {v:.2f} ms" for k, v in rows.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
