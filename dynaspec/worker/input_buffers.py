"""Persistent input buffers of the runner (docs/design.md §6), sized once for the largest step.

A step copies its token ids, positions, logits rows and attention metadata into views of these
tensors instead of building new ones, so a fixed-shape path (compiled or CUDA graph) always sees
the same storage, and the eager path allocates nothing per step for its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.attention.backend import MetadataBuffers


@dataclass
class InputBuffers:
    input_ids: torch.Tensor  # [max_tokens] long
    positions: torch.Tensor  # [max_tokens] long
    logits_indices: torch.Tensor  # [max_tokens] long
    attn: MetadataBuffers  # block tables [max_reqs, max_blocks], context lens, slot mapping

    @staticmethod
    def allocate(max_tokens: int, max_reqs: int, max_blocks: int, scratch_block: int,
                 device: torch.device) -> InputBuffers:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)
        return InputBuffers(
            zeros(max_tokens),
            zeros(max_tokens),
            zeros(max_tokens),
            MetadataBuffers.allocate(max_reqs, max_blocks, max_tokens, scratch_block, device),
        )

    @property
    def max_tokens(self) -> int:
        return self.input_ids.shape[0]

    def load(self, ids: list[int], positions: list[int], rows: list[int] | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Copy a step's inputs in; returns views (ids [T], positions [T], rows [R] | None)."""
        T = len(ids)
        if T > self.max_tokens:
            raise ValueError(f"step has {T} tokens, the input buffers hold {self.max_tokens}")
        # -1 pads embed as token 0; their rows are never sampled.
        ids_v = self.input_ids[:T]
        ids_v.copy_(torch.tensor(ids, dtype=torch.long).clamp_(min=0))
        pos_v = self.positions[:T]
        pos_v.copy_(torch.tensor(positions, dtype=torch.long))
        if rows is None:
            return ids_v, pos_v, None
        rows_v = self.logits_indices[: len(rows)]
        rows_v.copy_(torch.tensor(rows, dtype=torch.long))
        return ids_v, pos_v, rows_v
