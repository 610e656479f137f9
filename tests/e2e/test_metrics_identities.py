"""After real runs of the default model, the speculation counters obey their identities."""

from __future__ import annotations

import pytest

from dynaspec import LLM, SamplingParams
from tests.cost_tables import FREE_VERIFY

PROMPTS = [
    "<|im_start|>user\nRepeat exactly: for i in range(10):\n    print(i * "
    "i)\n<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is a prime number?<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The list is: apple, banana, cherry, apple, banana, cherry, apple,",
]


def _check(llm: LLM, outs) -> None:
    c = llm.engine.counters
    assert c.check_identities() == []
    assert c.num_accepted_tokens <= c.num_draft_tokens
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens
    assert sum(c.drafted_per_pos) == c.num_draft_tokens
    assert sum(c.steps_by_k.values()) == c.num_steps
    assert c.num_drafts > 0
    assert c.mean_acceptance_length == pytest.approx(1 + c.num_accepted_tokens / c.num_drafts)
    assert c.num_emitted_tokens == sum(len(o.token_ids) for o in outs)
    for o in outs:  # per request: the same identities, and emitted counted apart from accepted
        assert o.spec is not None
        s = o.spec.counters
        assert sum(s.accepted_per_pos) == s.num_accepted_tokens <= s.num_draft_tokens
        assert s.num_emitted_tokens == len(o.token_ids)


def test_identities_hold_after_ngram_run():
    llm = LLM(model="default", num_kv_blocks=256, speculator="ngram", num_spec_tokens=4,
              cost_table=FREE_VERIFY)  # the default policy on a fixed table: it drafts
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    _check(llm, outs)


def test_identities_hold_with_a_variable_schedule():
    llm = LLM(model="default", num_kv_blocks=256, speculator="ngram", num_spec_tokens=4,
              k_schedule="[[1, 1, 4], [2, 3, 2], [4, 64, 0]]")
    assert llm.engine.plan.kind == "variable"
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (12, 24, 36, 48)]
    outs = llm.generate(PROMPTS, params)
    _check(llm, outs)
    steps = llm.engine.counters.steps_by_k
    assert steps.get(0, 0) > 0 and (steps.get(2, 0) + steps.get(4, 0)) > 0, steps
    assert llm.engine.counters.draft_skips.get("schedule_zero", 0) > 0
