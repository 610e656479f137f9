"""Token trees end to end (docs/design.md §4c): greedy output with trees equals plain greedy
decoding; the accepted path's K/V is moved into place and no rejected branch is ever read;
a chain given as a tree runs exactly today's chain path."""

from __future__ import annotations

import pytest
import torch

from dynaspec import LLM
from dynaspec.draft_tree import DraftTree
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.base import Drafts, Proposer
from tests.cost_tables import FREE_VERIFY

from .conftest import assert_greedy_equal, greedy, llm_drafting_with, random_prompts, watch_steps

MAX_TOKENS = 24
# The in-place kernel where it builds (its ancestor mask), else the eager reference.
BACKEND = "auto"


class OracleTrees(Proposer):
    """Knows each prompt's plain greedy output. Puts a wrong branch (with a subtree of its own)
    first at every level and the true token second, so acceptance walks second branches and the
    accepted path's K/V must be moved; `chain`: the true tokens alone, as a chain tree or as a
    plain list."""

    def __init__(self, refs: dict[tuple, list[int]], vocab: int, mode: str = "tree") -> None:
        self.refs, self.vocab, self.mode = refs, vocab, mode

    def _truth(self, req, k: int) -> list[int]:  # type: ignore[no-untyped-def]
        ref = self.refs[tuple(req.prompt_token_ids)]
        return ref[req.num_output_tokens: req.num_output_tokens + k]

    def _tree(self, truth: list[int]) -> DraftTree:
        tokens, parents, parent = [], [], -1
        for t in truth:
            wrong = (t + 7) % self.vocab
            tokens += [wrong, (wrong + 1) % self.vocab, t]  # wrong, its child, then the truth
            w = len(tokens) - 3
            parents += [parent, w, parent]
            parent = len(tokens) - 1
        return DraftTree(tuple(tokens), tuple(parents))

    def propose(self, requests, k_per_request, fallback_k=None) -> Drafts:  # type: ignore[no-untyped-def]
        ids, trees, skips = [], [], []
        for req, k in zip(requests, k_per_request):
            truth = self._truth(req, k)
            if self.mode == "tree":
                t = self._tree(truth).cut(k) if truth else None
            elif self.mode == "chain_tree":
                t = DraftTree.chain(truth) if truth else None
            else:
                t = None
            ids.append(list(t.tokens) if t is not None else truth)
            trees.append(t)
            skips.append(None if truth else "no_match")
        return Drafts(ids, None, skips, trees=trees if self.mode != "list" else None)

    def forget(self, request_id: str) -> None:
        pass

    def preempt(self, request_id: str) -> None:
        pass

    def num_cached(self) -> int:
        return 0


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 280, seed=21, lo=5, hi=40)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir, prompts):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)
    return [o.token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]


def _engine(model: str, proposer: Proposer, k: int) -> LLM:
    return llm_drafting_with(lambda _: proposer, model, dtype="float32", speculator="ngram",
                             num_spec_tokens=k, cost_table=FREE_VERIFY, num_kv_blocks=256,
                             attention_backend=BACKEND)


@pytest.mark.parametrize("k", [4, 9])
def test_trees_are_greedy_exact_and_move_the_accepted_kv(tiny_llama_dir, prompts, baseline, k,
                                                         check_integrity):
    refs = {tuple(p): r for p, r in zip(prompts, baseline)}
    llm = _engine(tiny_llama_dir, OracleTrees(refs, 280), k)
    check_integrity(llm.engine)
    seen = watch_steps(llm)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    for i, (p, ref, o) in enumerate(zip(prompts, baseline, outs)):
        assert_greedy_equal(tiny_llama_dir, p, ref, o.token_ids, f"tree k={k} prompt {i}")
    tree_results = [r for _, res in seen for r in res.results if r.num_tree_nodes]
    assert tree_results, "trees were verified"
    # Second branches accepted at depth >= 2: the K/V of node 2 (the truth at depth 0) and
    # deeper had to move past the wrong branches' slots.
    deep = [r for r in tree_results if r.num_accepted_tokens >= 2]
    assert all(r.tree_path == tuple(2 + 3 * d for d in range(r.num_accepted_tokens))
               for r in tree_results)
    assert bool(deep) == (k >= 6), "a budget of 6 nodes reaches the second level's truth"
    # With the truth at every level, a step accepts every level its budget holds whole.
    assert all(r.num_accepted_tokens == r.num_tree_nodes // 3 for r in tree_results)
    steps = len(seen)
    assert steps < len(prompts) * MAX_TOKENS / 2, "trees cut the number of steps"


def test_sampled_trees_run_and_keep_kv_sound(tiny_llama_dir, prompts, baseline, check_integrity):
    refs = {tuple(p): r for p, r in zip(prompts, baseline)}
    llm = _engine(tiny_llama_dir, OracleTrees(refs, 280), 6)
    check_integrity(llm.engine)
    sp = [SamplingParams(temperature=0.7, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True)
          for s in range(len(prompts))]
    a = [o.token_ids for o in llm.generate(prompts, sp)]
    b = [o.token_ids for o in llm.generate(prompts, sp)]
    assert a == b and all(len(x) == MAX_TOKENS for x in a), "seeded sampling reproduces"


def test_a_chain_tree_is_todays_chain(tiny_llama_dir, prompts, baseline):
    refs = {tuple(p): r for p, r in zip(prompts, baseline)}
    got = {}
    for mode in ("list", "chain_tree"):
        llm = _engine(tiny_llama_dir, OracleTrees(refs, 280, mode), 4)
        outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
        c = llm.engine.counters
        got[mode] = ([o.token_ids for o in outs], c.num_steps, c.num_draft_tokens,
                     c.num_accepted_tokens, tuple(c.accepted_per_pos), tuple(c.drafted_per_pos),
                     dict(c.steps_by_k))
    assert got["list"] == got["chain_tree"]
    assert got["list"][0] == baseline


def _branching_prompts(plain: LLM, n: int = 3) -> list[list[int]]:
    """Prompts ending in "a b" where "a b t" occurred before with different continuations, t
    being the token the model emits first: its first drafting step, with "a b t" the longest
    match, has several continuations to branch on. (The tiny random model's first token hardly
    depends on the prompt: two rounds find it.)"""
    g = torch.Generator().manual_seed(15)
    out = []
    for _ in range(n):
        a, b = torch.randint(3, 280, (2,), generator=g).tolist()
        rs = [torch.randint(3, 280, (4,), generator=g).tolist() for _ in range(3)]
        first: list[int] = []
        for _ in range(2):
            seq = []
            for i, r in enumerate(rs + rs[:1]):  # a fresh token before each: "a b t" matches
                seq += [3 + i, a, b, *first, *r]
            seq += [9, a, b]
            first = plain.generate([seq], greedy(1, ignore_eos=True))[0].token_ids
        out.append(seq)
    return out


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_tree_drafters_are_greedy_exact(tiny_llama_dir, speculator, check_integrity):
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)
    prompts = _branching_prompts(plain)
    base = [o.token_ids for o in plain.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]
    llm = LLM(model=tiny_llama_dir, dtype="float32", speculator=speculator, num_spec_tokens=8,
              draft_tree=True, k_policy="table", num_kv_blocks=256, attention_backend=BACKEND)
    check_integrity(llm.engine)
    seen = watch_steps(llm)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    for i, (p, ref, o) in enumerate(zip(prompts, base, outs)):
        assert_greedy_equal(tiny_llama_dir, p, ref, o.token_ids, f"{speculator} tree {i}")
    assert llm.engine.counters.num_accepted_tokens > 0
    assert any(r.num_tree_nodes for _, res in seen for r in res.results), "trees were drafted"


