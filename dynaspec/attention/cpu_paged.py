"""CPU attention that reads paged KV blocks in place: one C++ kernel for every query row.

The eager backend gathers every request's context into a padded tensor in every layer before
SDPA, and runs decode, verify and prefill rows through differently shaped SDPA calls, so a
token's attention output (and with it every later token) could depend on how wide its step was
or what shared the batch. Here every row, decode, verify or prefill, is attended straight from
the cache by `dynaspec/csrc/paged_decode.cpp` with a fixed per-row order of operations: the same
result whatever the width, the chunking or the batch. The kernel is built for the ISA this CPU
reports (dynaspec/cpu_kernels.py); without it the backend is unavailable (`available()` says
why) and the engine keeps the eager one.

Its paths (`PATHS`, dynaspec/cpu_features.py's "attention") are chosen once per process; `forward`
takes `path=` to force one (PathUnavailable naming the CPU flags a path lacks) and, for the
"scalar" reference, `numerics_of=` to reproduce another path's numerics, so tests run every path
this CPU has against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec import cpu_features, cpu_kernels
from dynaspec.attention.backend import AttentionBatch

# The kernel's AttnPath values (csrc/cpu_paths.h kAttnPaths): a path's index is its number there.
PATHS = ("scalar", "fp32", "avx2", "avx512", "avx512_bf16")


def available() -> tuple[bool, str]:
    return cpu_kernels.available()


def path_index(name: str) -> int:
    """The kernel's number for path `name`, which this CPU and build must be able to run
    (PathUnavailable naming the missing flags otherwise; ValueError for an unknown name)."""
    sel = cpu_kernels.selection()
    cpu_features.require("attention", name, sel.flags, sel.build.flags)
    return PATHS.index(name)


@dataclass
class CpuPagedMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] slot each new K/V is written to
    block_tables: torch.Tensor  # [B, NB] long (pad: block 0, never read)
    context_lens: torch.Tensor  # [B] long: tokens in KV after this step's write
    query_start: torch.Tensor  # [B] long: flat index of each request's first token
    query_lens: torch.Tensor  # [B] long
    block_size: int
    # Token trees (docs/design.md §4c): [T, W] uint8, row j of a request sees its row k where
    # set (causal rows for requests without a tree); None: no tree in the step.
    tree_mask: torch.Tensor | None = None


class CpuPagedBackend:
    """Every row through the in-place C++ kernel."""

    name = "cpu_paged"
    verifies_trees = True  # token-tree rows see only their ancestors (the kernel's tree mask)
    # The kernel windows a tree's row by its depth (its root path's chain position), so trees
    # verify on sliding-window models too (dynaspec/engine/tree_setting.py).
    tree_windows = True

    def __init__(self) -> None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"the cpu_paged attention kernel could not be built: {why}")
        self._op = cpu_kernels.extension().paged_decode
        self._write_kv = cpu_kernels.extension().write_kv

    def supports(self, batch: AttentionBatch) -> bool:
        return batch.device.type == "cpu"

    def build_metadata(self, batch: AttentionBatch) -> CpuPagedMetadata:
        bs = batch.block_size
        slots: list[int] = []
        tables: list[list[int]] = []
        starts: list[int] = []
        pos = 0
        for q, c, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            slots.extend(table[p // bs] * bs + p % bs for p in range(c - q, c))
            tables.append(list(table[: -(-c // bs)]))
            starts.append(pos)
            pos += q
        dev = batch.device
        nb = max((len(t) for t in tables), default=1)
        padded = torch.tensor(
            [t + [0] * (nb - len(t)) for t in tables], dtype=torch.long, device=dev
        )

        def vec(xs) -> torch.Tensor:
            return torch.tensor(list(xs), dtype=torch.long, device=dev)

        return CpuPagedMetadata(vec(slots), padded, vec(batch.context_lens), vec(starts),
                                vec(batch.query_lens), bs, _tree_mask(batch, dev))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: CpuPagedMetadata, scale: float, window: int | None = None,
                path: str | None = None, numerics_of: str | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_slots, Hkv, D]. Returns [T, H, D].
        window: a query at position p sees keys max(0, p - window + 1) .. p. path: force one of
        PATHS (None: this CPU's selected one); numerics_of: with path "scalar", the path whose
        numerics the reference reproduces (it needs no CPU flags of that path)."""
        forced = -1 if path is None else path_index(path)
        if numerics_of is not None and path != "scalar":
            raise ValueError(f"numerics_of={numerics_of!r} is for the scalar reference, "
                             f"not path={path!r}")
        like = -1
        if numerics_of is not None:
            like = PATHS.index(cpu_features.path("attention", numerics_of).name)  # names the paths
        if (
            k.stride(2) == 1
            and k.stride(1) == k.shape[2]
            and v.stride(2) == 1
            and v.stride(1) == v.shape[2]
        ):
            self._write_kv(kv_cache, k, v, md.slot_mapping)  # two index_copy_ calls cost ~50 us
        else:
            kv_cache[0].index_copy_(0, md.slot_mapping, k)
            kv_cache[1].index_copy_(0, md.slot_mapping, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        if md.block_tables.shape[0]:
            self._op(q, kv_cache, md.block_tables, md.context_lens, md.query_start, md.query_lens,
                     md.block_size, scale, out, window or 0, md.tree_mask, forced, like)
        return out


def _tree_mask(batch: AttentionBatch, device: torch.device) -> torch.Tensor | None:
    """[T, W] uint8 of every request's rows (a tree's visibility, else causal), or None."""
    masks = batch.tree_masks
    if masks is None or all(m is None for m in masks):
        return None
    W = max(batch.query_lens)
    out = torch.zeros(sum(batch.query_lens), W, dtype=torch.uint8)
    row = 0
    for q, m in zip(batch.query_lens, masks):
        out[row: row + q, :q] = torch.ones(q, q, dtype=torch.uint8).tril() if m is None else m
        row += q
    return out.to(device)
