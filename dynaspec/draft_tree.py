"""A request's draft tree (docs/design.md §4c): nodes depth-first, each with its parent.

Node i holds `tokens[i]`; `parents[i]` is the index of its parent node, -1 for a child of the
last accepted token (the tree's root, which is the request's pending token, not a node). Parents
come before their children and siblings' subtrees are contiguous (depth-first order), so any
prefix of the nodes is itself a tree: cutting a tree to a node budget keeps its first nodes.

In the step the root and the nodes are the request's query rows, in this order: row 0 the root,
row 1 + i node i. Node i sits at position `context + 1 + depth(i)` (a chain: `context + 1 + i`,
as today) and attends to the context, the root and its own ancestors only (`visibility`). Its
K/V is written at the slot of row 1 + i; after acceptance the accepted path's K/V is moved to
the slots of rows 1..len(path) (`kv_moves`), so the request's cache holds exactly the tokens it
accepted, at their positions, and nothing of a rejected branch is ever read again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1: child of the root (the last accepted token)
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)  # root's children: 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} "
                             "parents")
        depths: list[int] = []
        stack: list[int] = []  # the path from the root to the previous node
        for i, p in enumerate(self.parents):
            if p != -1 and p not in stack:
                # depth-first: a node's parent is the previous node or one of its ancestors
                raise ValueError(f"draft tree: node {i}'s parent {p} is not on the path to node "
                                 f"{i - 1} (nodes must be depth-first, parents first)")
            while stack and stack[-1] != p:
                stack.pop()
            depths.append(len(stack))
            stack.append(i)
        object.__setattr__(self, "depths", tuple(depths))

    @staticmethod
    def chain(tokens) -> DraftTree:
        return DraftTree(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def depth(self) -> int:
        """Nodes on the longest root path (the most drafts one step can accept)."""
        return 1 + max(self.depths) if self.tokens else 0

    def children(self, node: int) -> list[int]:
        """Node indices whose parent is `node` (-1: the root), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def first_path(self) -> list[int]:
        """Tokens of the first root path (nodes 0.. while each is the previous one's child): the
        chain a step runs where a tree cannot be verified."""
        n = 0
        while n < len(self.parents) and self.parents[n] == n - 1:
            n += 1
        return list(self.tokens[:n])

    def cut(self, num_nodes: int) -> DraftTree:
        """The first `num_nodes` nodes (a tree again: parents come first)."""
        return DraftTree(self.tokens[:num_nodes], self.parents[:num_nodes])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def visibility(self, device: torch.device | None = None) -> torch.Tensor:
        """[n+1, n+1] bool over the request's query rows (row 0 the root, 1+i node i): True
        where the row may attend to the column's key (the root, its ancestors, itself)."""
        n = len(self.tokens)
        vis = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        vis[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                vis[1 + i] = vis[1 + p]
            vis[1 + i, 1 + i] = True
        return vis.to(device) if device is not None else vis

    def position_offsets(self) -> list[int]:
        """Per query row, the position past the root's: 0 for the root, 1 + depth for a node."""
        return [0] + [1 + d for d in self.depths]


def kv_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(from row, to row) for the accepted path's K/V: node path[d] was written at row
    1 + path[d] and belongs at row 1 + d. Depth-first order gives path[d] >= d and increasing,
    so moving shallow to deep never overwrites a node still to be moved."""
    return [(1 + p, 1 + d) for d, p in enumerate(path) if p != d]


@dataclass(frozen=True)
class TreeWalk:
    """What one verified tree says about its drafter's branches
    (spec_decode/policy/tree_pricing.py):
    at each depth the walk reached, how many children the reached node offered and the rank
    (0: the first child) of the one accepted, -1 where none was (the walk ends there)."""

    offered: tuple[int, ...]
    chosen: tuple[int, ...]
    first_path: int  # nodes on the tree's first root path: the chain the tree holds

    @property
    def first_path_accepted(self) -> int:
        """Of the first path's nodes, those accepted: the walk's leading first-child picks."""
        n = 0
        while n < min(len(self.chosen), self.first_path) and self.chosen[n] == 0:
            n += 1
        return n


def tree_walk(tree: DraftTree, path: list[int]) -> TreeWalk:
    """The walk that accepted `path` (node indices from the root's child down)."""
    offered, chosen, node = [], [], -1
    for d in range(len(path) + 1):
        kids = tree.children(node)
        if not kids:
            break
        offered.append(len(kids))
        chosen.append(kids.index(path[d]) if d < len(path) else -1)
        if d < len(path):
            node = path[d]
    return TreeWalk(tuple(offered), tuple(chosen), len(tree.first_path()))
