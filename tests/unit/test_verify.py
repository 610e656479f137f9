"""worker/verify.py: one function verifies chains and trees, greedy and random, and its results
equal the reference samplers' with the same generators."""

from __future__ import annotations

import pytest
import torch

from dynaspec.draft_tree import DraftTree
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.rejection_sampler import rejection_sample_reference
from dynaspec.sample.sampler import processed_probs
from dynaspec.sample.tree_sampler import greedy_tree, random_tree
from dynaspec.sampling_params import SamplingParams as SP
from dynaspec.worker.draft_rows import DraftRow, DraftRows
from dynaspec.worker.verify import verify

VOCAB = 12
PARAMS = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=0.7, top_k=3),
          SP(temperature=1.3, top_p=0.8), SP(temperature=0.0, top_k=2)]
TREE = DraftTree((5, 3, 1, 9, 7), (-1, 0, 1, 0, -1))  # root -> {5 -> {3 -> 1, 9}, 7}


def _md(params: list[SP], seed: int) -> SamplingMetadata:
    gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(params))]
    return SamplingMetadata.from_params(params, gens, "cpu")


def _case(seed: int, num_reqs: int, with_probs: bool):
    """Peaked logits; drafts drawn from the target so acceptance lengths vary."""
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, 5, (num_reqs,), generator=g).tolist()
    logits = torch.randn(sum(num_draft) + num_reqs, VOCAB, generator=g) * 2.5
    drafts, probs, at = [], [], 0
    for n in num_draft:
        q = torch.softmax(logits[at: at + n] + torch.randn(n, VOCAB, generator=g), -1)
        drafts.append(torch.multinomial(q, 1, generator=g).squeeze(1).tolist() if n else [])
        probs.append(q if with_probs and n and len(probs) % 2 == 0 else None)
        at += n + 1
    params = [PARAMS[i] for i in torch.randint(0, len(PARAMS), (num_reqs,), generator=g)]
    return logits, drafts, probs, params


def _rows(drafts: list[list[int]], probs: list[torch.Tensor | None], md: SamplingMetadata,
          trees: dict[int, DraftTree] | None = None) -> DraftRows:
    trees = trees or {}
    return DraftRows(tuple(
        DraftRow(request_id=f"r{k}", sample=k, tokens=tuple(d), probs=q, tree=trees.get(k),
                 num_valid=len(d))
        for k, (d, q) in enumerate(zip(drafts, probs))), md)


@pytest.mark.parametrize("with_probs", [False, True])
def test_chains_equal_the_reference_sampler(with_probs: bool) -> None:
    for seed in range(30):
        logits, drafts, probs, params = _case(seed, 6, with_probs)
        got = verify(logits.clone(), _rows(drafts, probs, _md(params, seed)))
        q = probs if any(p is not None for p in probs) else None
        want = rejection_sample_reference(logits, [len(d) for d in drafts], drafts, q,
                                          _md(params, seed))
        assert [list(r.token_ids) for r in got] == want, f"seed {seed}"
        for r, d, w in zip(got, drafts, want):
            assert (r.num_draft_tokens, r.num_accepted_tokens) == (len(d), len(w) - 1)
            assert r.tree_path is None and r.num_tree_nodes == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trees_beside_chains_equal_the_reference_samplers(temperature: float) -> None:
    for seed in range(30):
        logits, drafts, probs, params = _case(seed, 4, with_probs=False)
        # Request 1 verifies TREE on its own len(TREE) + 1 rows, inserted after request 0's.
        at = len(drafts[0]) + 1
        g = torch.Generator().manual_seed(1000 + seed)
        tree_logits = torch.randn(len(TREE) + 1, VOCAB, generator=g) * 2.5
        tree_logits[0, 5] = tree_logits[1, 3] = 50.0  # the walk can go two levels deep
        step_logits = torch.cat([logits[:at], tree_logits, logits[at:]])
        drafts = [drafts[0], list(TREE.tokens), *drafts[1:]]
        params = [params[0], SP(temperature=temperature), *params[1:]]
        got = verify(step_logits.clone(), _rows(drafts, [None] * 5, _md(params, seed), {1: TREE}))

        # The chains: as the reference verifies them alone, with the same generators.
        md = _md(params, seed)
        chains = [0, 2, 3, 4]
        want = rejection_sample_reference(logits, [len(drafts[k]) for k in chains],
                                          [drafts[k] for k in chains], None, md.subset(chains))
        assert [list(got[k].token_ids) for k in chains] == want, f"seed {seed}"
        # The tree: as the tree rule walks it alone, from the request's own generator.
        if temperature == 0.0:
            path, last = greedy_tree(tree_logits.argmax(-1).tolist(), TREE)
        else:
            idx = torch.full((len(TREE) + 1,), 1, dtype=torch.long)
            path, last = random_tree(processed_probs(tree_logits, md, idx), TREE,
                                     md.generators[1])
        t = got[1]
        assert t.tree_path == tuple(path), f"seed {seed}"
        assert list(t.token_ids) == [TREE.tokens[n] for n in path] + [last]
        assert (t.num_tree_nodes, t.tree_depth, t.num_accepted_tokens) == (5, 3, len(path))


