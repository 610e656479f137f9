"""The proposer protocol: what every drafter returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dynaspec.draft_tree import DraftTree
from dynaspec.request import Request

if TYPE_CHECKING:
    from dynaspec.models.llama import LlamaModel

# Pending tokens a drafter feeds along with a request's drafts; older ones (a prompt, on the
# request's first drafts) are its prefill, fed in a pass of their own and timed as setup.
FRESH_TOKENS = 8


@dataclass(frozen=True)
class HiddenStates:
    """One target forward's hidden states, as an EAGLE-style drafter reads them (runner ->
    proposer)."""

    request_ids: list[str]
    starts: list[int]  # row in `hidden` of each request's first token this step
    positions: list[int]  # that token's position
    num_valid: list[int]  # leading rows whose tokens are verified (accepted drafts included)
    hidden: torch.Tensor  # [T, feature_size] the captured layers, concatenated


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
    # Of the call's seconds, those spent on once-per-request work (a drafter's prefill of a
    # prompt): the goodput policy learns the per-token drafting cost without them.
    setup_seconds: float = 0.0
    # A drafter with a fallback (lookup first, then a head): per request, whether the fallback
    # drafted it, and the fallback's seconds (its setup excluded). The goodput policy keeps the
    # two apart: one history for both priced the lookup's matches at the head's rate.
    from_fallback: list[bool] | None = None
    fallback_seconds: float = 0.0
    # Per request, a draft tree (docs/design.md §4c) whose nodes are token_ids[i] in its order,
    # or None for a chain; None: every draft is a chain. Deterministic drafters only (probs None).
    trees: list[DraftTree | None] | None = None
    # Per request, the source of each of its drafts (in token_ids' order: a tree's nodes), for
    # the metrics' draft/accepted tokens by source (the hybrid's "eagle" / "ngram" / "suffix");
    # None: all of them the drafter's ("drafter").
    sources: list[tuple[str, ...] | None] | None = None


class Proposer:
    """What every drafter implements (`propose`, `forget`, `preempt`, `num_cached`) and the
    optional capabilities it may declare by overriding the defaults below, so the engine asks
    instead of probing attributes."""

    @property
    def k_limit(self) -> int | None:
        """The most tokens it can draft per step (a draft model's context margin); None = no
        limit."""
        return None

    # True when it drafts under the request's grammar (the engine then hands it the manager).
    uses_grammar: bool = False
    # True when it drafts from the target's hidden states (EAGLE): the builder attaches the
    # target and the runner hands it every step's verified rows (`observe_hidden`).
    reads_hidden_states: bool = False
    # True when it sizes its own drafts by its confidence (suffix: a draft ends where its
    # evidence does), so a cap below the plan's only cuts drafts it was sure of: the goodput
    # policy then gives a request its whole cap or none.
    sizes_own_drafts: bool = False
    # True when a second drafter drafts where the first finds nothing (lookup_first.py): it then
    # takes a cap of its own per request (`fallback_k`), which the goodput policy prices apart.
    has_fallback: bool = False
    # True when it can give a token tree under a node budget (ngram/suffix with --draft-tree):
    # `propose` then takes `trees` (per request: a tree, or a chain), which the K policy
    # chooses per request per step (docs/design.md §4c).
    drafts_trees: bool = False

    def measure_draft_cost(self) -> float | None:
        """Its seconds per drafted token at batch 1, timed once at start-up where drafting has
        a cost worth pricing before the first served drafts (an EAGLE head); None: not timed
        (a lookup's cost is negligible until served steps measure it)."""
        return None

    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int], *,
                fallback_k: Sequence[int] | None = None,
                trees: Sequence[bool] | None = None) -> Drafts:
        """Drafts of at most k_per_request[i] tokens per request. A drafter that `has_fallback`
        reads fallback_k[i] where the fallback drafts (None: the same caps); one that
        `drafts_trees` reads `trees` (per request, True: a tree of at most k_i nodes). The
        engine passes them only to drafters that declare them; others ignore them."""
        raise NotImplementedError

    def continue_after(self, requests: Sequence[Request], prefixes: Sequence[Sequence[int]],
                       k_per_request: Sequence[int]) -> Drafts:
        """Chains of at most k_per_request[i] tokens that follow request i's context and then
        prefixes[i], tokens not in it yet (those its grammar forces: grammar_draft.py). Here:
        the request's own draft of prefix + k tokens, its tail kept where it begins with the
        prefix (nothing otherwise, and nothing from a drafter with probabilities); a drafter
        that can match on the prefix itself overrides this."""
        got = self.propose(requests, [len(p) + k for p, k in zip(prefixes, k_per_request)])
        tails: list[list[int]] = []
        for d, p, k in zip(got.token_ids, prefixes, k_per_request):
            agrees = got.probs is None and list(d[: len(p)]) == list(p)
            tails.append(list(d[len(p): len(p) + k]) if agrees else [])
        return Drafts(token_ids=tails, probs=None, skip_reasons=[None if t else "no_match"
                                                                  for t in tails],
                      setup_seconds=got.setup_seconds)

    def forget(self, request_id: str) -> None:
        """Drop the request's state (buffers, drafter KV); called when it finishes, is aborted
        or preempted. Unknown ids are ignored."""
        raise NotImplementedError

    def preempt(self, request_id: str) -> None:
        """The request was preempted and will be recomputed: drop what it holds (drafter KV).
        Drafters that keep finished outputs (the suffix cache) keep nothing from it here."""
        raise NotImplementedError

    def num_cached(self) -> int:
        """Requests it holds state for (0 once every request is forgotten: leak checks)."""
        raise NotImplementedError

    def cache_stats(self) -> DrafterCacheStats | None:
        """Memory held across requests (the suffix drafter's global cache); None without one."""
        return None

    def reset_cache(self) -> None:
        """Empty the cross-request cache, if it keeps one."""

    def attach(self, model: LlamaModel) -> None:
        """Bind the target model (drafters that read its hidden states)."""

    def observe_hidden(self, hs: HiddenStates) -> None:
        """The hidden states of a step's verified tokens."""


