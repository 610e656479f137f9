"""CPU attention that reads paged KV blocks in place: a small C++ kernel for decode/verify rows.

The eager backend gathers every short request's whole context into a padded [B, Hkv, C, D]
tensor in every layer before SDPA (a batch-16 step at context 1024 measured 3x the context-128
step). Here decode rows (up to KERNEL_MAX_QUERY query tokens, any mix of widths) are attended
straight from the cache by `dynaspec/csrc/paged_decode.cpp`; wider verify rows keep the eager padded
group and long prefill chunks the eager SDPA path. The kernel is built on first use on the machine that runs it, for the ISA it reports
(dynaspec/cpu_kernels.py); without a compiler the backend is unavailable (`available()` says
why) and the engine keeps the eager one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dynaspec import cpu_kernels
from dynaspec.attention.backend import AttentionBatch, register_backend
from dynaspec.attention.paged import (
    SHORT_QUERY_MAX, LongSeq, ShortGroup, _build_short, _short_attention, _slots, long_attention,
)

log = logging.getLogger("dynaspec")
# Rows with at most this many query tokens go to the kernel. Its scores are one dot product per
# (query row, key); measured here (1 thread, under load) it beats the gather+SDPA path 2-2.5x
# at width 1 and ~1.2x at width 3, and loses 1.2-3x from width 5, where SDPA's blocked GEMM wins.
# Wider rows (verifies of 4..SHORT_QUERY_MAX tokens) keep the eager padded-gather group.
KERNEL_MAX_QUERY = 3


def available() -> tuple[bool, str]:
    return cpu_kernels.available()


@dataclass
class CpuPagedMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] slot each new K/V is written to
    block_tables: torch.Tensor | None  # [B, NB] long, short requests only (pad: block 0, never read)
    context_lens: torch.Tensor | None  # [B] long: tokens in KV after this step's write
    query_start: torch.Tensor | None  # [B] long: flat index of each short request's first token
    query_lens: torch.Tensor | None  # [B] long
    block_size: int
    long: list[LongSeq]
    short: ShortGroup | None = None  # verify rows wider than KERNEL_MAX_QUERY (eager gather + SDPA)


class CpuPagedBackend:
    """Decode/verify rows through the in-place C++ kernel, prefill chunks through SDPA."""

    name = "cpu_paged"

    def __init__(self) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"the cpu_paged attention kernel could not be built: {why}")
        self._op = cpu_kernels.extension().paged_decode

    def supports(self, batch: AttentionBatch) -> bool:
        return batch.device.type == "cpu"

    def build_metadata(self, batch: AttentionBatch) -> CpuPagedMetadata:
        bs, slots, long = batch.block_size, [], []
        tables, ctxs, starts, qlens, wide, all_starts = [], [], [], [], [], []
        pos = 0
        for i, (q, c, table) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
            slots.extend(table[p // bs] * bs + p % bs for p in range(c - q, c))
            all_starts.append(pos)
            if KERNEL_MAX_QUERY < q <= SHORT_QUERY_MAX:
                wide.append(i)
            elif q <= KERNEL_MAX_QUERY:
                tables.append(list(table[: -(-c // bs)]))
                ctxs.append(c), starts.append(pos), qlens.append(q)
            else:
                kv = None if q == c else _slots(list(table), c, bs, batch.device)
                long.append(LongSeq(pos, q, c, kv))
            pos += q
        dev = batch.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        short = None
        if wide:
            short = _build_short(wide, all_starts, list(batch.query_lens), list(batch.context_lens),
                                 [list(t) for t in batch.block_tables], bs, dev)
        if not tables:
            return CpuPagedMetadata(slot_mapping, None, None, None, None, bs, long, short)
        nb = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long, device=dev)

        def vec(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long, device=dev)

        return CpuPagedMetadata(slot_mapping, padded, vec(ctxs), vec(starts), vec(qlens), bs, long, short)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: CpuPagedMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_slots, Hkv, D]. Returns [T, H, D]."""
        kv_cache[0].index_copy_(0, md.slot_mapping, k)
        kv_cache[1].index_copy_(0, md.slot_mapping, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if md.block_tables is not None:
            self._op(q, kv_cache, md.block_tables, md.context_lens, md.query_start, md.query_lens,
                     md.block_size, scale, out)
        if md.short is not None:
            _short_attention(q, kv_cache, md.short, scale, out)
        long_attention(q, k, v, kv_cache, md.long, scale, out)
        return out


register_backend(CpuPagedBackend.name, CpuPagedBackend)
