"""The proposer protocol: what every drafter returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from dynaspec.request import Request


@dataclass
class Drafts:
    """Per request, in the order of the requests passed to `propose`.

    "No draft" is an empty list, never a filler token id.
    """

    token_ids: list[list[int]]  # per request, len <= k_i
    # Per request draft distribution [len_i, vocab] (float32), or None for a deterministic
    # drafter (n-gram), which the rejection sampler treats as one-hot.
    probs: list[torch.Tensor | None] | None
    # Per request: why it has no drafts ("no_match", ...), None when it has drafts or k_i == 0.
    skip_reasons: list[str | None]


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int]) -> Drafts: ...

    def forget(self, request_id: str) -> None:
        """Drop the request's state (buffers, drafter KV); called when it finishes, is aborted
        or preempted. Unknown ids are ignored."""
        ...

    def preempt(self, request_id: str) -> None:
        """The request was preempted and will be recomputed: drop what it holds (drafter KV).
        Drafters that keep finished outputs (the suffix cache) keep nothing from it here."""
        ...

    def num_cached(self) -> int:
        """Requests it holds state for (0 once every request is forgotten: leak checks)."""
        ...
