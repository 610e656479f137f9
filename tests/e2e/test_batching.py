"""Continuous batching is invisible in the output: batched == alone, prefix hits, preemption."""

from __future__ import annotations

from dynaspec import LLM

from .conftest import assert_greedy_equal, greedy, random_prompts


def _alone(llm: LLM, prompts, params) -> list[list[int]]:
    return [llm.generate([p], params)[0].token_ids for p in prompts]


def test_sixteen_mixed_prompts_batched_equal_alone(tiny_llama_dir, check_integrity):
    model = str(tiny_llama_dir)
    llm = LLM(model=model, dtype="float32", num_kv_blocks=512, max_num_batched_tokens=96)
    check_integrity(llm.engine)
    prompts = random_prompts(16, 200, seed=1, lo=3, hi=90)
    params = greedy(20, ignore_eos=True)
    alone = _alone(llm, prompts, params)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    for i, (p, a, b) in enumerate(zip(prompts, alone, batched)):
        assert len(b) == 20
        assert_greedy_equal(model, p, a, b, f"prompt {i}")


def test_prefix_cache_hit_gives_identical_tokens_and_is_reported(tiny_llama_dir, check_integrity):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)
    check_integrity(llm.engine)
    prompt = random_prompts(1, 200, seed=2, lo=70, hi=71)[0]
    first = llm.generate([prompt], greedy(16, ignore_eos=True))[0]
    hits_before = llm.engine.kv.prefix_cache_hits
    second = llm.generate([prompt], greedy(16, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # whole blocks of the 70-token prompt
    assert llm.engine.kv.prefix_cache_hits - hits_before == 64
    assert second.token_ids == first.token_ids


def test_tiny_pool_forces_preemption_and_outputs_are_unchanged(tiny_llama_dir, check_integrity):
    model = str(tiny_llama_dir)
    prompts = random_prompts(8, 200, seed=3, lo=20, hi=40)
    params = greedy(24, ignore_eos=True)
    roomy = LLM(model=model, dtype="float32", num_kv_blocks=256)
    ref = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(model=model, dtype="float32", num_kv_blocks=16, block_size=8)
    check_integrity(tight.engine)
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        assert_greedy_equal(model, p, a, b, f"prompt {i}")


def test_kv_pool_size_is_deterministic(tiny_llama_dir):
    a = LLM(model=str(tiny_llama_dir), kv_cache_memory_gb=0.01).engine.pool_report()
    b = LLM(model=str(tiny_llama_dir), kv_cache_memory_gb=0.01).engine.pool_report()
    assert a == b and a.num_blocks > 0
    c = LLM(model=str(tiny_llama_dir), num_kv_blocks=37).engine.pool_report()
    assert c.num_blocks == 37 and c.num_tokens == 37 * 16


def test_stop_string_cuts_text_and_finishes(tiny_llama_dir, check_integrity):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    check_integrity(llm.engine)
    prompt = random_prompts(1, 200, seed=4, lo=10, hi=11)[0]
    full = llm.generate([prompt], greedy(24, ignore_eos=True))[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), "need a visible stop string"
    cut = llm.generate([prompt], greedy(24, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert len(cut.token_ids) < len(full.token_ids)
