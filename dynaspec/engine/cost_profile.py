"""Start-up profile of the target's step cost over (requests, context, verify width).

Runs the real forward (metadata build, model, greedy pick of every verified row) on synthetic
decode/verify batches and returns a ``StepCostModel``. It runs before any request exists, so it
may write KV slots freely: every synthetic request aliases the same first blocks of the pool,
which keeps a batch-64 x ctx-1024 shape within any pool that holds one such request.
"""

from __future__ import annotations

import logging
import time

import torch

from dynaspec.attention.backend import AttentionBatch
from dynaspec.models.llama import LlamaModel
from dynaspec.spec_decode.cost_model import CostGrid, StepCostModel

log = logging.getLogger("dynaspec")


def _step_seconds(model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                  num_blocks: int, batch: int, ctx: int, width: int, reps: int) -> float:
    ctx = min(ctx, num_blocks * block_size - width)  # the pool bounds the context we can fake
    blocks = list(range(-(-(ctx + width) // block_size)))
    qlens, clens = [width] * batch, [ctx + width] * batch
    ids = torch.zeros(batch * width, dtype=torch.long, device=model.device)  # [T]
    pos = torch.arange(ctx, ctx + width, device=model.device).repeat(batch)  # [T]
    rows = torch.arange(batch * width, device=model.device)  # [T]: every verified row
    best = float("inf")
    for i in range(reps + 1):  # run 0 warms caches and oneDNN primitives, not timed
        t0 = time.perf_counter()
        md = model.attn.build_metadata(AttentionBatch(qlens, clens, [blocks] * batch, block_size,
                                                      model.device))
        model.forward(ids, pos, kv_caches, md, rows).argmax(dim=-1).tolist()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def profile_step_costs(model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                       num_blocks: int, grid: CostGrid, reps: int = 2) -> StepCostModel:
    t0 = time.perf_counter()
    seconds = [[[_step_seconds(model, kv_caches, block_size, num_blocks, b, c, w, reps)
                 for w in grid.widths] for c in grid.contexts] for b in grid.batches]
    cost = StepCostModel(grid, seconds, source="measured at start-up")
    log.info("step cost profile: %d shapes in %.1f s", len(grid.batches) * len(grid.contexts)
             * len(grid.widths), time.perf_counter() - t0)
    return cost
