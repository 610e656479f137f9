"""GPU attention that reads paged KV blocks in place, for any batch and for captured graphs.

Every row, decode, verify or prefill, is attended from the cache by one Triton kernel
(`dynaspec.attention.triton_paged`) that walks its request's block table for exactly its context,
with a fixed per-row order of operations: the same result whatever the width, the chunking or
the batch (the GPU counterpart of `cpu_paged`). The step's new K/V go in with one launch per layer.

Two ways to build the metadata, one kernel:
- ragged (eager) steps: tensors built once per step from the runner's lists, one host-to-device
  copy each, shared by every layer (no per-layer host work or sync);
- fixed-shape steps (a uniform `AttentionBatch` with buffers: the CUDA-graph path): the
  runner's persistent buffers are filled in place, the block table only as wide as this step
  needs (the kernel never reads a column past a row's context, so older columns are harmless),
  and the slot mapping is derived on the device from the context lengths, inside the graph.

Needs Triton (it ships with torch's CUDA wheels); on the CPU only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dynaspec.attention.backend import AttentionBatch


def available(device: torch.device) -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed (it ships with torch's CUDA wheels)"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, (f"the Triton kernel runs on CUDA (device {device.type}; "
                   "TRITON_INTERPRET=1 on the CPU)")


@dataclass
class GpuPagedMetadata:
    slot_mapping: torch.Tensor  # [T] long: slot of each new K/V
    block_tables: torch.Tensor  # [B, NB] long (pad columns: never read)
    context_lens: torch.Tensor  # [B] long: tokens in KV after this step's write
    query_start: torch.Tensor  # [B] long: flat index of each request's first token
    query_lens: torch.Tensor  # [B] long
    max_query_len: int  # host bound on query_lens: the kernel's grid
    block_size: int


def fixed_metadata(block_tables: torch.Tensor, context_lens: torch.Tensor, width: int,
                   block_size: int) -> GpuPagedMetadata:
    """A fixed-shape step's metadata from its (device) block table [B, NB] and context lengths
    [B], computed with device ops only, so it can be captured in a CUDA graph."""
    B = context_lens.shape[0]
    ar = torch.arange(width, device=context_lens.device)
    pos = context_lens[:, None] - width + ar  # [B, W] absolute positions of the new tokens
    slots = block_tables.gather(1, pos // block_size) * block_size + pos % block_size
    qstart = torch.arange(B, device=context_lens.device) * width  # [B]
    qlens = torch.full_like(context_lens, width)
    return GpuPagedMetadata(slots.reshape(-1), block_tables, context_lens, qstart, qlens, width,
                            block_size)


class GpuPagedBackend:
    """Every row through the in-place Triton kernel; ragged or fixed-shape steps."""

    name = "gpu_paged"

    def __init__(self) -> None:
        ok, why = available(torch.device("cuda"))
        if not ok:
            raise RuntimeError(f"the gpu_paged attention backend is unavailable: {why}")
        from dynaspec.attention import triton_paged

        self._k = triton_paged

    def supports(self, batch: AttentionBatch) -> bool:
        return batch.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def build_metadata(self, batch: AttentionBatch) -> GpuPagedMetadata:
        if batch.width is not None and batch.buffers is not None:
            return self._build_fixed(batch)
        bs, pos, nb = batch.block_size, 0, 1
        slots: list[int] = []
        starts: list[int] = []
        for q, c, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            slots.extend(table[p // bs] * bs + p % bs for p in range(c - q, c))
            starts.append(pos)
            pos += q
            nb = max(nb, -(-c // bs))
        tables = [list(t[:nb]) + [0] * (nb - min(nb, len(t))) for t in batch.block_tables]
        # One pinned host tensor, one copy: slots | tables | ctx | starts | qlens.
        B, T = len(tables), len(slots)
        flat = slots + [x for t in tables for x in t] + list(batch.context_lens) + starts \
            + list(batch.query_lens)
        host = torch.tensor(flat, dtype=torch.long)
        if batch.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(batch.device, non_blocking=True)
        o = T + B * nb
        return GpuPagedMetadata(dev[:T], dev[T:o].view(B, nb), dev[o:o + B],
                                dev[o + B:o + 2 * B], dev[o + 2 * B:o + 3 * B],
                                max(batch.query_lens, default=1), bs)

    def _build_fixed(self, batch: AttentionBatch) -> GpuPagedMetadata:
        tables, ctx = self.fill_fixed(batch)
        assert batch.width is not None  # build_metadata's condition
        return fixed_metadata(tables, ctx, batch.width, batch.block_size)

    def fill_fixed(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the persistent buffers' [:B] rows in place (pad rows attend the scratch block);
        returns the views (block tables [B, max_blocks], context lengths [B]), whose addresses
        never change, as a captured graph needs."""
        buf, bs, W, B = batch.buffers, batch.block_size, batch.width, batch.num_reqs_padded
        if buf is None or W is None or B is None:
            raise ValueError("fixed-shape attention needs the batch's buffers, width and "
                             "num_reqs_padded")
        if len(batch.query_lens) > B or any(q != W for q in batch.query_lens):
            raise ValueError(f"fixed-shape attention ({B} x {W}) got query lengths "
                             f"{list(batch.query_lens)}")
        max_blocks = buf.block_tables.shape[1]
        # Pad rows (context W) must find the scratch block in every column they read.
        need = max([-(-c // bs) for c in batch.context_lens] + [-(-W // bs)])
        if need > max_blocks:
            raise ValueError(f"context of {max(batch.context_lens)} tokens needs {need} blocks, "
                             f"the buffers hold {max_blocks}")
        n = len(batch.context_lens)
        rows = [list(t[:need]) + [buf.scratch_block] * (need - min(need, len(t)))
                for t in batch.block_tables]
        rows += [[buf.scratch_block] * need] * (B - n)
        ctx = list(batch.context_lens) + [W] * (B - n)
        host = torch.tensor(ctx + [x for r in rows for x in r], dtype=torch.long)
        if batch.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(batch.device, non_blocking=True)
        buf.context_lens[:B].copy_(dev[:B])
        buf.block_tables[:B, :need].copy_(dev[B:].view(B, need))
        return buf.block_tables[:B], buf.context_lens[:B]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: GpuPagedMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_slots, Hkv, D]. Returns [T, H, D]."""
        self._k.write_kv(kv_cache, k, v, md.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._k.paged_attention(q, kv_cache, out, md.block_tables, md.context_lens,
                                md.query_start, md.query_lens, md.max_query_len, md.block_size,
                                scale, window)
        return out
