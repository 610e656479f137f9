"""worker/tree_step.verified_rows: the rows a hidden-state drafter reads after a step."""

from __future__ import annotations

from dynaspec.worker.tree_step import verified_rows


def test_verified_rows_of_a_prefill_a_chain_and_a_tree():
    assert verified_rows(5, None, 0, None) == [0, 1, 2, 3, 4]  # a prefill chunk: all of it
    assert verified_rows(4, 3, 2, None) == [0, 1, 2]  # a chain: the root and 2 accepted drafts
    # a tree of 5 nodes after 2 new tokens: path nodes 0 and 3 sit at rows 2 + 0 and 2 + 3
    assert verified_rows(7, 5, 2, (0, 3)) == [0, 1, 2, 5]
    assert verified_rows(6, 5, 0, ()) == [0]  # nothing accepted: the root alone
