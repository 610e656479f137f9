"""spec_decode/policy/tree_pricing.py and the goodput policy's chain / tree / none choice: a tree's
walk teaches per-depth, per-branch rates; a tree is priced by its nodes' values at width
1 + nodes; the policy drafts a tree where its branches pay, a chain where they do not."""

from __future__ import annotations

import pytest

from dynaspec.draft_tree import DraftTree, tree_walk
from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.acceptance import FULL_LENGTHS
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy, GoodputSettings
from dynaspec.spec_decode.policy.k_policy import RequestView, StepView
from dynaspec.spec_decode.policy.step_pricing import price_row
from dynaspec.spec_decode.policy.tree_pricing import (
    BranchRates,
    TreePricer,
    node_values,
    price_tree_row,
)

WIDTHS = tuple(range(1, 10))


def _cost(per_width) -> StepCostModel:  # type: ignore[no-untyped-def]
    grid = CostGrid((1, 64), (1, 4096), WIDTHS)
    return StepCostModel(grid, [[[per_width(w) for w in WIDTHS]] * 2] * 2)


# root -> 0 (-> 1 -> 2), 3 (-> 4), 5: three children at depth 0, the first a chain of three
TREE = DraftTree((10, 11, 12, 20, 21, 30), (-1, 0, 1, -1, 3, -1))


def test_a_walk_records_offers_and_the_rank_accepted():
    w = tree_walk(TREE, [3, 4])  # the second child, then its only child, then nothing offered
    assert (w.offered, w.chosen, w.first_path) == ((3, 1), (1, 0), 3)
    assert w.first_path_accepted == 0  # the first path's first node was rejected
    w = tree_walk(TREE, [0, 1])
    assert (w.offered, w.chosen, w.first_path_accepted) == ((3, 1, 1), (0, 0, -1), 2)
    w = tree_walk(TREE, [])
    assert (w.offered, w.chosen) == ((3,), (-1,))


def test_branch_rates_count_only_ranks_that_were_tried():
    rates = BranchRates(prior=0.5, prior_weight=2.0)
    rates.update(tree_walk(TREE, [0, 1]))  # the first child won: later ranks never tried
    assert rates.reached == {}
    rates.update(tree_walk(TREE, [3, 4]))  # rank 1 won at depth 0
    rates.update(tree_walk(TREE, []))  # ranks 1 and 2 both lost at depth 0
    assert rates.reached == {(0, 1): 2, (0, 2): 1} and rates.hits == {(0, 1): 1}
    assert rates.rate(0, 1) == pytest.approx((1 + 1.0) / (2 + 2.0))
    assert rates.rate(0, 2) == pytest.approx(1.0 / 3.0) and rates.rate(5, 1) == 0.5
    assert rates.table() == {"d0b1": 0.5, "d0b2": 0.3333}


def test_a_tree_whose_branches_never_win_is_priced_as_the_chain():
    rate0 = lambda d: 0.7 - 0.05 * d  # noqa: E731
    survival = [1.0, 0.9, 0.8, 0.6, 0.5]
    chain = price_row(rate0, survival, 5, True)
    tree = price_tree_row([rate0(d) for d in range(5)], [[0.0] * 3] * 5, survival, 5, True)
    assert tree == chain


def test_node_values_take_the_best_nodes_of_any_shape():
    # Rank 0 at 0.5 and rank 1 at 0.5 everywhere: the root's two children are worth 0.5 and
    # 0.25; the first child's two children 0.25 and 0.125.
    vals = node_values([0.5] * 4, [[0.5, 0.0, 0.0]] * 4, 4)
    assert vals == pytest.approx([0.5, 0.25, 0.25, 0.125])
    # E[accepted] of a chain of 4 at 0.5: 0.5 + 0.25 + 0.125 + 0.0625 < the tree's 1.125
    assert sum(vals) > sum(0.5 ** (i + 1) for i in range(4))


