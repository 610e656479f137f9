"""A whole batch-1 step of the default model (SmolLM2-135M, 30 layers, cpu_paged attention) at
context 1024, widths 1 / 5 / 9, with the attention's fp32 rows against its avx2 rows in the same
process: the arms alternate round by round (`cpu_kernels.paths_without("attention.avx2")` makes
the fp32 rows the kernel's selected path). Each sample is `dynaspec bench decode --widths`'s
(the median of 5 synthetic verify steps: metadata, forward, argmax of every row); the result is
the median over rounds. The machine is shared: the load average is printed with the numbers.

    python scripts/experiments/attention_step_ab.py [rounds] [threads]

threads: torch's (the default: the engine's own). On a loaded 2-core machine a 2-thread step
waits for a descheduled thread in most of its ~200 parallel regions (1.2 s steps at load 3-4);
one thread measures the work itself.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

from dynaspec import cpu_kernels
from dynaspec.bench.decode import run_widths
from dynaspec.config import EngineConfig
from dynaspec.engine.llm_engine import LLMEngine

CONTEXT, WIDTHS = 1024, [1, 5, 9]


def main(rounds: int, threads: int | None) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(attention_backend="cpu_paged", max_model_len=2048))
    if threads:
        torch.set_num_threads(threads)
    print(f"load {os.getloadavg()[0]:.2f}; threads {torch.get_num_threads()}; selected attention "
          f"path {cpu_kernels.selection().chosen['attention']}")
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for arm in ("fp32", "avx2"):
            if arm == "fp32":
                with cpu_kernels.paths_without("attention.avx2"):
                    res = run_widths(engine, [1], [CONTEXT], WIDTHS, rounds=1)
            else:
                res = run_widths(engine, [1], [CONTEXT], WIDTHS, rounds=1)
            for r in res:
                samples.setdefault((arm, r["width"]), []).append(r["step_ms"])
    for w in WIDTHS:
        a, b = (statistics.median(samples[(arm, w)]) for arm in ("fp32", "avx2"))
        print(f"ctx {CONTEXT} width {w}: fp32 rows {a:6.2f} ms, avx2 rows {b:6.2f} ms "
              f"({a / b:.2f}x); samples fp32 {samples[('fp32', w)]}, avx2 {samples[('avx2', w)]}")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    main(args[0] if args else 3, args[1] if len(args) > 1 else None)
