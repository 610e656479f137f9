"""The SpecPlan is the single source of the width: scheduler, runner and metrics agree."""

from __future__ import annotations

from dynaspec import LLM

from .conftest import assert_greedy_equal, greedy, random_prompts, watch_steps


def test_constant_normalisation_seen_identically(tiny_llama_dir, check_integrity):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512, speculator="ngram",
              num_spec_tokens=3, k_schedule="[[1, 8, 5], [9, 16, 4]]", prompt_lookup_min=1)
    check_integrity(llm.engine)
    plan = llm.engine.plan
    assert (plan.kind, plan.max_k, plan.widths) == ("constant", 3, (4,))
    seen = watch_steps(llm)
    prompts = random_prompts(12, 280, seed=11, lo=5, hi=40, repetitive=True)
    llm.generate(prompts, greedy(16, ignore_eos=True))
    for out, res in seen:
        assert out.step_k == 3  # scheduler
        assert all(s.draft_budget <= 3 for s in out.scheduled)
        decoding = [s for s in out.scheduled if s.num_new_tokens == 1]
        for s, r in zip(out.scheduled, res.results):  # runner: no request verifies past 1+k
            if s in decoding:
                assert r.num_draft_tokens + r.num_padding_tokens <= 3
        assert out.batch.width in (4, None), "the planned width is the plan's, or None (mixed)"
        assert res.batch.width == out.batch.width
    c = llm.engine.counters  # metrics
    assert set(c.steps_by_k) == {3}
    assert len(c.drafted_per_pos) <= 3 and len(c.accepted_per_pos) <= 3
    assert any(x.num_draft_tokens == 3 for _, r in seen for x in r.results), "full width must occur"
    assert c.check_identities() == []


def test_prefix_hit_first_decode_is_padded_in_constant_plan(tiny_llama_dir, check_integrity):
    # table: the constant plan's uniform width is under test (goodput would add width 1)
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        k_policy="table",
        speculator="ngram",
        num_spec_tokens=4,
        prompt_lookup_min=3,
        prompt_lookup_max=3,
        max_num_seqs=1,
        execution="compiled",
        compile_backend="aot_eager",
    )
    check_integrity(llm.engine)
    prompt = list(range(10, 43))  # 33 tokens: no repeated 3-gram, 32 cacheable
    ref = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256).generate(
        [prompt], greedy(8, ignore_eos=True))[0].token_ids
    llm.generate([prompt], greedy(8, ignore_eos=True))
    seen = watch_steps(llm)
    before = llm.engine.counters
    out = llm.generate([prompt], greedy(8, ignore_eos=True))[0]
    assert out.num_cached_tokens == 32
    first_out, first_res = seen[0]
    assert first_out.batch.fixed_shape and first_out.scheduled[0].sampling
    assert first_out.batch.width == 5 and first_res.batch.path == "compiled", \
        "the hit request verifies the full width 1+k on the fixed-shape path"
    assert first_res.results[0].num_padding_tokens == 4
    assert first_res.results[0].num_draft_tokens == 0
    delta = llm.engine.counters - before
    # Every later decode step is padded to the width too (partial n-gram matches).
    assert delta.invalid_draft_tokens.get("padding") == sum(r.results[0].num_padding_tokens
                                                             for _, r in seen) >= 4
    assert all(r.results[0].num_padding_tokens + r.results[0].num_draft_tokens == 4
               for o, r in seen if r.results[0].token_ids)
    assert delta.num_draft_tokens == sum(r.results[0].num_draft_tokens for _, r in seen)
    assert_greedy_equal(tiny_llama_dir, prompt, ref, out.token_ids, "padded prefix hit")
