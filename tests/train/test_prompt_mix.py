"""The head's prompts at scale: >= 100,000 distinct, seeded, in the mix of kinds, never a bench
prompt, and rendered through the chat template exactly as the template renders them."""

from __future__ import annotations

import pytest

from dynaspec.bench import workloads
from dynaspec.models.default_model import default_model_path
from dynaspec.models.gguf_tokenizer import load_gguf_tokenizer
from dynaspec.train import prompt_mix
from dynaspec.train.prompt_mix import Prompt


def test_one_hundred_thousand_distinct_prompts_of_every_kind():
    ps = prompt_mix.make_prompts(100_000, seed=0)
    assert len({p.messages for p in ps}) == 100_000
    kinds = {k: sum(p.kind == k for p in ps) for k in set(prompt_mix.MIX)}
    assert kinds["chat"] > 30_000 and kinds["code_edit"] > 20_000 and kinds["multi_turn"] > 5_000
    assert min(kinds.values()) > 2_000  # explanations and coding asks run out first
    assert all(p.messages[-1][0] == "user" for p in ps)


def test_prompts_are_seeded():
    a, b = prompt_mix.make_prompts(500, seed=4), prompt_mix.make_prompts(500, seed=4)
    assert a == b and prompt_mix.digest(a) == prompt_mix.digest(b)
    assert prompt_mix.digest(prompt_mix.make_prompts(500, seed=5)) != prompt_mix.digest(a)


def test_no_prompt_is_a_bench_prompt():
    ps = prompt_mix.make_prompts(4_000, seed=0)
    assert prompt_mix.leaks(ps) == []
    assert not any(w[:5] in {x[:5] for q in workloads.CHAT_QUESTIONS
                             for x in prompt_mix.chat_topics._words(q)}
                   for s in prompt_mix.subjects() for w in prompt_mix.chat_topics._words(s))
    # code only from files off the bench's modules
    held = {prompt_mix._body(f.source) for f in workloads.stdlib_functions(1, 10**6)}
    assert not held & {f.source for f in prompt_mix.stdlib_functions(0)}


def test_the_leak_check_catches_a_bench_question_and_a_bench_function():
    q = workloads.CHAT_QUESTIONS[3]
    fn = workloads.stdlib_functions()[0].source
    planted = [Prompt("chat", (("user", f"Please answer: {q}"),)),
               Prompt("code_edit", (("user", f"Repeat it.\n\n```python\n{fn}```"),)),
               Prompt("chat", (("user", "Explain tides."),))]
    assert len(prompt_mix.leaks(planted)) == 2


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(default_model_path())[0]


def test_fast_rendering_equals_the_template(tok):
    ps = prompt_mix.make_prompts(300, seed=2)
    assert {len(p.messages) for p in ps} == {1, 3}
    slow = [tok.apply_chat_template([{"role": r, "content": c} for r, c in p.messages])
            for p in ps]
    assert prompt_mix.render(tok, ps) == slow
    ids, keep = prompt_mix.chat_ids(tok, ps, 10_000)
    assert keep == list(range(len(ps))) and ids[0] == tok.encode(slow[0])
    short, kept = prompt_mix.chat_ids(tok, ps, 60)
    assert 0 < len(kept) < len(ps) and all(len(x) <= 60 for x in short)