def test_greedy_tree_takes_the_longest_matching_path() -> None:
    logits = torch.zeros(len(TREE) + 1, VOCAB)
    logits[0, 5] = logits[1, 3] = logits[2, 1] = logits[3, 8] = 1.0  # root 5 3 1, then 8
    got = verify(logits, _rows([list(TREE.tokens)], [None], _md([SP(temperature=0)], 0),
                               {0: TREE}))
    assert got[0].tree_path == (0, 1, 2) and got[0].token_ids == (5, 3, 1, 8)


def test_labelled_drafts_are_counted_by_source_on_the_accepted_path() -> None:
    """A hybrid's nodes carry sources: a tree counts its path's nodes, a chain its first
    accepted drafts; unlabelled rows count nothing by source."""
    logits = torch.zeros(len(TREE) + 1 + 3 + 1 + 2 + 1, VOCAB)
    logits[0, 5] = logits[1, 9] = logits[4, 2] = 1.0  # the tree: 5 then 9 (node 3), then 2
    at = len(TREE) + 1
    logits[at, 4] = logits[at + 1, 6] = logits[at + 2, 0] = 1.0  # the chain [4, 8, 1]: 4 only
    src = ("suffix", "suffix", "suffix", "eagle", "eagle")
    md = _md([SP(temperature=0)] * 3, 0)
    rows = DraftRows((
        DraftRow(request_id="t", sample=0, tokens=TREE.tokens, tree=TREE, num_valid=5,
                 sources=src),
        DraftRow(request_id="c", sample=1, tokens=(4, 8, 1), num_valid=3,
                 sources=("eagle", "ngram", "ngram")),
        DraftRow(request_id="u", sample=2, tokens=(3, 3), num_valid=2)), md)
    t, c, u = verify(logits, rows)
    assert t.tree_path == (0, 3)
    assert dict((s, (d, a)) for s, d, a in t.drafts_by_source) == {"suffix": (3, 1),
                                                                  "eagle": (2, 1)}
    assert c.num_accepted_tokens == 1
    assert dict((s, (d, a)) for s, d, a in c.drafts_by_source) == {"eagle": (1, 1),
                                                                  "ngram": (2, 0)}
    assert u.drafts_by_source == ()


def test_graph_argmax_gives_the_greedy_chain_tokens() -> None:
    logits, drafts, probs, _ = _case(3, 5, with_probs=False)
    params = [SP(temperature=0.0)] * 5
    plain = verify(logits.clone(), _rows(drafts, probs, _md(params, 0)))
    graph = verify(torch.full_like(logits, float("nan")), _rows(drafts, probs, _md(params, 0)),
                   graph_argmax=logits.argmax(-1))
    assert [r.token_ids for r in graph] == [r.token_ids for r in plain]


def test_rows_without_a_sample_get_an_empty_result_and_keep_their_skip() -> None:
    logits = torch.randn(3, VOCAB)
    rows = DraftRows((DraftRow(request_id="prefill", sample=None, skip_reason="prefill"),
                      DraftRow(request_id="d", sample=0, tokens=(4, -1), num_valid=1)),
                     _md([SP(temperature=0)], 0))
    pre, d = verify(logits, rows)
    assert pre.token_ids == () and pre.skip_reason == "prefill"
    assert d.num_padding_tokens == 1 and d.num_draft_tokens == 1
    assert d.token_ids[-1] == int(logits[min(d.num_accepted_tokens, 2)].argmax())


def test_rows_without_drafts_take_the_same_draws_as_the_rejection_rule() -> None:
    """A step whose chains have no draft samples them with the plain sampler; beside a tree
    the same rows once went through the rejection rule: the two agree token for token."""
    for seed in range(20):
        params = [PARAMS[(seed + i) % len(PARAMS)] for i in range(4)]
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
        got = verify(logits.clone(), _rows([[]] * 4, [None] * 4, _md(params, seed)))
        want = rejection_sample_reference(logits, [0] * 4, [[]] * 4, None, _md(params, seed))
        assert [list(r.token_ids) for r in got] == want, f"seed {seed}"