def test_node_values_equal_the_best_of_every_node_enumerated():
    import itertools
    import random

    rng = random.Random(3)
    for _ in range(20):
        n = rng.randrange(1, 6)
        rate0 = [rng.random() for _ in range(n)]
        branches = [[rng.random() * 0.6 for _ in range(3)] for _ in range(n)]
        reach = []
        for d in range(n):
            miss, row = 1.0, []
            for p in (rate0[d], *branches[d]):
                row.append(miss * p)
                miss *= 1.0 - p
            reach.append(row)
        every = []
        for depth in range(1, n + 1):  # every node: its ranks from the root down
            for ranks in itertools.product(range(4), repeat=depth):
                v = 1.0
                for d, b in enumerate(ranks):
                    v *= reach[d][b]
                every.append(v)
        assert node_values(rate0, branches, n) == pytest.approx(sorted(every, reverse=True)[:n])


def _policy(branch_prior: float, per_width) -> GoodputPolicy:  # type: ignore[no-untyped-def]
    settings = GoodputSettings(drafts_trees=True, branch_prior=branch_prior, prior_rate=0.5)
    return GoodputPolicy(build_spec_plan("ngram", 6, None), _cost(per_width), settings)


def _view(*rids: str) -> StepView:
    return StepView(tuple(RequestView(r, 100, 1000, 10**6) for r in rids), len(rids))


def test_the_policy_picks_a_tree_where_branches_pay_a_chain_where_not_and_none_at_a_loss():
    cheap = lambda w: 0.01 * (1 + 0.02 * (w - 1))  # noqa: E731 - width nearly free
    d = _policy(0.6, cheap).decide(_view("a"))
    assert d.trees == frozenset({"a"}) and d.per_request["a"] > 1  # branches pay: a tree
    d = _policy(0.0, cheap).decide(_view("a"))
    assert d.trees == frozenset() and d.per_request["a"] > 0  # no branch ever wins: a chain
    dear = lambda w: 0.01 * w  # noqa: E731 - every verified row costs a full step
    d = _policy(0.6, dear).decide(_view("a"))
    assert d.k == 0 and d.per_request["a"] == 0  # nothing pays: none
    # A drafter that gives no trees is never asked for one.
    p = GoodputPolicy(build_spec_plan("ngram", 6, None), _cost(cheap))
    assert p.decide(_view("a")).trees is None


def test_a_tree_step_teaches_the_chain_history_its_first_path_and_the_branches_the_rest():
    p = _policy(0.25, lambda w: 0.01)
    w = tree_walk(TREE, [3, 4])  # the first path (3 nodes) failed at once; rank 1 won
    p.observe("a", len(TREE), 2, 100, cap=6, walk=w)
    h = p.histories["a"]
    assert h.num_updates == 1 and h.counts == [1]  # as the chain of 3 that accepted 0 would
    assert p.branch_rates.reached == {(0, 1): 1} and p.branch_rates.hits == {(0, 1): 1}
    assert p.tree_lengths.num_updates == 1 and p.engine_lengths.num_updates == 0
    assert p.last_draft_ctx["a"] == 100


def test_a_tree_row_is_priced_at_its_width():
    """The step's seconds for a tree come from the cost table at width 1 + nodes, as a chain's."""
    p = _policy(0.6, lambda w: 0.01 * w)
    cost = p.cost_model.widths_priced(1, 100)
    row = TreePricer(p.branch_rates, FULL_LENGTHS.survival, 4).row(lambda d: 0.5, 4)
    pricing = p._pricing([row], cost)
    assert pricing.seconds(4) == pytest.approx(cost(5)) and pricing.drafted(4) == 4


@pytest.mark.parametrize("policy, says", [
    ("goodput", "picks chain, tree or none per request per step"),
    ("table", "does not price shapes"),
])
def test_schedule_explain_states_the_tree_rule_of_the_policy_that_runs(policy, says):
    import io

    from dynaspec.cli.main import build_parser
    from dynaspec.cli.schedule_cmd import explain

    args = build_parser().parse_args(["schedule", "explain", "--speculator", "suffix",
                                      "--num-spec-tokens", "8", "--draft-tree",
                                      "--k-policy", policy])
    out, err = io.StringIO(), io.StringIO()
    assert explain(args, out, err) == 0
    text = out.getvalue().split("draft trees: on.")[1]
    assert says in text and "spec_decode_tree_steps" in text
