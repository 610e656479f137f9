"""The runner's part of a tree step (docs/design.md §4c): which trees run, their rows' positions
and visibility, their verification, and the move of the accepted path's K/V into place.

A drafter may hand a request a `DraftTree` instead of a chain. The tree runs as a tree only on
the eager path and only for a request whose rows need nothing per position beyond the target's
logits (no grammar, no logits processing, no logprobs, no draft probabilities, no hidden-state
drafter, strict verification); elsewhere its first root path runs as today's chain, which is
exact too. A tree that is a chain runs as the chain it is, so chains keep today's code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.tree_sampler import verify_tree
from dynaspec.spec_decode.tree import DraftTree, kv_moves


@dataclass(frozen=True)
class TreeRows:
    """One request's tree in the step: `base` is the storage position (row index in the
    request's KV slots) of its root row; node i is stored at base + 1 + i."""

    tree: DraftTree
    base: int
    block_table: tuple[int, ...]


def tree_allowed(req, *, eager: bool, plain_verify: bool,  # type: ignore[no-untyped-def]
                 has_probs: bool) -> bool:
    """Whether `req`'s tree can be verified as a tree this step (module docstring)."""
    sp = req.sampling_params
    return (eager and plain_verify and not has_probs and sp.structured_output is None
            and not sp.processes_logits and sp.logprobs is None)


def admit(trees: dict[str, DraftTree], drafts: dict[str, list[int]],  # type: ignore[no-untyped-def]
          allowed) -> dict[str, DraftTree]:
    """The trees that run as trees; each other one is replaced in `drafts` by its first root
    path (a chain, verified by today's rule)."""
    kept = {}
    for rid, tree in trees.items():
        if allowed(rid):
            kept[rid] = tree
        else:
            drafts[rid] = tree.first_path()
    return kept


def positions(start: int, num_new: int, tree: DraftTree) -> list[int]:
    """Positions of a request's rows: its new tokens in order (the last is the tree's root),
    then node i at the root's position + 1 + depth(i)."""
    root = start + num_new - 1
    return list(range(start, root)) + [root + o for o in tree.position_offsets()]


def visibility(num_new: int, tree: DraftTree) -> torch.Tensor:
    """[q, q] bool over all the request's query rows: the new tokens causal, the nodes as the
    tree says (every row sees the new tokens before the root)."""
    q = num_new + len(tree)
    vis = torch.ones(q, q, dtype=torch.bool).tril()
    vis[num_new - 1:, num_new - 1:] = tree.visibility()
    return vis


def subset(md: SamplingMetadata, idx: list[int]) -> SamplingMetadata:
    """The metadata of the requests at `idx` (in that order)."""
    t = torch.tensor(idx, dtype=torch.long)
    temps = md.temperature[t.to(md.temperature.device)]
    return SamplingMetadata(temps, md.top_k[t.to(md.top_k.device)],
                            md.top_p[t.to(md.top_p.device)], md.min_p[t.to(md.min_p.device)],
                            [md.generators[i] for i in idx], bool((temps == 0).all()),
                            [md.num_logprobs[i] for i in idx])


def verify(logits: torch.Tensor, row: int, tree: DraftTree, md: SamplingMetadata, i: int
           ) -> tuple[list[int], list[int]]:
    """(accepted path, tokens) of request i (in md), whose rows start at `row` of logits."""
    return verify_tree(logits[row: row + len(tree) + 1], tree, md, i)


def move_accepted(kv_caches: list[torch.Tensor], block_size: int,
                  moves: list[tuple[TreeRows, list[int]]]) -> None:
    """Copy each accepted path's K/V from the slots its nodes were written at to the slots of
    rows 1..len(path) past the root, in every layer. Rejected nodes' slots lie past the
    request's accepted tokens: the next step overwrites them before anything reads them."""
    src, dst = [], []
    for rows, path in moves:
        t, bs = rows.block_table, block_size
        for a, b in kv_moves(path):
            pa, pb = rows.base + a, rows.base + b
            src.append(t[pa // bs] * bs + pa % bs)
            dst.append(t[pb // bs] * bs + pb % bs)
    if not src:
        return
    s = torch.tensor(src, dtype=torch.long, device=kv_caches[0].device)
    d = torch.tensor(dst, dtype=torch.long, device=kv_caches[0].device)
    for kv in kv_caches:  # [2, num_slots, Hkv, D]; the gather copies before the scatter writes
        kv[:, d] = kv[:, s]
