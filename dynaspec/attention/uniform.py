"""Fixed-shape decode/verify attention: the backend behind the compiled and CUDA-graph paths.

Every request has exactly `width` query tokens (1+k; fewer real drafts are padded with -1 by the
runner) and the batch is padded to a bucket of `num_reqs_padded` rows, so q/k/v, the slot
mapping and the context lengths have shapes that depend only on (bucket, width). The block
table is a [B_pad, num_blocks] view of the runner's persistent buffer and is read in place:
the cache is indexed by whole blocks ([num_blocks, block_size, Hkv, D] view), never copied into
a per-request tensor outside the step. The mask comes from the context-length tensor inside
`forward`, so a longer context changes no tensor that `torch.compile` specialises on except the
block-table width, which the compiled path marks dynamic (or pins to the maximum for CUDA graphs).

Padded rows point every block at the scratch block and have context `width`: they write and
read only scratch slots, and their outputs are finite and never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynaspec.attention.backend import AttentionBatch

# A block-table view is never narrower than this: torch.compile specialises sizes 0 and 1, so a
# one-block table would be a second graph for every shape.
MIN_BLOCKS = 2


@dataclass
class DecodeMetadata:
    slot_mapping: torch.Tensor  # [B_pad * W] long: slot each new K/V is written to
    block_tables: torch.Tensor  # [B_pad, NB] long: block ids, scratch past a request's blocks
    context_lens: torch.Tensor  # [B_pad] long: tokens in KV after this step's write
    block_size: int
    width: int


class UniformDecodeBackend:
    name = "uniform"

    def __init__(self, pin_blocks: bool = False) -> None:
        # CUDA graphs need every shape fixed: pin the block-table view to the buffer's width.
        self.pin_blocks = pin_blocks

    def supports(self, batch: AttentionBatch) -> bool:
        w, n = batch.width, batch.num_reqs_padded
        return (w is not None and n is not None and batch.buffers is not None
                and len(batch.query_lens) <= n and all(q == w for q in batch.query_lens))

    def build_metadata(self, batch: AttentionBatch) -> DecodeMetadata:
        if not self.supports(batch):
            raise ValueError(
                "uniform attention needs a fixed-shape batch: width, num_reqs_padded, "
                f"buffers and every query length == width (got {list(batch.query_lens)}, "
                f"width {batch.width}, padded {batch.num_reqs_padded})"
            )
        buf, bs, W, B = batch.buffers, batch.block_size, batch.width, batch.num_reqs_padded
        assert buf is not None and W is not None and B is not None  # supports() checked them
        max_blocks = buf.block_tables.shape[1]
        need = max((-(-c // bs) for c in batch.context_lens), default=1)
        if need > max_blocks:
            raise ValueError(f"context of {max(batch.context_lens)} tokens needs {need} blocks, "
                             f"the buffers hold {max_blocks}")
        nb = max_blocks if self.pin_blocks else min(max_blocks, max(MIN_BLOCKS, need))
        rows = [
            list(t[:nb]) + [buf.scratch_block] * (nb - min(nb, len(t))) for t in batch.block_tables
        ]
        rows += [[buf.scratch_block] * nb] * (B - len(rows))
        tables = buf.block_tables[:B, :nb]
        tables.copy_(torch.tensor(rows, dtype=torch.long))
        ctx = buf.context_lens[:B]
        ctx.copy_(torch.tensor(list(batch.context_lens) + [W] * (B - len(batch.context_lens)),
                               dtype=torch.long))
        pos = ctx[:, None] - W + torch.arange(W, device=ctx.device)  # [B, W] absolute positions
        slots = tables.gather(1, pos // bs) * bs + pos % bs  # [B, W]
        slot_mapping = buf.slot_mapping[: B * W]
        slot_mapping.copy_(slots.reshape(-1))
        return DecodeMetadata(slot_mapping, tables, ctx, bs, W)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: DecodeMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        return uniform_attention(q, k, v, kv_cache, md.slot_mapping, md.block_tables,
                                 md.context_lens, md.block_size, md.width, scale, window)


def uniform_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, block_size: int, width: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """q: [B*W, H, D]; k, v: [B*W, Hkv, D]; kv_cache: [2, S, Hkv, D]. Returns [B*W, H, D].
    window: a query at position p sees keys max(0, p - window + 1)..p (None: all up to p)."""
    # index_put_ on the cache itself, not index_copy_ on the kv_cache[0] view: compiled, a
    # mutated view is functionalised into a copy of the whole cache every step (measured:
    # 1.8 s per step for a 1 GiB pool), while index_put_ on the input is written in place.
    which = torch.zeros_like(slot_mapping)
    kv_cache.index_put_((which, slot_mapping), k)
    kv_cache.index_put_((which + 1, slot_mapping), v)
    B, NB = block_tables.shape
    W, H, D = width, q.shape[1], q.shape[2]
    Hkv = k.shape[1]
    G, C = H // Hkv, NB * block_size
    blocks = kv_cache.view(2, -1, block_size, Hkv, D)  # [2, num_blocks, bs, Hkv, D]
    kb = blocks[0][block_tables].view(B, C, Hkv, D).transpose(1, 2)  # [B, Hkv, C, D]
    vb = blocks[1][block_tables].view(B, C, Hkv, D).transpose(1, 2)
    # The G query heads sharing a KV head are packed into the query axis (as the eager backend
    # does): SDPA sees [B, Hkv, W*G, D] against [B, Hkv, C, D].
    qp = q.view(B, W, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, W * G, D)
    q_pos = context_lens[:, None] - W + torch.arange(W, device=q.device)  # [B, W]
    k_pos = torch.arange(C, device=q.device)[None, None, :]
    mask = k_pos <= q_pos[:, :, None]  # [B, W, C]
    if window is not None:  # a Python int: a compiled graph specialises on it, per layer kind
        mask = mask & (k_pos > q_pos[:, :, None] - window)
    mask = mask[:, None, :, None, :].expand(B, 1, W, G, C).reshape(B, 1, W * G, C)
    o = F.scaled_dot_product_attention(qp, kb, vb, attn_mask=mask, scale=scale)  # [B, Hkv, W*G, D]
    return o.view(B, Hkv, W, G, D).permute(0, 2, 1, 3, 4).reshape(B * W, H, D)
