"""Lossless verification of a draft tree (docs/design.md §4c).

Rows: the request's n+1 logits rows, row 0 the root (the last accepted token), row 1+i node i
(`draft_tree.py`). The walk starts at the root and descends one level per accepted node;
at each node the row of that node gives the target's distribution p for the next token.

Greedy: the child whose token equals the argmax of the row's raw logits is accepted (the first
such child); with none, the argmax is the step's last token. Token-exact with plain greedy
decoding, like the chain rule it reduces to.

Random: recursive rejection sampling with deterministic drafts (SpecInfer's multi-draft rule
with one-hot draft distributions; Chen et al. 2023 for one draft). The children c_1..c_m of the
current node are tried in order against the residual r, starting at r = p: child c_j (token x)
is accepted with probability r(x) / sum(r); when rejected, r(x) is set to 0 and the next child
is tried. If every child is rejected, the step's last token is sampled from normalize(r). The
token leaving a node is then x with probability p(x) exactly: trying x_1 first gives
P(x_1) = p(x_1); x_2 is reached with probability 1 - p(x_1) and accepted with
p(x_2) / (1 - p(x_1)), and so on, and the final draw from the residual covers the remaining
mass. So every emitted token has the target's distribution, whatever the tree. With one child
per node this is the chain rule (accept with p(x), else sample max(p - onehot(x), 0)).

Random draws, from the request's own generator only: one float32 uniform per child tried
(`torch.rand(1)`), then one float64 uniform for the sampled token, in walk order.
"""

from __future__ import annotations

import torch

from dynaspec.draft_tree import DraftTree
from dynaspec.sample.greedy import argmax_rows
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.sampler import inverse_cdf_sample, processed_probs, sample_uniform


def greedy_tree(argmax: list[int], tree: DraftTree) -> tuple[list[int], int]:
    """(accepted path as node indices, last token) from each row's argmax ([n+1])."""
    kids = _children(tree)
    node, path = -1, list[int]()
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in kids[node + 1] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def random_tree(probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None
                ) -> tuple[list[int], int]:
    """probs: [n+1, vocab] processed target probabilities of the request's rows."""
    kids = _children(tree)
    vocab, device = probs.shape[1], probs.device
    node, path = -1, list[int]()
    while True:
        residual = probs[node + 1].double().clone()  # [vocab]
        nxt = None
        for c in kids[node + 1]:
            x = tree.tokens[c]
            if not 0 <= x < vocab:
                continue  # never a real draft: rejected without a draw
            total = float(residual.sum())
            u = float(torch.rand(1, generator=generator, device=device))
            if total > 0 and u * total < float(residual[x]):
                nxt = c
                break
            residual[x] = 0.0
        if nxt is None:
            if not bool((residual > 0).any()):
                residual = probs[node + 1].double()  # rounding emptied it: p is the fallback
            v = sample_uniform(generator, device)
            return path, int(inverse_cdf_sample(residual.unsqueeze(0), v))
        path.append(nxt)
        node = nxt


def verify_tree(rows: torch.Tensor, tree: DraftTree, md: SamplingMetadata, i: int
                ) -> tuple[list[int], list[int]]:
    """rows: [n+1, vocab] logits of request i (in md). Returns (accepted path as node indices,
    tokens: the accepted drafts then one recovered or bonus token)."""
    if rows.shape[0] != len(tree) + 1:
        raise ValueError(f"draft tree of {len(tree)} nodes needs {len(tree) + 1} rows, got "
                         f"{rows.shape[0]}")
    if float(md.temperature[i]) == 0.0:
        path, last = greedy_tree(argmax_rows(rows.contiguous()).tolist(), tree)
    else:
        idx = torch.full((rows.shape[0],), i, dtype=torch.long, device=rows.device)
        path, last = random_tree(processed_probs(rows, md, idx), tree, md.generators[i])
    return path, [tree.tokens[n] for n in path] + [last]


def _children(tree: DraftTree) -> list[list[int]]:
    """[n+1]: entry 0 the root's children, entry 1+i node i's, each in node order."""
    kids: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for c, p in enumerate(tree.parents):
        kids[p + 1].append(c)
    return kids
