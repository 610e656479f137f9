"""The attention backend seam (docs/design.md §6): the model calls an interface, never a kernel.

A backend turns the runner's view of one forward (`AttentionBatch`) into its own metadata once
per step (`build_metadata`), and the model calls `forward` once per layer with that metadata.
Backends are interchangeable: every backend computes the same attention and writes the step's
new K/V into the paged cache at the same slots; they differ only in how they read the cache and
which shapes they accept.

- ``eager``: paged SDPA for any flat mixed batch (prefill chunks beside decodes),
  `dynaspec.attention.paged.EagerPagedBackend`. Always available, always correct.
- ``uniform``: fixed-shape decode/verify, `dynaspec.attention.uniform.UniformDecodeBackend`:
  every request has exactly `width` query tokens and the batch is padded to `num_reqs_padded`
  rows, so its tensor shapes depend only on (batch bucket, width) and `torch.compile` or a CUDA
  graph can be built once per shape. It reads the block table in place from the runner's
  persistent buffers; the context lengths are a tensor, so a longer context never changes a
  shape that is compiled.
- ``cpu_paged``: decode/verify rows of any mix of widths attended straight from the paged cache
  by a small C++ kernel built for this CPU, prefill chunks by SDPA,
  `dynaspec.attention.cpu_paged.CpuPagedBackend`.

KV layout shared by all backends: per layer `kv_cache` is [2, num_slots, Hkv, D]; slot
`block * block_size + offset`. The runner allocates one scratch block past the pool's blocks
(`MetadataBuffers.scratch_block`): padded rows of a fixed-shape step write and read only there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class MetadataBuffers:
    """Persistent per-step metadata tensors, owned by the runner and sized for the largest shape
    in the execution grid; a fixed-shape backend fills a [:rows] view of each in place."""

    block_tables: (
        torch.Tensor
    )  # [max_reqs, max_blocks] long, block ids; pad entries = scratch_block
    context_lens: torch.Tensor  # [max_reqs] long, tokens in KV after this step's write
    slot_mapping: torch.Tensor  # [max_tokens] long, slot of each new K/V
    scratch_block: int  # a KV block no request owns: padded rows write and read only there

    @staticmethod
    def allocate(max_reqs: int, max_blocks: int, max_tokens: int, scratch_block: int,
                 device: torch.device) -> MetadataBuffers:
        def full(*shape: int) -> torch.Tensor:
            return torch.full(shape, scratch_block, dtype=torch.long, device=device)
        return MetadataBuffers(full(max_reqs, max_blocks),
                               torch.zeros(max_reqs, dtype=torch.long, device=device),
                               torch.zeros(max_tokens, dtype=torch.long, device=device),
                               scratch_block)


@dataclass(frozen=True)
class AttentionBatch:
    """The runner's view of one target (or drafter) forward; tokens are flat, request i owns
    `query_lens[i]` consecutive tokens."""

    query_lens: Sequence[int]  # per request: tokens in this forward
    context_lens: Sequence[
        int
    ]  # per request: tokens in KV after this step's write (computed + query)
    block_tables: Sequence[Sequence[int]]  # per request: its KV block ids
    block_size: int
    device: torch.device
    # Fixed-shape steps only (a uniform BatchDescriptor): every real request's query length is
    # `width`, rows past len(query_lens) up to `num_reqs_padded` are padding. None = ragged.
    num_reqs_padded: int | None = None
    width: int | None = None
    buffers: MetadataBuffers | None = None  # where a fixed-shape backend writes its metadata
    # Token trees (docs/design.md §4c): per request, [q, q] bool over its query rows (True = the
    # row attends to that row's key), or None for the causal order. None: every row causal.
    tree_masks: Sequence[torch.Tensor | None] | None = None


@runtime_checkable
class AttentionBackend(Protocol):
    """What the model calls. `build_metadata` runs once per step, `forward` once per layer."""

    name: str

    def supports(self, batch: AttentionBatch) -> bool:
        """Whether this backend can run the batch (e.g. a fixed-shape one needs `width`)."""
        ...

    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Backend-specific metadata: a dataclass of tensors (and ints) shared by all layers.
        It must carry `slot_mapping` ([num_tokens] long) for the K/V write."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: Any, scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (this step's new keys/values, already rotated);
        kv_cache: [2, num_slots, Hkv, D]. Writes k/v at md.slot_mapping, then attends every
        query to its request's context (causal within the step). Returns [T, H, D].
        window (sliding-window layers, Gemma-3): a query at absolute position p sees only keys
        max(0, p - window + 1)..p. The cache still holds every position, so prefix caching and
        speculative rollback need nothing special."""
        ...


def get_backend(name: str, **kwargs) -> AttentionBackend:
    """The backend registered under `name` in `dynaspec.registry.ATTENTION_BACKENDS`."""
    from dynaspec.registry import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS.load(name)(**kwargs)


def backend_names() -> tuple[str, ...]:
    from dynaspec.registry import ATTENTION_BACKENDS

    names = ("eager", "uniform", "cpu_paged", "gpu_paged")
    return tuple(n for n in names if n in ATTENTION_BACKENDS)
