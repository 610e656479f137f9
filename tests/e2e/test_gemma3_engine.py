"""Gemma-3 through the engine (tiny random GGUF, fp32, 4-token sliding window): n-gram and suffix
speculation, prefix caching and structured output give the same greedy tokens as plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

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


def test_gemma3_draft_tree_is_refused_where_the_backend_cannot_window_trees(gemma, monkeypatch):
    from dynaspec.attention.paged import EagerPagedBackend
    from dynaspec.engine import tree_setting

    # As a backend that windows a tree's rows by index, not depth, would be.
    monkeypatch.setattr(EagerPagedBackend, "tree_windows", False)
    kw = {"model": gemma, "dtype": "float32", "num_kv_blocks": 64, "speculator": "suffix",
          "num_spec_tokens": 4, "k_policy": "table", "attention_backend": "eager"}
    with pytest.raises(ValueError, match=r"--draft-tree cannot run here: this model's "
                                         r"sliding-window layers \(window 4\)"):
        LLM(draft_tree=True, **kw)  # when the engine is built, before any request
    # A tree setting not asked for falls back to chains, even under a default of trees.
    monkeypatch.setattr(tree_setting, "DRAFT_TREE_DEFAULT", True)
    llm = LLM(**kw)
    assert llm.engine.runner.proposer.drafts_trees is False
    out = llm.generate([list(range(5, 30))], greedy(6, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def _branching_prompts(plain: LLM, n: int = 3) -> list[list[int]]:
    """43-token prompts ending in "a b" where "a b t" occurred before, followed three times by
    r0 and twice by r1, t being the token the model emits first (found by iterating to a fixed
    point): the first drafting step's tree is r0 and then the r1 branch."""
    g = torch.Generator().manual_seed(15)

    def prompt(a: int, b: int, rs: list[list[int]], first: list[int]) -> list[int]:
        seq = []
        for i, r in enumerate([*rs, *rs, rs[0]]):  # a fresh token before each "a b t"
            seq += [3 + i, a, b, *first, *r]
        return seq + [9, a, b]

    out = []
    for _ in range(n):
        a, b = torch.randint(3, 400, (2,), generator=g).tolist()
        rs = [torch.randint(3, 400, (4,), generator=g).tolist() for _ in range(2)]
        first: list[int] = []
        for _ in range(6):
            got = plain.generate([prompt(a, b, rs, first)], greedy(1, ignore_eos=True))[0]
            if got.token_ids == first:
                break
            first = got.token_ids
        out.append(prompt(a, b, rs, first))
    return out


@pytest.mark.parametrize("backend,speculator", [("eager", "ngram"), ("eager", "suffix"),
                                                ("cpu_paged", "suffix")])
def test_gemma3_draft_tree_is_greedy_exact_past_the_window(gemma, backend, speculator,
                                                          check_integrity):
    """Every prompt is longer than the 4-token window: a tree's rows are windowed by depth."""
    if backend == "cpu_paged":
        from dynaspec.attention import cpu_paged

        ok, why = cpu_paged.available()
        if not ok:
            pytest.skip(f"no in-place CPU kernel: {why}")
    plain = LLM(model=gemma, dtype="float32", num_kv_blocks=256, attention_backend=backend,
                enable_prefix_caching=False)
    prompts = _branching_prompts(plain)
    base = [o.token_ids for o in plain.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))]
    llm = LLM(model=gemma, dtype="float32", num_kv_blocks=256, attention_backend=backend,
              speculator=speculator, num_spec_tokens=8, draft_tree=True, k_policy="table")
    check_integrity(llm.engine)
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    for i, (p, ref, o) in enumerate(zip(prompts, base, outs)):
        assert o.finish_reason == "length", o.error
        assert_greedy_equal(gemma, p, ref, o.token_ids, f"{speculator} tree {i}")
    c = llm.engine.counters
    assert c.num_tree_steps > 0 and c.num_tree_nodes > 0, "trees were verified"