@dataclass(frozen=True)
class DrafterCacheStats:
    """A drafter's cross-request cache (the suffix drafter's global cache): what it holds, its
    caps, and how often drafts came from it, for the pool report and benchmarks."""

    requests: int
    live_tokens: int
    dead_tokens: int
    evictions: int
    compactions: int
    bytes: int
    max_requests: int
    max_tokens: int
    bound_bytes: int
    local_drafts: int
    global_drafts: int
    request_bytes: int  # the per-request indexes of live requests


def tree_shapes(built_with_trees: bool, n: int, trees: Sequence[bool] | None) -> list[bool]:
    """Each request's shape: a tree where the drafter was built with trees and the K policy
    asked for one (`trees` None: every request as built)."""
    return [built_with_trees] * n if trees is None else [built_with_trees and t for t in trees]


def deterministic_drafts(requests: Sequence[Request], k_per_request: Sequence[int],
                         draft_one: Callable[[Request, int, bool], list[int] | DraftTree],
                         as_trees: Sequence[bool]) -> Drafts:
    """Drafts of a drafter with no probabilities (n-gram, suffix): one `draft_one(request, k,
    tree)` per request with k > 0, a chain or (`as_trees[i]`) a tree of at most k nodes; an empty
    draft is a `no_match` skip, k <= 0 is the caller's skip."""
    if not len(requests) == len(k_per_request) == len(as_trees):
        raise ValueError(f"{len(requests)} requests but {len(k_per_request)} k values and "
                         f"{len(as_trees)} shapes")
    token_ids: list[list[int]] = []
    skip_reasons: list[str | None] = []
    trees: list[DraftTree | None] = []
    for request, k, as_tree in zip(requests, k_per_request, as_trees):
        draft = draft_one(request, k, as_tree) if k > 0 else []
        tree = draft if isinstance(draft, DraftTree) else None
        token_ids.append(list(draft.tokens) if isinstance(draft, DraftTree) else draft)
        trees.append(tree if tree is not None and not tree.is_chain else None)
        skip_reasons.append("no_match" if k > 0 and not token_ids[-1] else None)
    return Drafts(token_ids=token_ids, probs=None, skip_reasons=skip_reasons,
                  trees=trees if any(t is not None for t in trees) else None)
