"""A tree step's logits, row by row, equal a plain forward of the context plus that row's own
root path; after the accepted path's K/V is moved, the next step reads exactly the accepted
sequence (no rejected branch visible)."""

from __future__ import annotations

import torch

from dynaspec import LLM
from dynaspec.attention.backend import AttentionBatch
from dynaspec.draft_tree import DraftTree
from dynaspec.worker import tree_step

from .conftest import last_logits

# root -> 0 -> {1, 2 -> 3}; root -> 4 -> 5
TREE = DraftTree((40, 41, 42, 43, 50, 51), (-1, 0, 0, 2, -1, 4))
CONTEXT = [7, 19, 3, 88, 120, 5, 61, 200, 13, 9, 77, 150, 31, 64, 222, 18, 90, 45]  # 18 tokens
ROOT = 99


def _step(llm, ids, positions, ctx_len, tree=None, rows=None):
    eng = llm.engine
    m, bs = eng.parts.model, eng.parts.kv.block_size
    q = len(ids)
    masks = None if tree is None else [tree_step.visibility(1, tree)]
    md = m.attn.build_metadata(AttentionBatch([q], [ctx_len], [[0, 1, 2]], bs,
                                              torch.device("cpu"), tree_masks=masks))
    rows = list(range(q)) if rows is None else rows
    return m.forward(torch.tensor(ids), torch.tensor(positions), eng.runner.kv_caches, md,
                     torch.tensor(rows))


def test_tree_rows_see_context_and_ancestors_only(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=8, attention_backend="eager",
              enable_prefix_caching=False)
    c0 = len(CONTEXT)
    _step(llm, CONTEXT, list(range(c0)), c0)
    ids = [ROOT, *TREE.tokens]
    pos = tree_step.positions(c0, 1, TREE)
    assert pos == [c0, c0 + 1, c0 + 2, c0 + 2, c0 + 3, c0 + 1, c0 + 2]
    logits = _step(llm, ids, pos, c0 + len(ids), TREE)  # [7, vocab]
    for row in range(len(ids)):
        path = [] if row == 0 else [TREE.tokens[n] for n in TREE.path_to(row - 1)]
        want = last_logits(tiny_llama_dir, CONTEXT + [ROOT] + path)
        assert torch.allclose(logits[row], want, atol=1e-4, rtol=1e-4), f"row {row}"
    # Accept the second root branch (nodes 4, 5): its K/V moves to the rows after the root.
    rows = tree_step.TreeRows(TREE, c0, (0, 1, 2))
    tree_step.move_accepted(llm.engine.runner.kv_caches, llm.engine.parts.kv.block_size,
                            [(rows, [4, 5])])
    nxt = 17
    done = c0 + 1 + 2  # context, root, two accepted nodes
    got = _step(llm, [nxt], [done], done + 1)[0]
    want = last_logits(tiny_llama_dir, CONTEXT + [ROOT, 50, 51, nxt])
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # Without the move the next step would read the first branch's K/V: the check can fail.
    stale = last_logits(tiny_llama_dir, CONTEXT + [ROOT, 40, 41, nxt])
    assert not torch.allclose(stale, want, atol=1e-4, rtol=1e-4)
