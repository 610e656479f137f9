"""Suffix decoding is lossless (greedy token-exact, fp32) alone, batched and under preemption,
drafts from the global cache across requests, and synthetic mode says it is not lossless."""

from __future__ import annotations

import pytest

from dynaspec import LLM
from tests.cost_tables import FREE_VERIFY

from .conftest import assert_greedy_equal, greedy, random_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts12():
    return random_prompts(6, 280, seed=15, lo=4, hi=60, repetitive=True) + \
        random_prompts(6, 280, seed=16, lo=4, hi=60)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir, prompts12):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512)
    return [o.token_ids for o in llm.generate(prompts12, greedy(MAX_TOKENS, ignore_eos=True))]


def _run(model, prompts, check, **kw):
    llm = LLM(model=model, dtype="float32", speculator="suffix", cost_table=FREE_VERIFY, **kw)
    check(llm.engine)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs], llm


def _check(model, prompts, ref, got, label):
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        assert len(b) == MAX_TOKENS, f"{label} prompt {i}"
        assert_greedy_equal(model, p, a, b, f"{label} prompt {i}")


@pytest.mark.parametrize("k", [1, 4, 8])
def test_suffix_batched_is_greedy_exact(tiny_llama_dir, prompts12, baseline, k, check_integrity):
    got, llm = _run(
        tiny_llama_dir, prompts12, check_integrity, num_spec_tokens=k, num_kv_blocks=512
    )
    _check(tiny_llama_dir, prompts12, baseline, got, f"suffix k={k}")
    c = llm.engine.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens > 0, (
        "the workload must exercise acceptance"
    )
    assert c.draft_skips.get("no_match", 0) > 0, "misses are reported as no_match skips"
    assert 0 < len(c.drafted_per_pos) <= k, "the K policy's per-request cap holds"


def test_suffix_alone_each_prompt(tiny_llama_dir, prompts12, baseline, check_integrity):
    for i in (0, 3, 8):
        got, _ = _run(tiny_llama_dir, [prompts12[i]], check_integrity, num_spec_tokens=6,
                      num_kv_blocks=256)
        _check(tiny_llama_dir, [prompts12[i]], [baseline[i]], got, f"alone {i}")


def test_suffix_under_preemption(tiny_llama_dir, prompts12, baseline, check_integrity):
    got, llm = _run(tiny_llama_dir, prompts12, check_integrity, num_spec_tokens=4,
                    num_kv_blocks=24, block_size=8)
    assert llm.engine.scheduler.num_preemptions > 0
    _check(tiny_llama_dir, prompts12, baseline, got, "suffix preempted")


def test_global_cache_drafts_a_repeated_request(
    tiny_llama_dir, prompts12, baseline, check_integrity
):
    """A prompt seen before: its earlier output, now in the global cache, drafts the answer."""
    llm = LLM(
        cost_table=FREE_VERIFY,
        model=tiny_llama_dir,
        dtype="float32",
        speculator="suffix",
        num_spec_tokens=8,
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    check_integrity(llm.engine)
    prompt = prompts12[8]  # not repetitive: its own context offers few matches
    first = llm.generate([prompt], greedy(MAX_TOKENS, ignore_eos=True))[0]
    c1 = llm.engine.counters
    second = llm.generate([prompt], greedy(MAX_TOKENS, ignore_eos=True))[0]
    c2 = llm.engine.counters - c1
    assert first.token_ids == second.token_ids == baseline[8]
    stats = llm.engine.pool_report().drafter_cache
    assert stats.requests == 2 and stats.global_drafts > 0
    assert c2.num_accepted_tokens > c1.num_accepted_tokens, "the cached output must pay"
    assert first.spec.lossless is True


def test_synthetic_mode_marks_output_not_lossless(tiny_llama_dir, prompts12, check_integrity):
    llm = LLM(
        cost_table=FREE_VERIFY,
        model=tiny_llama_dir,
        dtype="float32",
        speculator="ngram",
        num_spec_tokens=4,
        prompt_lookup_min=1,
        rejection_mode="synthetic",
        synthetic_acceptance="0.9",
        num_kv_blocks=256,
    )
    check_integrity(llm.engine)
    outs = llm.generate(prompts12[:4], greedy(MAX_TOKENS, ignore_eos=True))
    assert all(o.spec.lossless is False for o in outs), "temperature 0 must not claim exactness"
    assert llm.engine.counters.num_accepted_tokens > 0
    assert not llm.engine.lossless


def test_synthetic_refuses_structured_output(tiny_llama_dir):
    from dynaspec import SamplingParams
    from dynaspec.structured_params import StructuredOutputParams

    llm = LLM(
        cost_table=FREE_VERIFY,
        model=tiny_llama_dir,
        dtype="float32",
        speculator="ngram",
        num_spec_tokens=2,
        rejection_mode="synthetic",
        synthetic_acceptance=0.5,
        num_kv_blocks=64,
    )
    grammar = StructuredOutputParams(choice=("yes", "no"))
    with pytest.raises(ValueError, match="structured output cannot be combined"):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, structured_output=grammar))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kw, msg", [
    (dict(rejection_mode="synthetic"), "needs --synthetic-acceptance"),
    (dict(rejection_mode="synthetic", synthetic_acceptance="0.5", speculator="none",
          num_spec_tokens=0), "needs a --speculator"),
    (dict(synthetic_acceptance="0.5"), "only applies with --rejection-mode synthetic"),
    (dict(rejection_mode="synthetic", synthetic_acceptance="0.5,1.5"), r"in \[0, 1\]"),
    (dict(rejection_mode="lenient"), "unknown rejection_mode"),
    (dict(suffix_max_depth=2), "suffix_max_depth"),
    (dict(suffix_cache_max_requests=-1), "suffix_cache_max_requests"),
])
def test_bad_settings_are_refused(kw, msg):
    from dynaspec.config import EngineConfig
    args = dict(speculator="suffix", num_spec_tokens=4)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        EngineConfig.from_kwargs(**args)


