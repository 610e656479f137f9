"""--speculator eagle: lossless greedy (fp32 and the default quantized path, where the C++ layer
stack captures the features), drafts accepted, and the head's KV built from each step's accepted
rows equals the head run once over the whole sequence."""

from __future__ import annotations

import gguf
import pytest
import torch

from dynaspec import LLM
from dynaspec.models import int8_dot
from dynaspec.train.draft_head import target_pass
from tests.cost_tables import FREE_VERIFY

from ..model.tiny_eagle import write_eagle1, write_eagle3
from .conftest import greedy, random_prompts

MAX_TOKENS = 24
needs_kernels = pytest.mark.skipif(
    int8_dot.kernel_isa() == "unavailable", reason="the C++ kernels are not built"
)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 280, seed=5, lo=6, hi=40, repetitive=True) + random_prompts(
        2, 280, seed=6
    )


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("heads")
    return {
        "copy": write_eagle1(str(d / "copy"), copy=True),
        "eagle1": write_eagle1(str(d / "e1"), layers=2),
        "eagle3": write_eagle3(
            str(d / "e3"), fmt="bin", prefix="layers.0.", aux=[0, 1, 1], scale=0.3
        ),
    }


@pytest.fixture(scope="module")
def q41(tiny_llama_dir, make_tiny_gguf, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("eagle_q41") / "t.gguf"
    return make_tiny_gguf(tiny_llama_dir, str(out), tensor_type=gguf.GGMLQuantizationType.Q4_1)


def _run(model: str, prompts, **kw):
    llm = LLM(model=model, num_kv_blocks=256, k_policy="table", **kw)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    llm.engine.check_integrity()
    assert not kw.get("speculator") or llm.engine.runner.proposer.num_cached() == 0  # state dropped
    return [o.token_ids for o in outs], llm.engine.counters


@pytest.mark.parametrize("path", ["fp32", pytest.param("q4_1", marks=needs_kernels)])
def test_greedy_with_eagle_heads_equals_no_speculation(tiny_llama_dir, q41, heads, prompts, path):
    model, kw = (tiny_llama_dir, {"dtype": "float32"}) if path == "fp32" else (q41, {})
    ref, _ = _run(model, prompts, **kw)
    for name, head in heads.items():
        got, c = _run(model, prompts, speculator="eagle", draft_head=head, num_spec_tokens=3, **kw)
        assert got == ref, name
        assert c.num_draft_tokens > 0, name
        if name == "copy":  # drafts the target's own choice: most are accepted, at every position
            assert (
                c.num_accepted_tokens > 0.4 * c.num_emitted_tokens and min(c.accepted_per_pos) > 0
            )


def test_goodput_policy_drafts_with_the_head_and_stays_lossless(tiny_llama_dir, heads, prompts):
    ref, _ = _run(tiny_llama_dir, prompts, dtype="float32")
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="eagle",
              draft_head=heads["copy"], num_spec_tokens=3, cost_table=FREE_VERIFY)  # default policy
    assert llm.engine.parts.policy_info.name == "goodput"
    got = [o.token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]
    assert got == ref and llm.engine.counters.num_accepted_tokens > 0



