"""Penalties, logit_bias, min_tokens and bad words under speculation (fp32, tiny Llama):
greedy with n-gram speculation equals greedy without it, token for token, with each of them on,
and each setting really changes the output (so the comparison is not vacuous)."""

from __future__ import annotations

import pytest
import torch

from dynaspec import LLM, SamplingParams
from dynaspec.sample.logits_processor import RowSpan, process_rows

from .conftest import NEAR_TIE, last_logits, random_prompts

MAX_TOKENS = 20
# Each setting is built from the unprocessed greedy outputs `u`, so it surely changes them (the
# tiny random model repeats a few tokens; a fixed banned id would usually never come up).
SETTINGS = {
    # Mild penalties: strong ones stop all repetition, and the n-gram drafts with it.
    "presence": lambda u: dict(presence_penalty=0.4),
    "frequency": lambda u: dict(frequency_penalty=0.2),
    "repetition": lambda u: dict(repetition_penalty=1.8),
    "logit_bias": lambda u: dict(logit_bias={u[0][0]: -100.0, 40: 6.0, 100: 3.0}),
    # The first output token becomes a stop token, banned until 12 tokens are out.
    "min_tokens": lambda u: dict(min_tokens=12, stop_token_ids=(u[0][0],)),
    "bad_words": lambda u: dict(bad_words_ids=((u[1][0],), tuple(u[0][:2]), (50, 51, 52))),
    "all": lambda u: dict(presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.3,
                          logit_bias={40: 2.0}),
}


def _params(**kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 280, seed=11, lo=6, hi=50, repetitive=True) + \
        random_prompts(3, 280, seed=12, lo=4, hi=40)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512)
    spec = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512, speculator="ngram",
               num_spec_tokens=4, prompt_lookup_min=1, k_policy="table")
    return plain, spec


def _assert_equal(model: str, prompt: list[int], params: SamplingParams, ref: list[int],
                  got: list[int], label: str) -> None:
    """Token-exact, except at a near tie of the reference's *processed* top-2 logits."""
    if ref == got:
        return
    i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    assert i is not None, f"{label}: lengths differ ({len(ref)} vs {len(got)})"
    row = last_logits(model, prompt + ref[:i]).float()[None]
    span = RowSpan(0, [], ref[:i], prompt, params)
    top2 = torch.topk(process_rows(row, span, (2,))[0], 2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"{label}: diverged at token {i}: {ref[i]} vs {got[i]} (gap {gap:.3g})"
    print(f"NEAR TIE {label}: token {i}, gap {gap:.2e}")


@pytest.fixture(scope="module")
def unprocessed(engines, prompts):
    return [o.token_ids for o in engines[0].generate(prompts, _params())]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_spec_equals_plain(tiny_llama_dir, engines, prompts, unprocessed, name):
    plain, spec = engines
    params = _params(**SETTINGS[name](unprocessed))
    before = spec.engine.counters.num_accepted_tokens
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    got = [o.token_ids for o in spec.generate(prompts, params)]
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        _assert_equal(tiny_llama_dir, p, params, a, b, f"{name} prompt {i}")
    assert spec.engine.counters.num_accepted_tokens > before, "the workload must accept drafts"
    assert unprocessed != ref, f"{name} must change the greedy output"


def test_each_setting_does_what_it_says(engines, prompts):
    plain, _ = engines
    outs = plain.generate(prompts, _params(logit_bias={41: -100.0}, bad_words_ids=((50,),)))
    assert all(41 not in o.token_ids and 50 not in o.token_ids for o in outs)
    forced = plain.generate(prompts, _params(logit_bias={77: 100.0}))
    assert all(set(o.token_ids) == {77} for o in forced)
    long = plain.generate(prompts, _params(min_tokens=MAX_TOKENS, ignore_eos=False))
    assert all(len(o.token_ids) == MAX_TOKENS and 2 not in o.token_ids for o in long)


def test_draft_rows_see_the_drafts_before_them():
    """Row j of a verified span equals processing one row token by token after drafts[:j]."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 32, generator=g)
    params = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4,
                            repetition_penalty=1.3, logit_bias={3: 1.0}, min_tokens=4,
                            stop_token_ids=(5,), bad_words_ids=((7, 8), (9,)))
    output, drafts, prompt = [1, 7, 3], [8, 7, 3], [4, 4, 6]
    batched = process_rows(rows.clone(), RowSpan(0, drafts, output, prompt, params), (2,))
    for j in range(4):
        one = process_rows(rows[j:j + 1].clone(),
                           RowSpan(0, [], output + drafts[:j], prompt, params), (2,))
        assert torch.equal(batched[j], one[0]), f"row {j}"
    inf = float("-inf")
    assert batched[0, 2] == batched[0, 5] == inf and batched[1, 5] > inf  # min_tokens=4
    assert batched[0, 8] > inf and batched[2, 8] == inf  # (7, 8): banned right after a 7
    assert (batched[:, 9] == inf).all()


def test_async_scheduling_sees_the_landed_tokens(tiny_llama_dir, engines, prompts, unprocessed):
    """Async scheduling prepares step N+1 after N's tokens land, so penalties see them too."""
    params = _params(**SETTINGS["all"](unprocessed))
    ref = [o.token_ids for o in engines[0].generate(prompts, params)]
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=512, speculator="ngram",
              num_spec_tokens=4, prompt_lookup_min=1, k_policy="table", async_scheduling=True)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        _assert_equal(tiny_llama_dir, p, params, a, b, f"async prompt {i}")


def test_min_tokens_defers_stop_strings(engines, prompts, unprocessed):
    plain, spec = engines
    # A prompt whose first output token is whole text (byte-level tokens can be half a char).
    i, stop = next((i, t) for i, u in enumerate(unprocessed)
                   if (t := plain.tokenizer.decode(u[:1])).strip() and "\ufffd" not in t)
    early = plain.generate([prompts[i]], _params(stop=[stop], ignore_eos=False))[0]
    assert early.token_ids == unprocessed[i][:1] and early.finish_reason == "stop"
    for llm in (plain, spec):
        late = llm.generate([prompts[i]], _params(stop=[stop], min_tokens=6, ignore_eos=False))[0]
        assert len(late.token_ids) >= 6 and late.finish_reason == "stop", late


def test_min_tokens_never_empties_a_grammar_row(engines, prompts):
    """A grammar that can only end, with min_tokens banning the end: the row keeps its grammar
    mask (the step used to fail: the ban was applied in place to the row it restored from)."""
    from dynaspec.structured import StructuredOutputParams

    pytest.importorskip("xgrammar")
    for llm in engines:
        for params in (SamplingParams(min_tokens=20, max_tokens=20, temperature=1.0, seed=1,
                                      structured_output=StructuredOutputParams(choice=["0"])),
                       _params(min_tokens=20, ignore_eos=False,
                               structured_output=StructuredOutputParams(json_object=True))):
            out = llm.generate(prompts[:3], params)
            assert all(o.finish_reason in ("stop", "length") for o in out), out
            if params.structured_output.choice:
                assert all(o.text == "0" and o.finish_reason == "stop" for o in out), out
