"""Lossless speculation: greedy with any proposer and any K equals greedy without it."""

from __future__ import annotations

import pytest

from dynaspec import LLM
from tests.cost_tables import FREE_VERIFY

from .conftest import assert_greedy_equal, greedy, random_prompts

MAX_TOKENS = 24


def _run(model: str, prompts, check, **kw) -> tuple[list[list[int]], LLM]:
    # The default policy, with a fixed table where verifying is free: it drafts wherever a
    # request's acceptance is above 0, deterministically.
    kw.setdefault("cost_table", FREE_VERIFY)
    llm = LLM(model=model, dtype="float32", **kw)
    check(llm.engine)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def prompts16():
    return random_prompts(8, 280, seed=5, lo=4, hi=60, repetitive=True) + \
        random_prompts(8, 280, seed=6, lo=4, hi=60)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir, prompts16):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512)
    outs = llm.generate(prompts16, greedy(MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs]


def _check(model, prompts, ref, got, label):
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        assert len(b) == MAX_TOKENS, f"{label} prompt {i}"
        assert_greedy_equal(model, p, a, b, f"{label} prompt {i}")


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_ngram_batch16_each_k(tiny_llama_dir, prompts16, baseline, k, check_integrity):
    got, llm = _run(tiny_llama_dir, prompts16, check_integrity, speculator="ngram",
                    num_spec_tokens=k, prompt_lookup_min=1, num_kv_blocks=512)
    _check(tiny_llama_dir, prompts16, baseline, got, f"ngram k={k}")
    c = llm.engine.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens > 0, (
        "the workload must exercise acceptance"
    )


@pytest.mark.parametrize("prefix", [True, False])
def test_ngram_batch1_prefix_cache_on_off(
    tiny_llama_dir, prompts16, baseline, prefix, check_integrity
):
    for i in (0, 9):
        got, llm = _run(tiny_llama_dir, [prompts16[i]] * 2, check_integrity, speculator="ngram",
                        num_spec_tokens=4, prompt_lookup_min=1, enable_prefix_caching=prefix,
                        num_kv_blocks=256, block_size=4)
        _check(tiny_llama_dir, [prompts16[i]] * 2, [baseline[i]] * 2, got, f"prefix={prefix}")
        # Again, now that the first run's blocks are cached: the prompt must hit (or not, off).
        again = llm.generate([prompts16[i]], greedy(MAX_TOKENS, ignore_eos=True))[0]
        _check(tiny_llama_dir, [prompts16[i]], [baseline[i]], [again.token_ids],
               f"prefix={prefix} again")
        hit = again.num_cached_tokens
        assert (hit > 0) == prefix and llm.engine.kv.prefix_cache_hits >= hit, \
            f"prefix={prefix}: {hit} cached tokens, the cache must {'' if prefix else 'not '}hit"


def test_ngram_under_preemption(tiny_llama_dir, prompts16, baseline, check_integrity):
    got, llm = _run(tiny_llama_dir, prompts16, check_integrity, speculator="ngram",
                    num_spec_tokens=4, prompt_lookup_min=1, num_kv_blocks=24, block_size=8)
    assert llm.engine.scheduler.num_preemptions > 0
    _check(tiny_llama_dir, prompts16, baseline, got, "ngram preempted")


@pytest.mark.parametrize("k", [1, 4, 8])
def test_identical_draft_model_accepts_everything(tiny_llama_dir, prompts16, baseline, k,
                                                  check_integrity):
    got, llm = _run(tiny_llama_dir, prompts16, check_integrity, speculator="draft",
                    draft_model=tiny_llama_dir, num_spec_tokens=k, num_kv_blocks=512)
    _check(tiny_llama_dir, prompts16, baseline, got, f"draft=target k={k}")
    c = llm.engine.counters
    assert c.num_draft_tokens > 0
    assert c.num_accepted_tokens / c.num_draft_tokens > 0.95, (
        "catch-up path must keep acceptance ~100%"
    )


def test_random_draft_model_rejects_and_stays_exact(tiny_llama_dir, tiny_draft_dir, prompts16,
                                                    baseline, check_integrity):
    got, llm = _run(tiny_llama_dir, prompts16, check_integrity, speculator="draft",
                    draft_model=tiny_draft_dir, num_spec_tokens=3, num_kv_blocks=512)
    _check(tiny_llama_dir, prompts16, baseline, got, "random draft")
    c = llm.engine.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens / c.num_draft_tokens < 0.3


def test_draft_model_under_preemption(tiny_llama_dir, prompts16, baseline, check_integrity):
    got, llm = _run(tiny_llama_dir, prompts16, check_integrity, speculator="draft",
                    draft_model=tiny_llama_dir, num_spec_tokens=4, num_kv_blocks=24, block_size=8)
    assert llm.engine.scheduler.num_preemptions > 0
    _check(tiny_llama_dir, prompts16, baseline, got, "draft preempted")


def test_always_zero_is_the_no_speculation_path(
    tiny_llama_dir, prompts16, baseline, check_integrity
):
    got, llm = _run(tiny_llama_dir, prompts16, check_integrity, speculator="draft",
                    draft_model=tiny_llama_dir, k_schedule="[[1, 4, 0], [5, 100, 0]]",
                    kv_cache_memory_gb=0.01)
    none = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_gb=0.01)
    assert llm.engine.plan.kind == "always_zero"
    assert llm.engine.runner.proposer is None, "always_zero must not load the drafter"
    assert llm.engine.pool_report() == none.engine.pool_report()
    assert got == baseline


def test_draft_model_prefill_is_fed_apart_as_setup_with_the_same_drafts(tiny_llama_dir,
                                                                         tiny_draft_dir,
                                                                         monkeypatch):
    """A request's first drafts prefill its prompt in the drafter: that forward runs on its own,
    reported as Drafts.setup_seconds (left out of the policy's per-token cost), and the drafts
    are the ones one forward over the whole prompt gives."""
    from dynaspec.request import Request
    from dynaspec.sampling_params import SamplingParams
    from dynaspec.spec_decode.drafters import draft_model

    prompt = random_prompts(1, 280, seed=9, lo=40, hi=41)[0]
    got = []
    for fresh in (draft_model.FRESH_TOKENS, 10**9):  # 10**9: nothing fed apart
        monkeypatch.setattr(draft_model, "FRESH_TOKENS", fresh)
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, speculator="draft",
                  draft_model=tiny_draft_dir, num_spec_tokens=3)
        prop = llm.engine.runner.proposer
        req = Request("r", list(prompt), SamplingParams(temperature=0.0))
        first = prop.propose([req], [3])
        req.output_token_ids.extend(first.token_ids[0][:1] + [7])  # one accepted, a bonus
        got.append((first, prop.propose([req], [3])))
    (split, again), (whole, whole_again) = got
    assert split.setup_seconds > 0 and whole.setup_seconds == 0 and again.setup_seconds == 0
    assert split.token_ids == whole.token_ids and len(split.token_ids[0]) == 3
    assert again.token_ids == whole_again.token_ids
