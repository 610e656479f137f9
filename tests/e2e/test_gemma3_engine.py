"""Gemma-3 through the engine (tiny random GGUF, fp32, 4-token sliding window): n-gram and suffix
speculation, prefix caching and structured output give the same greedy tokens as plain decoding."""

from __future__ import annotations

import json

import pytest

from dynaspec import LLM, SamplingParams
from tests.model.tiny_gemma3 import build_tiny_gemma3

from .conftest import assert_greedy_equal, greedy, random_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    return build_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3_e2e")))[0]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 400, seed=21, lo=5, hi=50, repetitive=True) + random_prompts(
        3, 400, seed=22, lo=5, hi=40
    )


@pytest.fixture(scope="module")
def baseline(gemma, prompts):
    llm = LLM(model=gemma, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_gemma3_speculation_is_greedy_exact(gemma, prompts, baseline, speculator, check_integrity):
    llm = LLM(model=gemma, dtype="float32", num_kv_blocks=256, speculator=speculator,
              num_spec_tokens=4, k_policy="table", prompt_lookup_min=1)
    check_integrity(llm.engine)
    got = [o.token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]
    for i, (p, a, b) in enumerate(zip(prompts, baseline, got)):
        assert_greedy_equal(gemma, p, a, b, f"{speculator} prompt {i}")
    c = llm.engine.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens > 0, (
        "the workload must exercise acceptance"
    )


def test_gemma3_prefix_cache_hit_is_exact(gemma, prompts, baseline):
    # A windowed layer's cached KV is the same KV: a second run served from the cache must agree.
    llm = LLM(
        model=gemma, dtype="float32", num_kv_blocks=256, enable_prefix_caching=True, block_size=4
    )
    long = [p for p in prompts if len(p) > 20][:2]
    first = [o.token_ids for o in llm.generate(long, greedy(MAX_TOKENS, ignore_eos=True))]
    again = llm.generate(long, greedy(MAX_TOKENS, ignore_eos=True))
    assert all(o.num_cached_tokens > 0 for o in again)
    for i, (p, a, o) in enumerate(zip(long, first, again)):
        assert_greedy_equal(gemma, p, a, o.token_ids, f"cached prompt {i}")


def test_gemma3_structured_output_with_ngram_equals_without(gemma):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    from dynaspec.structured import StructuredOutputParams

    params = SamplingParams(
        temperature=0.0, max_tokens=60, structured_output=StructuredOutputParams(json=schema)
    )
    prompt = 'Answer {"n": 3, "ok": true} and {"n": 4, "ok": false}; now:'
    outs = []
    for kw in (
        {},
        {"speculator": "ngram", "num_spec_tokens": 3, "k_policy": "table", "prompt_lookup_min": 1},
    ):
        llm = LLM(model=gemma, dtype="float32", num_kv_blocks=256, **kw)
        outs.append(llm.generate([prompt], params)[0])
    assert outs[0].token_ids == outs[1].token_ids
    if outs[0].finish_reason == "stop":
        assert set(json.loads(outs[0].text)) == {"n", "ok"}


def test_gemma3_compiled_uniform_path_with_windows_is_exact(gemma, prompts, baseline):
    # Fixed-shape decode/verify runs the uniform backend under torch.compile, windows included.
    llm = LLM(model=gemma, dtype="float32", num_kv_blocks=256, execution="compiled",
              speculator="ngram", num_spec_tokens=3, k_policy="table", prompt_lookup_min=1,
              enable_prefix_caching=False)
    some = prompts[:3]
    got = [o.token_ids for o in llm.generate(some, greedy(MAX_TOKENS, ignore_eos=True))]
    for i, (p, a, b) in enumerate(zip(some, baseline, got)):
        assert_greedy_equal(gemma, p, a, b, f"compiled prompt {i}")
    steps = llm.engine.recorder.execution_steps
    assert sum(n for (path, _), n in steps.items() if path == "compiled") > 0