def test_the_policy_learns_the_drafting_cost_without_the_heads_prefill(tiny_llama_dir, heads,
                                                                       prompts):
    """A request's first drafts feed its prompt to the head (setup seconds): the goodput policy
    is handed each step's drafting seconds less that, so a prefill is not priced per token."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="eagle",
              draft_head=heads["eagle3"], num_spec_tokens=3, cost_table=FREE_VERIFY,
              enable_prefix_caching=False)
    sched = llm.engine.scheduler
    pol, observe, seen, runs = sched.policy, sched._observe_step, [], []
    sched._observe_step = lambda out, res: (runs.append(res), observe(out, res))[1]
    learn = pol.observe_step
    pol.observe_step = lambda *a, **kw: (seen.append((a[4], runs[-1])), learn(*a, **kw))[1]
    llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    assert any(r.draft_setup_seconds > 0 for _, r in seen)  # prompts of 6-40 tokens fed apart
    for given, r in seen:
        assert 0 <= r.draft_setup_seconds <= r.draft_seconds
        assert given == r.draft_seconds - r.draft_setup_seconds


@needs_kernels
def test_head_kv_from_accepted_rows_equals_one_pass_and_stack_capture_equals_loop(q41, heads):
    llm = LLM(model=q41, num_kv_blocks=128, speculator="eagle", draft_head=heads["copy"],
              num_spec_tokens=3, k_policy="table")
    prop, model = llm.engine.runner.proposer, llm.engine.parts.model
    assert model._stack is not None
    kept = {}
    forget = prop.forget
    prop.forget = lambda rid: (kept.setdefault(rid, prop.seqs.get(rid)), forget(rid))
    out = llm.generate([list(range(5, 25)) * 2], greedy(30, ignore_eos=True))[0]
    assert llm.engine.counters.num_accepted_tokens > 10
    st = next(iter(kept.values()))
    seq = out.prompt_token_ids + out.token_ids
    feats, _ = target_pass(model, [seq], torch.float32)[0]  # through the C++ stack's capture
    stack, model._stack = model._stack, None
    try:
        loop, _ = target_pass(model, [seq], torch.float32)[0]  # through the Python layer loop
    finally:
        model._stack = stack
    assert torch.equal(feats, loop)
    head, n = prop.head, st.next_pos
    # Fed up to the token before the newest at the last propose; the last step emits <= 1 + K more.
    assert len(seq) - 2 - 4 <= n <= len(seq) - 2
    emb = model.embed(torch.tensor(seq[1: n + 1])).float()
    h = head.fuse(feats[:n], emb)
    cos, sin = head.rope.lookup(torch.arange(n), h.dtype)
    _, k, _ = head.layers[0].qkv(h, emb, cos, sin)
    torch.testing.assert_close(st.keys[0][: st.klen], k)


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_lookup_first_eagle_equals_no_speculation(tiny_llama_dir, heads, prompts, lookup):
    """--eagle-lookup: the lookup drafts on the repetitive prompts, the head elsewhere; greedy
    output is unchanged and both drafters' state is dropped at the end (checked in _run)."""
    ref, _ = _run(tiny_llama_dir, prompts, dtype="float32")
    got, c = _run(tiny_llama_dir, prompts, dtype="float32", speculator="eagle",
                  draft_head=heads["eagle3"], num_spec_tokens=3, eagle_lookup=lookup)
    assert got == ref
    _, alone = _run(tiny_llama_dir, prompts, dtype="float32", speculator=lookup,
                    num_spec_tokens=3)
    assert 0 < alone.num_draft_tokens < c.num_draft_tokens  # the head drafts where it finds none


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_hybrid_tree_equals_no_speculation_and_counts_tokens_by_source(tiny_llama_dir, heads,
                                                                        prompts, lookup):
    """--speculator hybrid: the lookup's chains and the head's guesses in one tree per step,
    verified as trees while the head reads the accepted path's hidden states; greedy output is
    unchanged and the counters split drafts and accepted tokens by source."""
    ref, _ = _run(tiny_llama_dir, prompts, dtype="float32")
    trees = []
    for head in ("eagle3", "copy"):  # a random head; one always right
        got, c = _run(tiny_llama_dir, prompts, dtype="float32", speculator="hybrid",
                      draft_head=heads[head], num_spec_tokens=6, eagle_lookup=lookup)
        assert got == ref, head
        by_src, acc = dict(c.draft_tokens_by_source), dict(c.accepted_tokens_by_source)
        assert set(by_src) == {"eagle", lookup} and sum(by_src.values()) == c.num_draft_tokens
        assert sum(acc.values()) == c.num_accepted_tokens and not c.check_identities()
        trees.append((c.num_tree_drafts, c.num_tree_accepted_tokens))
    assert acc["eagle"] > 0 and acc[lookup] > 0  # the right head: its drafts accepted
    # Where a match is shorter than the budget the head drafts past it or beside it: with suffix
    # drafts (sized by their evidence) the random head's branches make trees, verified as trees
    # while the head reads the accepted paths' hidden states (n-gram copies here fill the
    # budget: chains). Deterministic: seeded prompts, greedy, the table's K.
    if lookup == "suffix":
        assert trees[0][0] > 0 and trees[0][1] > 0, trees


def test_eagle_drafts_past_the_targets_position_table(tiny_llama_dir, tmp_path):
    """The head's RoPE table covers every position the engine may run (a context past the
    target's max_position_embeddings under --allow-long-max-model-len), so drafting there is
    lossless instead of an index error that ends the step."""
    import json
    import os

    with open(os.path.join(tiny_llama_dir, "config.json"), encoding="utf-8") as f:
        mpe = json.load(f)["max_position_embeddings"]
    head = write_eagle3(str(tmp_path / "h"), scale=0.3)
    prompt = random_prompts(1, 280, seed=3, lo=mpe + 8, hi=mpe + 9)[0]
    kw = dict(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256,
              max_model_len=2 * mpe, allow_long_max_model_len=True)
    ref = LLM(**kw).generate([prompt], greedy(16, ignore_eos=True))[0].token_ids
    llm = LLM(**kw, speculator="eagle", draft_head=head, num_spec_tokens=3, k_policy="table")
    got = llm.generate([prompt], greedy(16, ignore_eos=True))[0].token_ids
    assert got == ref and llm.engine.counters.num_draft_tokens > 0
