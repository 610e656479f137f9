"""Lookup first, head second: an EAGLE head drafts only for requests a lookup drafter cannot.

A lookup drafter (n-gram or suffix) drafts where the context repeats and is then usually right
(held-out code edits: 0.80 of its first drafts accepted), but drafts nothing elsewhere; the head
drafts on every step at a lower rate (0.32 there). Trying the lookup first and handing the head
only the requests it found nothing for keeps both strengths, as Arctic Inference's hybrid of
suffix decoding and a model speculator does. The head still observes every step's hidden states,
so a request it skipped has its pending features caught up in one pass when it next drafts.

Drafts stay deterministic (argmax for the head, lookup for the other), so `probs` is None and
verification treats both as one-hot: lossless as either alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from dynaspec.request import Request
from dynaspec.spec_decode.drafters.base import Drafts, Proposer
from dynaspec.spec_decode.drafters.lookup_head_pair import LookupHeadPair


class LookupFirstProposer(LookupHeadPair):
    has_fallback = True

    def __init__(self, lookup: Proposer, head: Proposer) -> None:
        super().__init__(lookup, head, "lookup-first")

    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int], *,
                fallback_k: Sequence[int] | None = None,
                trees: Sequence[bool] | None = None) -> Drafts:
        head_k = k_per_request if fallback_k is None else fallback_k
        if len(head_k) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(head_k)} fallback k values")
        found = self.lookup.propose(requests, k_per_request)
        from_head = [False] * len(requests)
        rest = [i for i, (d, k) in enumerate(zip(found.token_ids, head_k)) if k > 0 and not d]
        if not rest:
            return replace(found, from_fallback=from_head)
        t0 = time.perf_counter()
        more = self.head.propose([requests[i] for i in rest], [head_k[i] for i in rest])
        head_seconds = time.perf_counter() - t0 - more.setup_seconds
        if more.probs is not None:
            raise ValueError("lookup-first drafting needs a deterministic head (greedy drafts)")
        token_ids, skips = list(found.token_ids), list(found.skip_reasons)
        for i, d, why in zip(rest, more.token_ids, more.skip_reasons):
            token_ids[i], skips[i], from_head[i] = d, why, bool(d)
        return Drafts(token_ids=token_ids, probs=None, skip_reasons=skips,
                      setup_seconds=found.setup_seconds + more.setup_seconds,
                      from_fallback=from_head, fallback_seconds=head_seconds)
