"""Structured output with speculation, on tiny random checkpoints (fp32): constrained greedy
output with n-gram or draft-model speculation equals constrained greedy output without it, token
for token; grammar-invalid drafts are cut before verification, counted invalid{grammar}, never
accepted, and a request-step whose drafts were all invalid is a skip, not a draft."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from dynaspec import LLM, SamplingParams  # noqa: E402
from dynaspec.engine.sync_driver import generate  # noqa: E402
from dynaspec.spec_decode.drafters.base import Drafts, Proposer  # noqa: E402
from dynaspec.structured import StructuredOutputParams  # noqa: E402
from dynaspec.structured.backend import allocate_bitmask  # noqa: E402
from tests.cost_tables import FREE_VERIFY  # noqa: E402

from .conftest import NEAR_TIE, _reference_llm, last_logits, llm_drafting_with  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["fox", "dog", "add"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pos": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                "additionalProperties": False},
    },
    "required": ["name", "kind", "n", "tags", "pos"],
    "additionalProperties": False,
}
SPEC = StructuredOutputParams(json=SCHEMA)
_TEXTS = [
    'Example: {"name": "fox", "kind": "fox", "n": 1, "tags": ["a"], "pos": {"x": true}} '
    'Example: {"name": "fox", "kind": "dog", "n": 12, "tags": [], "pos": {"x": false}} Now:',
    '{"name": "dog", "kind": "dog", "n": 2, "tags": ["b", "a"], "pos": {"x": true}}' * 2,
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
]
SPECIAL = 1  # <|im_start|>: a special token, never allowed by any grammar


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    tok = _reference_llm(tiny_llama_dir).tokenizer
    g = torch.Generator().manual_seed(3)
    rand = [torch.randint(3, 280, (n,), generator=g).tolist() for n in (5, 17, 40)]
    # <= 120 prompt tokens: the tiny model's context is 256 and its tokens are ~1 character.
    return [tok.encode(t)[:120] for t in _TEXTS] + rand + [tok.encode(_TEXTS[1])[:20]]


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=100, structured_output=SPEC, **kw)


def _generate(model: str, prompts, params: SamplingParams, **engine_kw):
    engine_kw.setdefault("cost_table", FREE_VERIFY)  # the default policy, deterministic: it drafts
    llm = LLM(model=model, dtype="float32", num_kv_blocks=512, **engine_kw)
    return llm, llm.generate(prompts, params)


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir, prompts):
    _, outs = _generate(tiny_llama_dir, prompts, _params())
    for o in outs:
        assert o.finish_reason == "stop", "the bounded schema must complete within max_tokens"
        jsonschema.validate(json.loads(o.text), SCHEMA)
    return outs


def _masked_logits(model: str, prompt: list[int], prefix: list[int]) -> torch.Tensor:
    """The reference's logits after prompt + prefix, masked by SPEC's state after prefix."""
    logits = last_logits(model, prompt + prefix).clone()[None]  # [1, vocab]
    so = _reference_llm(model).engine.structured
    m = so.backend().matcher(so.compile(SPEC))
    for t in prefix:
        assert m.accept(t)
    bitmask = allocate_bitmask(1, logits.shape[1])
    m.fill_bitmask(bitmask, 0)
    so.backend().apply_bitmask(logits, bitmask, None)
    return logits[0]


def _assert_equal(model: str, prompt: list[int], ref: list[int], got: list[int], label: str):
    """Token-exact, except a divergence at a near tie of the *masked* reference logits."""
    if ref == got:
        return
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    assert i < min(len(ref), len(got)), f"{label}: lengths differ ({len(ref)} vs {len(got)})"
    top2 = torch.topk(_masked_logits(model, prompt, ref[:i]), 2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"{label}: diverged at token {i}: {ref[i]} vs {got[i]}, gap {gap:.3g}"
    print(f"NEAR TIE {label}: token {i}, masked top-2 gap {gap:.2e} (allowed)")


def _check_run(model, prompts, baseline, outs, label):
    for i, (p, a, b) in enumerate(zip(prompts, baseline, outs)):
        _assert_equal(model, p, a.token_ids, b.token_ids, f"{label} prompt {i}")
        assert b.finish_reason == "stop"
        jsonschema.validate(json.loads(b.text), SCHEMA)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_constrained_greedy_equals_no_speculation(tiny_llama_dir, prompts, baseline, k):
    llm, outs = _generate(tiny_llama_dir, prompts, _params(), speculator="ngram",
                          num_spec_tokens=k, prompt_lookup_min=1)
    _check_run(tiny_llama_dir, prompts, baseline, outs, f"ngram k={k}")
    c = llm.engine.counters
    assert c.invalid_draft_tokens.get("grammar", 0) > 0, "the workload must exercise cuts"
    assert c.num_accepted_tokens > 0, "the workload must exercise acceptance"
    assert not c.check_identities()
    llm.engine.check_integrity()


@pytest.mark.parametrize("which", ["identical", "random"])
def test_draft_model_constrained_greedy_equals_no_speculation(tiny_llama_dir, tiny_draft_dir,
                                                              prompts, baseline, which):
    draft = tiny_llama_dir if which == "identical" else tiny_draft_dir
    llm, outs = _generate(tiny_llama_dir, prompts, _params(), speculator="draft",
                          draft_model=draft, num_spec_tokens=3)
    _check_run(tiny_llama_dir, prompts, baseline, outs, f"draft {which}")
    c = llm.engine.counters
    assert c.num_draft_tokens > 0 and not c.check_identities()
    if which == "identical":  # the drafter is masked by the same grammar: it drafts the target
        assert c.num_accepted_tokens / c.num_draft_tokens > 0.95
        assert c.invalid_draft_tokens.get("grammar", 0) <= len(prompts) * 3  # after the stop
    llm.engine.check_integrity()


class _FakeProposer(Proposer):
    """Proposes whatever `fn(request, k)` returns (no probabilities: a deterministic drafter)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.proposed: list[list[int]] = []

    def forget(self, request_id: str) -> None:
        pass

    def preempt(self, request_id: str) -> None:
        pass

    def num_cached(self) -> int:
        return 0

    def propose(self, requests, k_per_request) -> Drafts:
        out = [list(self.fn(r, k))[:k] for r, k in zip(requests, k_per_request)]
        self.proposed.extend(out)
        return Drafts(out, None, [None] * len(out))


