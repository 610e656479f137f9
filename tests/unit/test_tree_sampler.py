"""Tree verification: greedy walks the argmax, sampling keeps the target distribution exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynaspec.draft_tree import DraftTree
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.sampler import processed_probs
from dynaspec.sample.tree_sampler import greedy_tree, random_tree, verify_tree
from dynaspec.sampling_params import SamplingParams as SP
from tests.unit.test_rejection_sampler import chi_ok

# root -> 0 (token 0) -> {1 (token 1), 2 (token 4)}; root -> 3 (token 2); root -> 4 (token 5)
TREE = DraftTree((0, 1, 4, 2, 5), (-1, 0, 0, -1, -1))
P_ROWS = torch.tensor([
    [0.30, 0.05, 0.25, 0.15, 0.10, 0.15],  # root: the first token
    [0.10, 0.40, 0.05, 0.20, 0.15, 0.10],  # after node 0
    [0.20, 0.20, 0.10, 0.10, 0.30, 0.10],  # after node 1
    [0.05, 0.05, 0.30, 0.30, 0.10, 0.20],  # after node 2
    [0.25, 0.25, 0.10, 0.10, 0.15, 0.15],  # after node 3
    [0.40, 0.10, 0.10, 0.10, 0.10, 0.20],  # after node 4
])


def _md(params: SP, n: int = 1, gen: torch.Generator | None = None) -> SamplingMetadata:
    gen = gen or torch.Generator().manual_seed(3)
    return SamplingMetadata.from_params([params] * n, [gen] * n, "cpu")


def test_greedy_takes_the_longest_matching_path():
    # argmax per row: root 0 -> node 0; node 0's row 4 -> node 2; node 2's row 3: no child
    assert greedy_tree([0, 4, 9, 3, 9, 9], TREE) == ([0, 2], 3)
    assert greedy_tree([2, 9, 9, 9, 7, 9], TREE) == ([3], 7)  # the second branch
    assert greedy_tree([3, 9, 9, 9, 9, 9], TREE) == ([], 3)  # no child matches: recovered
    logits = torch.full((6, 6), -5.0)
    for r, t in enumerate([5, 0, 0, 0, 0, 1]):
        logits[r, t] = 5.0
    path, toks = verify_tree(logits, TREE, _md(SP(temperature=0.0)), 0)
    assert path == [4] and toks == [5, 1]


def test_greedy_chain_equals_the_chain_rule():
    from dynaspec.sample.rejection_sampler import rejection_sample

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(4, 7, generator=g)
        drafts = torch.randint(0, 7, (3,), generator=g).tolist()
        drafts[0] = int(logits[0].argmax()) if torch.rand(1, generator=g) < 0.7 else drafts[0]
        md = _md(SP(temperature=0.0))
        want = rejection_sample(logits, [3], [drafts], None, md)[0]
        assert verify_tree(logits, DraftTree.chain(drafts), md, 0)[1] == want


@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.8, top_k=4)],
                         ids=["plain", "top_k"])
def test_sampled_tokens_follow_the_target_at_every_level(params: SP):
    trials = 12000
    logits = torch.log(P_ROWS)
    gen = torch.Generator().manual_seed(11)
    probs = processed_probs(logits, _md(params), torch.zeros(6, dtype=torch.int64))
    # The rule on the processed rows (what verify_tree hands it), without re-processing them
    # each trial; verify_tree itself is checked against it below.
    outs = []
    for _ in range(trials):
        path, last = random_tree(probs, TREE, gen)
        outs.append((path, [TREE.tokens[n] for n in path] + [last]))
    target = probs.numpy().astype(np.float64)
    firsts = np.array([toks[0] for _, toks in outs])
    assert chi_ok(firsts, target[0]), "first token ~ the root row"
    # Given the first token was a node's, the second is drawn from that node's row.
    for node, row in ((0, 1), (3, 4), (4, 5)):
        seconds = np.array([toks[1] for path, toks in outs if path[:1] == [node]])
        assert len(seconds) > 200, f"node {node}"
        assert chi_ok(seconds, target[row]), f"after node {node}"
    # ... and after node 0 then node 1 or 2, the third from theirs.
    for node, row in ((1, 2), (2, 3)):
        thirds = np.array([toks[2] for path, toks in outs if path[:2] == [0, node]])
        assert len(thirds) > 60, f"node {node}"
        assert chi_ok(thirds, target[row]), f"after node {node}"
    # The test has power: a rule that always took a tree's first child would fail it.
    biased = np.where(np.isin(firsts, [0, 2, 5]), 0, firsts)
    assert not chi_ok(biased, target[0])


def test_verify_tree_samples_with_the_processed_rows():
    params = SP(temperature=0.8, top_k=4)
    logits = torch.log(P_ROWS)
    probs = processed_probs(logits, _md(params), torch.zeros(6, dtype=torch.int64))
    for seed in range(20):
        got = verify_tree(logits, TREE, _md(params, gen=torch.Generator().manual_seed(seed)), 0)
        path, last = random_tree(probs, TREE, torch.Generator().manual_seed(seed))
        assert got == (path, [TREE.tokens[n] for n in path] + [last])


def test_seeded_tree_sampling_is_reproducible():
    logits = torch.log(P_ROWS)
    a = [verify_tree(logits, TREE, _md(SP(temperature=1.0), gen=torch.Generator().manual_seed(5)),
                     0)[1] for _ in range(3)]
    b = [verify_tree(logits, TREE, _md(SP(temperature=1.0), gen=torch.Generator().manual_seed(5)),
                     0)[1] for _ in range(3)]
    assert a == b


def test_rows_must_match_the_tree():
    with pytest.raises(ValueError, match="needs 6 rows"):
        verify_tree(torch.zeros(3, 6), TREE, _md(SP(temperature=0.0)), 0)
