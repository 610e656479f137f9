"""A lookup drafter (n-gram or suffix) paired with a hidden-state head: what every such pair
delegates the same way, so lookup-first chains (lookup_first.py) and the hybrid tree
(hybrid_tree.py) differ only in how they draft. The head owns the model-facing side (its K cap,
the target it attaches to, the hidden states it reads); both keep per-request state, so both
forget and preempt; the lookup owns the global cache (the suffix drafter's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynaspec.spec_decode.drafters.base import DrafterCacheStats, HiddenStates, Proposer

if TYPE_CHECKING:
    from dynaspec.models.llama import LlamaModel


class LookupHeadPair(Proposer):
    reads_hidden_states = True

    def __init__(self, lookup: Proposer, head: Proposer, what: str) -> None:
        """`what`: the drafting's name, for the error when the pair is not a lookup and a head."""
        if lookup.reads_hidden_states or not head.reads_hidden_states:
            raise ValueError(f"{what} drafting pairs a lookup drafter with a hidden-state head")
        self.lookup, self.head = lookup, head

    @property
    def k_limit(self) -> int | None:
        return self.head.k_limit

    def attach(self, model: LlamaModel) -> None:
        self.head.attach(model)

    def observe_hidden(self, hs: HiddenStates) -> None:
        self.head.observe_hidden(hs)

    def forget(self, request_id: str) -> None:
        self.lookup.forget(request_id)
        self.head.forget(request_id)

    def preempt(self, request_id: str) -> None:
        self.lookup.preempt(request_id)
        self.head.preempt(request_id)

    def num_cached(self) -> int:
        return self.lookup.num_cached() + self.head.num_cached()

    def cache_stats(self) -> DrafterCacheStats | None:
        return self.lookup.cache_stats()  # the suffix drafter's global cache, if it is the lookup

    def reset_cache(self) -> None:
        self.lookup.reset_cache()