def _tree_series(text: str) -> dict[str, float]:
    """The tree series of a /metrics exposition, by name (their samples summed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if "tree" in name and not line.startswith("#"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_goodput_prices_trees_greedy_exact_and_metrics_show_tree_steps(
        tiny_llama_dir, speculator, check_integrity):
    """The default (goodput) policy with --draft-tree: each request drafts the shape that pays
    (tree_pricing.py); greedy output stays plain decoding's; the policy learns branch rates
    from the trees it ran; /metrics' tree series exist and move with the tree steps."""
    pytest.importorskip("prometheus_client")
    from dynaspec.metrics.prometheus import PrometheusMetrics

    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)
    prompts = _branching_prompts(plain)
    base = [o.token_ids for o in plain.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]
    llm = LLM(model=tiny_llama_dir, dtype="float32", speculator=speculator, num_spec_tokens=8,
              draft_tree=True, cost_table=FREE_VERIFY, num_kv_blocks=256,
              attention_backend=BACKEND)
    check_integrity(llm.engine)
    metrics, record = PrometheusMetrics(), llm.engine.recorder.record

    def record_and_export(landed):  # type: ignore[no-untyped-def]
        step = record(landed)
        metrics.observe_step(step)  # as the server does with each step the engine took
        return step

    llm.engine.recorder.record = record_and_export
    empty = _tree_series(metrics.render().decode())
    assert set(empty) >= {"dynaspec:spec_decode_tree_steps_total",
                          "dynaspec:spec_decode_num_tree_nodes_total",
                          "dynaspec:spec_decode_tree_acceptance_length_count"}
    assert not any(empty.values())
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    for i, (p, ref, o) in enumerate(zip(prompts, base, outs)):
        assert_greedy_equal(tiny_llama_dir, p, ref, o.token_ids, f"{speculator} goodput tree {i}")
    policy = llm.engine.scheduler.policy
    assert type(policy).__name__ == "GoodputPolicy" and policy.settings.drafts_trees
    c = llm.engine.counters
    assert c.num_tree_drafts > 0 and policy.branch_rates.num_updates == c.num_tree_drafts
    assert not c.check_identities()
    got = _tree_series(metrics.render().decode())
    assert got["dynaspec:spec_decode_tree_steps_total"] == c.num_tree_steps > 0
    assert got["dynaspec:spec_decode_num_tree_drafts_total"] == c.num_tree_drafts
    assert got["dynaspec:spec_decode_num_tree_nodes_total"] == c.num_tree_nodes > 0
    assert (got["dynaspec:spec_decode_num_tree_accepted_tokens_total"]
            == c.num_tree_accepted_tokens)
    assert got["dynaspec:spec_decode_tree_acceptance_length_count"] == c.num_tree_drafts
    assert (got["dynaspec:spec_decode_tree_acceptance_length_sum"]
            == c.num_tree_drafts + c.num_tree_accepted_tokens)


def test_draft_tree_refuses_what_it_cannot_carry(tiny_llama_dir):
    # async scheduling and data parallelism compose with trees (test_composition_matrix.py)
    with pytest.raises(ValueError, match="--draft-tree needs --speculator ngram or suffix"):
        LLM(model=tiny_llama_dir, speculator="none", draft_tree=True)
