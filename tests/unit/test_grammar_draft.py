"""Grammar drafts (docs/design.md §4d): the tokens a request's grammar forces are drafts before
its drafter's; constrained greedy output is the same with them, without them and without
speculation; forced drafts are priced and counted under their own source."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from dynaspec import LLM, SamplingParams  # noqa: E402
from dynaspec.metrics.records import RequestStepSpec, StepStats  # noqa: E402
from dynaspec.metrics.stats import SpecCounters, fold_step  # noqa: E402
from dynaspec.request import Request  # noqa: E402
from dynaspec.spec_decode.drafters.grammar_draft import forced_tokens  # noqa: E402
from dynaspec.spec_decode.drafters.ngram import NgramProposer  # noqa: E402
from dynaspec.spec_decode.plan.plan import build_spec_plan  # noqa: E402
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel  # noqa: E402
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy, GoodputSettings  # noqa: E402
from dynaspec.spec_decode.policy.k_policy import RequestView, StepView  # noqa: E402
from dynaspec.step_plan import BatchDescriptor, ScheduledRequest, StepPlan  # noqa: E402
from dynaspec.structured import StructuredOutputParams  # noqa: E402
from dynaspec.structured.backend import allocate_bitmask, single_allowed  # noqa: E402
from dynaspec.worker.draft_rows import propose  # noqa: E402
from tests.cost_tables import FREE_VERIFY  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["falcon", "dolphin"]},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 2},
        "pos": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "pos"],
    "additionalProperties": False,
}
SPEC = StructuredOutputParams(json=SCHEMA)
_WIDTHS = tuple(range(1, 10))
# A verified token costs 0.3 of a step: drafting pays from ~0.3 acceptance a position.
_COST = StepCostModel(CostGrid((1, 64), (1, 4096), _WIDTHS),
                      [[[0.01 * (1 + 0.3 * (w - 1)) for w in _WIDTHS]] * 2] * 2)
_TEXTS = [
    'Example: {"name": "fox", "kind": "falcon", "tags": ["alpha"], "pos": {"x": true}} Now:',
    "The quick brown fox jumps over the lazy dog. " * 2,
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


def _matcher(llm, spec=SPEC):
    so = llm.engine.structured
    return so.backend().matcher(so.compile(spec)), so.backend().vocab_size


def _allowed(m, vocab: int) -> list[int]:
    mask = allocate_bitmask(1, vocab)
    m.fill_bitmask(mask, 0)
    return mask[0].tolist()


def test_forced_drafts_spell_the_fixed_keys_and_leave_the_matcher_as_found(llm, tok):
    m, vocab = _matcher(llm)
    before = _allowed(m, vocab)
    forced = forced_tokens(m, 32, vocab)
    assert tok.decode(forced) == '{"name": "'  # the object's first key is forced to its value
    assert _allowed(m, vocab) == before  # rolled back: the step's check finds the same state
    assert forced_tokens(m, 3, vocab) == forced[:3]  # never more than k
    for t in tok.encode('{"name": "ab", "kind": "f', add_special_tokens=False):
        assert m.accept(t)
    # an enum value is forced once its first letter is chosen, and so is the next key
    assert tok.decode(forced_tokens(m, 32, vocab)) == 'alcon", "tags": ['


def test_nothing_is_forced_where_the_grammar_allows_several_tokens(llm, tok):
    m, vocab = _matcher(llm, StructuredOutputParams(regex="[ab]c"))
    assert forced_tokens(m, 8, vocab) == []  # a or b: the model chooses
    assert m.accept(tok.encode("a", add_special_tokens=False)[0])
    forced = forced_tokens(m, 8, vocab)
    # then "c", then the grammar is complete and only its stop token is allowed
    assert tok.decode(forced[:1]) == "c" and len(forced) == 2
    m.accept(forced[0])
    assert single_allowed(allocate_bitmask(1, vocab).fill_(0), 0) is None  # nothing allowed
    mask = allocate_bitmask(1, vocab)
    m.fill_bitmask(mask, 0)
    assert single_allowed(mask, 0) == forced[1]


def test_single_allowed_reads_the_sign_bit():
    mask = allocate_bitmask(2, 100).fill_(0)
    mask[0, 1] = -2**31  # token 63 alone: bit 31 of word 1
    mask[1, 0], mask[1, 2] = 1, 1  # tokens 0 and 64
    assert single_allowed(mask, 0) == 63 and single_allowed(mask, 1) is None


def _generate(model: str, prompts, **engine_kw):
    llm = LLM(model=model, dtype="float32", num_kv_blocks=512, cost_table=FREE_VERIFY,
              **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_output=SPEC)
    return llm, llm.generate(prompts, params)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t)[:100] for t in _TEXTS]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, prompts):
    _, outs = _generate(tiny_llama_dir, prompts)
    for o in outs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_constrained_greedy_is_the_same_with_and_without_grammar_drafts(tiny_llama_dir, prompts,
                                                                        plain, speculator):
    kw = {"speculator": speculator, "num_spec_tokens": 6, "prompt_lookup_min": 1}
    on, outs_on = _generate(tiny_llama_dir, prompts, **kw)
    off, outs_off = _generate(tiny_llama_dir, prompts, grammar_drafts=False, **kw)
    assert [o.token_ids for o in outs_on] == plain
    assert [o.token_ids for o in outs_off] == plain
    c_on, c_off = on.engine.counters, off.engine.counters
    forced = c_on.draft_tokens_by_source.get("grammar", 0)
    assert forced > 0 and "grammar" not in c_off.draft_tokens_by_source
    # the masked target follows what its grammar forces, except where the library spells a
    # forced text otherwise than the model would
    assert c_on.accepted_tokens_by_source["grammar"] >= 0.5 * forced
    assert not c_on.check_identities() and not c_off.check_identities()
    # fewer steps: forced spans are verified several tokens a step
    assert c_on.num_steps < c_off.num_steps
    for llm in (on, off):
        llm.engine.check_integrity()


def test_forced_drafts_teach_their_own_acceptance(tiny_llama_dir, prompts, plain):
    llm, _ = _generate(tiny_llama_dir, prompts[:1], speculator="ngram", num_spec_tokens=6,
                       prompt_lookup_min=1)
    policy = llm.engine.scheduler.policy
    assert policy.grammar is not None and policy.grammar.engine_history.num_updates > 0
    # the forced drafts' observations went to their own history, not the drafter's
    c = llm.engine.counters
    drafter_drafts = c.draft_tokens_by_source.get("drafter", 0)
    assert policy.engine_history.num_updates <= max(drafter_drafts, 0)
    assert policy.num_cached() == 0  # every request forgotten, its grammar history too


def test_the_fold_counts_drafts_by_source():
    reqs = (RequestStepSpec("a", 5, 3, 4, None, num_forced_tokens=4),  # a forced draft rejected
            RequestStepSpec("b", 6, 5, 6, None, num_forced_tokens=2),  # 2 forced, 3 of the rest
            RequestStepSpec("c", 2, 2, 3, None))
    c = fold_step(SpecCounters(), StepStats(k=6, requests=reqs))
    assert dict(c.draft_tokens_by_source) == {"grammar": 6, "drafter": 7}
    assert dict(c.accepted_tokens_by_source) == {"grammar": 5, "drafter": 5}
    assert not c.check_identities()
    with pytest.raises(ValueError, match="forced drafts"):
        RequestStepSpec("d", 2, 0, 1, None, num_forced_tokens=3)


class _Forced:
    """A grammar drafter that forces the given tokens per request id (at most k)."""

    def __init__(self, forced: dict[str, list[int]]) -> None:
        self.forced_by = forced

    def forced(self, request, k: int) -> list[int]:
        return self.forced_by.get(request.request_id, [])[:k]


def _row(rid: str, prompt: list[int], budget: int, grammar: int | None = None,
         drafter: int | None = None) -> ScheduledRequest:
    req = Request(rid, prompt, SamplingParams(max_tokens=32))
    return ScheduledRequest(request=req, num_new_tokens=1, draft_budget=budget, skip_reason=None,
                            block_table=[0], sampling=True, num_lookahead=budget,
                            grammar_budget=grammar, drafter_budget=drafter)


def test_the_drafter_continues_after_a_forced_prefix_or_drafts_alone():
    # n-gram: the context ends "... 7 8", the prefix [9] makes "8 9", seen before as "8 9 4 5"
    ctx = [1, 8, 9, 4, 5, 6, 2, 7, 8]
    rows = (_row("prefix", ctx, 4), _row("all", ctx, 2), _row("alone", ctx, 3),
            _row("capped", ctx, 4, grammar=4, drafter=1), _row("grammar_only", ctx, 4, 4, 0),
            _row("cut", ctx, 4, grammar=4, drafter=0))
    plan = StepPlan(scheduled=rows, step_k=4, num_batched_tokens=len(rows),
                    batch=BatchDescriptor("eager", len(rows), 5, 5 * len(rows)))
    forced = _Forced({"prefix": [9], "all": [9, 4, 5], "capped": [9], "grammar_only": [9, 4]})
    got = propose(NgramProposer(1, 3), plan, None, forced)  # type: ignore[arg-type]
    assert got.tokens == {
        "prefix": [9, 4, 5, 6],  # forced 9, then the n-gram's continuation after "8 9"
        "all": [9, 4],  # the forced span fills the budget: no drafter call
        "alone": [9, 4, 5],  # nothing forced: the n-gram drafts from "7 8" as it would alone
        "capped": [9, 4],  # the drafter's own cap (1) after the forced prefix
        "grammar_only": [9, 4],
    }
    assert got.forced == {"prefix": 1, "all": 2, "capped": 1, "grammar_only": 2}
    assert got.skips == {"cut": "adaptive"}  # only the grammar's cap, and it forced nothing


def test_the_policy_prices_forced_drafts_apart():
    p = GoodputPolicy(build_spec_plan("ngram", 6, None), _COST,
                      GoodputSettings(prices_grammar=True))
    for _ in range(5):
        for rid in ("s", "plain"):
            p.observe(rid, 4, 0, 100, 4)  # the drafter's drafts: all rejected
        p.observe("s", 4, 4, 100, 0, grammar=True)  # the grammar's: all accepted
    assert p.histories["s"].num_updates == 5  # forced drafts never reached the drafter's
    s = RequestView("s", 100, 1000, 10**6, structured=True)
    d = p.decide(StepView((s, RequestView("plain", 100, 1000, 10**6)), 2))
    g, own = d.grammar["s"]
    assert own == 0 and d.per_request["plain"] == 0  # the drafter does not pay
    assert g >= 4 and d.per_request["s"] == g and d.k >= g  # forced drafts still do
    assert "plain" not in d.grammar
    for rid in ("s", "plain"):
        p.forget(rid)
    assert p.num_cached() == 0