def _fake_engine(model: str, fn):
    # Without grammar drafts: the forced tokens would be drafted in place of the fake's.
    return llm_drafting_with(lambda _: _FakeProposer(fn), model, cost_table=FREE_VERIFY,
                             dtype="float32", num_kv_blocks=256, speculator="ngram",
                             num_spec_tokens=3, grammar_drafts=False)


def test_all_invalid_drafts_are_a_skip_never_a_draft(tiny_llama_dir, prompts, baseline):
    llm = _fake_engine(tiny_llama_dir, lambda r, k: [SPECIAL] * k)
    out = llm.generate([prompts[0]], _params())[0]
    assert out.token_ids == baseline[0].token_ids  # same forward shapes as no speculation
    c = llm.engine.counters
    n_decode = len(out.token_ids) - 1  # every sampling step after the prefill proposed drafts
    assert c.num_drafts == 0 and c.num_draft_tokens == 0 and c.num_accepted_tokens == 0
    assert c.draft_skips == {"prefill": 1, "all_invalid": n_decode}
    assert c.invalid_draft_tokens == {"grammar": 3 * n_decode}
    assert dict(out.spec.counters.invalid_draft_tokens) == {"grammar": 3 * n_decode}
    assert not c.check_identities()


def test_drafts_are_cut_at_the_first_grammar_rejection(tiny_llama_dir, prompts, baseline):
    ref = baseline[1].token_ids

    def valid_then_special(r, k):  # the true continuation's next 2 tokens, then an invalid one
        n = r.num_output_tokens
        return ref[n: n + 2] + [SPECIAL, ref[min(n + 2, len(ref) - 1)]]

    llm = _fake_engine(tiny_llama_dir, valid_then_special)
    out = llm.generate([prompts[1]], _params())[0]
    _assert_equal(tiny_llama_dir, prompts[1], ref, out.token_ids, "cut drafts")
    assert SPECIAL not in out.token_ids
    c = llm.engine.counters
    steps = c.num_spec_request_steps - 1  # minus the prefill step
    # Each step (K=3) proposed 2 valid drafts then SPECIAL; near the end fewer valid ones, and
    # then the token after SPECIAL too. Everything from SPECIAL on is cut, never verified.
    assert c.num_drafts == steps and c.invalid_draft_tokens["grammar"] >= steps
    assert c.num_draft_tokens <= 2 * steps and c.num_accepted_tokens >= 0.9 * c.num_draft_tokens
    assert c.num_draft_tokens + c.invalid_draft_tokens["grammar"] == \
        sum(len(d) for d in llm.engine.runner.proposer.proposed)  # every proposed token
    assert not c.check_identities()


