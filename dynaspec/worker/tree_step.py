"""The runner's part of a tree step (docs/design.md §4c): which trees run, their rows' positions
and visibility, and the move of the accepted path's K/V into place (the walk that accepts a path
is in worker/verify.py, over sample/tree_sampler.py).

A drafter may hand a request a `DraftTree` instead of a chain. The tree runs as a tree only on
the eager path and only for a request whose rows need nothing per position beyond the target's
logits (no grammar, no logits processing, no logprobs, no draft probabilities, strict
verification); elsewhere its first root path runs as today's chain, which is exact too. A
hidden-state drafter (the hybrid's EAGLE head) reads the accepted path's rows
(`verified_rows`). A tree that is a chain runs as the chain it is, so chains keep today's code
path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dynaspec.draft_tree import DraftTree, kv_moves
from dynaspec.request import Request
from dynaspec.step_plan import StepPlan


@dataclass(frozen=True)
class TreeRows:
    """One request's tree in the step: `base` is the storage position (row index in the
    request's KV slots) of its root row; node i is stored at base + 1 + i."""

    tree: DraftTree
    base: int
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class Admitted:
    """The step's trees as admitted: those that run as trees, and the chains that stand in for
    the others (each its tree's first root path, verified by the chain rule)."""

    trees: dict[str, TreeRows]
    chains: dict[str, list[int]]


def tree_allowed(req: Request, *, eager: bool, plain_verify: bool, has_probs: bool) -> bool:
    """Whether `req`'s tree can be verified as a tree this step (module docstring)."""
    sp = req.sampling_params
    return (eager and plain_verify and not has_probs and sp.structured_output is None
            and not sp.processes_logits and sp.logprobs is None)


def admit(out: StepPlan, trees: Mapping[str, DraftTree],
          probs: Mapping[str, torch.Tensor | None], plain: bool) -> Admitted:
    """The trees of step `out` that run as trees, with their rows, and the chain each other one
    becomes. `plain`: strict verification."""
    by_id = {s.request.request_id: s for s in out.scheduled}
    kept: dict[str, TreeRows] = {}
    chains: dict[str, list[int]] = {}
    for rid, tree in trees.items():
        s = by_id[rid]
        if tree_allowed(s.request, eager=not out.batch.fixed_shape, plain_verify=plain,
                        has_probs=probs.get(rid) is not None):
            base = s.request.num_computed_tokens + s.num_new_tokens - 1
            kept[rid] = TreeRows(tree, base, tuple(s.block_table))
        else:
            chains[rid] = tree.first_path()
    return Admitted(kept, chains)


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


def move_accepted(kv_caches: list[torch.Tensor], block_size: int,
                  moves: list[tuple[TreeRows, tuple[int, ...]]]) -> None:
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


def verified_rows(num_rows: int, num_drafts: int | None, num_accepted: int,
                  path: tuple[int, ...] | None) -> list[int]:
    """A request's rows (0..num_rows-1 of its query) that hold verified tokens, in order: its new
    tokens, then the drafts it accepted, for a hidden-state drafter (EAGLE) to read. A chain's
    accepted drafts are the rows after its new tokens; a tree's accepted path is node rows
    1 + path[d] past its root (rejected branches' rows left out)."""
    if num_drafts is None:
        return list(range(num_rows))
    num_new = num_rows - num_drafts
    if path is None:
        return list(range(num_new + num_accepted))
    return list(range(num_new)) + [num_new + node for node in path]
