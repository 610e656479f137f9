"""Where a verify step's extra cost goes at widths 5 and 9 (batch 1): the whole step against its
parts timed alone with the step's shapes: the layers' matmuls (int8/int4 weights, w rows),
attention over the context (every layer, w query rows), the head (argmax rows), and the rest
(norms, RoPE, KV writes, the layer stack's glue, Python, sampling's argmax). Every part is timed
interleaved with the others and the widths, median over rounds.
Run on an idle machine: python scripts/experiments/width_profile.py [ctx ...]"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from dynaspec.attention.backend import AttentionBatch
from dynaspec.config import EngineConfig
from dynaspec.engine.llm_engine import LLMEngine
from dynaspec.spec_decode.policy.cost_profile import synthetic_step

WIDTHS = (1, 5, 9)


def parts(m, kv_caches: list, ctx: int, width: int) -> dict:
    """Callables for the step and each of its parts at (batch 1, ctx, width)."""
    step = synthetic_step(m, kv_caches, 16, kv_caches[0].shape[1] // 16, 1, ctx, width)
    mats = [x for layer in m.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    xs = [torch.randn(width, x.in_features).to(m.dtype) for x in mats]
    layer0 = m.layers[0]
    H, Hkv, D = layer0.H, layer0.Hkv, layer0.D
    blocks = list(range(-(-(ctx + width) // 16)))
    md = m.attn.build_metadata(AttentionBatch([width], [ctx + width], [blocks], 16, m.device))
    q = torch.randn(width, H, D).to(m.dtype)
    k, v = torch.randn(width, Hkv, D).to(m.dtype), torch.randn(width, Hkv, D).to(m.dtype)
    h = torch.randn(width, m.norm.shape[0]).to(m.dtype)
    only_argmax = torch.ones(width, dtype=torch.bool)
    return {
        "step": step,
        "matmuls": lambda: [f(x) for f, x in zip(mats, xs)],
        "attention": lambda: [m.attn.forward(q, k, v, c, md, D ** -0.5) for c in kv_caches],
        "head": lambda: m.head(h, only_argmax),
    }


def main(contexts: list[int], rounds: int = 15, reps: int = 10) -> None:
    eng = LLMEngine(EngineConfig.from_kwargs(model="default"))
    p = eng.parts
    m = p.model
    print(f"{torch.get_num_threads()} threads, {len(m.layers)} layers", flush=True)
    for ctx in contexts:
        fns = {w: parts(m, p.runner.kv_caches, ctx, w) for w in WIDTHS}
        times: dict = {(w, n): [] for w in WIDTHS for n in fns[1]}
        for r in range(rounds + 1):  # round 0 warms up
            for name in fns[1]:
                for w in WIDTHS:
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fns[w][name]()
                    if r:
                        times[w, name].append((time.perf_counter() - t0) / reps * 1e3)
        med = {key: statistics.median(t) for key, t in times.items()}
        print(f"ctx {ctx}: ms (width 1 / 5 / 9), and width 9 minus width 1")
        for name in [*fns[1], "rest"]:
            if name == "rest":
                row = [med[w, "step"] - sum(med[w, n] for n in fns[1] if n != "step")
                       for w in WIDTHS]
            else:
                row = [med[w, name] for w in WIDTHS]
            print(f"  {name:<10} " + " / ".join(f"{x:6.2f}" for x in row) +
                  f"   +{row[2] - row[0]:.2f}", flush=True)


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]] or [128, 1024])