def test_terminated_grammar_finishes_stop_even_with_ignore_eos(tiny_llama_dir, prompts):
    choice = StructuredOutputParams(choice=("fox", "lazy dog", "add(a, b)"))
    for kw in ({}, dict(speculator="ngram", num_spec_tokens=4, prompt_lookup_min=1)):
        llm = LLM(
            model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, cost_table=FREE_VERIFY, **kw
        )
        outs = llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=32,
                                                        ignore_eos=True, structured_output=choice))
        for o in outs:
            assert o.finish_reason == "stop" and o.text in choice.choice, (o.text, o.token_ids)
        llm.engine.check_integrity()


def test_random_sampling_with_speculation_follows_the_grammar(tiny_llama_dir, prompts):
    llm = LLM(
        cost_table=FREE_VERIFY,
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=512,
        speculator="draft",
        draft_model=tiny_llama_dir,
        num_spec_tokens=3,
    )
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_output=SPEC)
              for i in range(len(prompts))]
    for o in generate(llm.engine, prompts, params):
        assert o.finish_reason == "stop"
        # strict=False: xgrammar 0.2.9's rule for a string with maxLength admits raw control
        # characters (its plain string rule excludes them), and random sampling finds them.
        jsonschema.validate(json.loads(o.text, strict=False), SCHEMA)
    assert llm.engine.counters.num_accepted_tokens > 0


def test_ngram_constrained_under_preemption(tiny_llama_dir, prompts, baseline):
    """A preempted request keeps its output and so its grammar state; output is unchanged."""
    llm = LLM(
        cost_table=FREE_VERIFY,
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=40,
        block_size=8,
        speculator="ngram",
        num_spec_tokens=3,
        prompt_lookup_min=1,
    )
    outs = llm.generate(prompts, _params())
    assert llm.engine.scheduler.num_preemptions > 0
    _check_run(tiny_llama_dir, prompts, baseline, outs, "ngram preempted")
    llm.engine.check_integrity()


def test_grammar_cut_on_a_compiled_step_keeps_the_compiled_path(tiny_llama_dir, prompts, baseline):
    """--execution compiled: every decode step verifies the planned width 1+K. A grammar cut of a
    real draft used to drop the row's trailing pads too; the short row made the fixed-shape
    runner raise, and the shape was marked broken (eager for the rest of the run). The cut is
    now re-padded to the planned width: the compiled path stays in use, the output is right, and
    every slot is accounted once (valid, grammar, or padding)."""
    ref = baseline[1].token_ids

    def valid_then_special(r, k):  # the true continuation's next 2 tokens, then an invalid one
        n = r.num_output_tokens
        return ref[n: n + 2] + [SPECIAL, ref[min(n + 2, len(ref) - 1)]]

    llm = llm_drafting_with(lambda _: _FakeProposer(valid_then_special), tiny_llama_dir,
                            cost_table=FREE_VERIFY, dtype="float32", num_kv_blocks=256,
                            speculator="ngram", num_spec_tokens=3, k_policy="table",
                            max_num_seqs=1, execution="compiled", compile_backend="aot_eager")
    out = llm.generate([prompts[1]], _params())[0]
    _assert_equal(tiny_llama_dir, prompts[1], ref, out.token_ids, "compiled cut drafts")
    eng = llm.engine
    assert not eng.runner.executor.broken, "a grammar cut marked a compiled shape broken"
    steps = eng.recorder.execution_steps
    # Every step but the prefill is a decode step on the compiled path, none fell back.
    assert steps[("compiled", "4")] == eng.times.steps - 1 > 0, dict(steps)
    assert steps[("eager", "4")] == 0, dict(steps)
    c = eng.counters
    assert c.invalid_draft_tokens["grammar"] > 0, "the workload must cut real drafts"
    decode_rows = c.num_spec_request_steps - 1  # minus the prefill step
    assert c.num_draft_tokens + sum(c.invalid_draft_tokens.values()) == 3 * decode_rows
    assert not c.check_identities()