def test_synthetic_rates_measured_by_the_engine_counters(tiny_llama_dir):
    """Over >= 5,000 drafts, the engine's own per-position counters show the requested
    conditional rates: accepted_per_pos[i] / drafted_per_pos[i] = prod_{j<=i} rate_j."""
    import math

    rates = (0.8, 0.5, 0.5)
    # A draft model (here the target itself) always drafts K, so every position is exercised.
    llm = LLM(model=tiny_llama_dir, dtype="float32", speculator="draft", draft_model=tiny_llama_dir,
              num_spec_tokens=3, rejection_mode="synthetic",
              synthetic_acceptance=",".join(map(str, rates)), num_kv_blocks=1200, seed=11,
              cost_table=FREE_VERIFY)  # synthetic rates priced on a free verify: K every step
    prompts = random_prompts(64, 280, seed=21, lo=8, hi=30)
    llm.generate(prompts, greedy(200, ignore_eos=True))
    c = llm.engine.counters
    assert c.num_drafts >= 5000 and not c.check_identities()
    survive = 1.0
    for i, rate in enumerate(rates):
        survive *= rate
        n = c.drafted_per_pos[i]
        got = c.accepted_per_pos[i] / n
        sigma = math.sqrt(survive * (1 - survive) / n)
        assert abs(got - survive) <= 4 * sigma, f"position {i}: {got:.4f} vs {survive:.4f} (n={n})"


def test_bench_passes_start_with_an_empty_suffix_cache(tiny_llama_dir):
    from dynaspec.bench.compare import EngineArm, make_params
    from dynaspec.bench.workloads import WorkItem

    kw = dict(model=tiny_llama_dir, dtype="float32", speculator="suffix", num_spec_tokens=4,
              num_kv_blocks=128, enable_prefix_caching=False, cost_table=FREE_VERIFY)
    arm = EngineArm("suffix", kw)
    items = [WorkItem(p, 12, f"p{i}") for i, p in enumerate(random_prompts(2, 280, seed=3))]
    params = make_params(items, None, 0.0, 0, ignore_eos=True)
    first = arm.run(items, params, 1, "b-p0")
    second = arm.run(items, params, 1, "b-p1")
    assert arm.engine.pool_report().drafter_cache.requests == 2, "not 4: reset per pass"
    counts = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")
    assert first.outputs == second.outputs
    assert [first.spec[c] for c in counts] == [second.spec[c] for c in counts], "passes are alike"


def test_cold_prefix_cache_passes_share_prefixes_only_within_a_pass(tiny_llama_dir):
    # `bench compare --prefix-caching cold`: the engine's default prefix caching, emptied
    # before each pass; the second request of a pass reuses the first's prefix, and no pass
    # finds the previous pass's blocks.
    from dynaspec.bench.compare import EngineArm, make_params
    from dynaspec.bench.workloads import WorkItem

    kw = dict(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128)
    prefix = random_prompts(1, 280, seed=4, lo=48, hi=49)[0]
    items = [WorkItem(prefix + [5 + i], 6, f"p{i}") for i in range(2)]
    params = make_params(items, None, 0.0, 0, ignore_eos=True)
    for cold, want in ((True, [48, 48]), (False, [48, 96])):
        arm = EngineArm("plain", kw, cold_prefix_cache=cold)
        kv = arm.engine.kv
        hits = []
        for p in range(2):
            before = kv.prefix_cache_hits
            arm.run(items, params, 1, f"a-p{p}")
            hits.append(kv.prefix_cache_hits - before)
        assert hits == want, (cold, hits)
