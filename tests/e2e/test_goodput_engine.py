"""The goodput policy in the engine, as shipped (the default policy, its cost table injected
through the config, never patched in afterwards): where the table says speculation loses, the
engine runs the plain decode path (no drafter call, width 1); where it wins, it drafts; output
is lossless. Also: auto + an explicit schedule runs the table at one width, and synthetic mode
drafts at its simulated acceptance."""

from __future__ import annotations

from dynaspec import LLM, SamplingParams
from dynaspec.spec_decode.drafters.base import Proposer
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy
from dynaspec.spec_decode.policy.k_policy import TablePolicy
from tests.e2e.conftest import llm_drafting_with, random_prompts

WIDTHS = tuple(range(1, 6))


def cost_table(per_width) -> dict:
    """A fixed table (``cost_table=``): per_width(w) seconds at every batch and context, and a
    free drafter, so decisions depend on acceptance and this table only, never on timing."""
    return {"batches": [1, 64], "contexts": [1, 4096], "widths": list(WIDTHS),
            "seconds": [[[per_width(w) for w in WIDTHS]] * 2] * 2, "draft_seconds_per_token": 0.0}


class CountingProposer(Proposer):
    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def propose(self, requests, k_per_request):
        self.calls += 1
        return self.inner.propose(requests, k_per_request)

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)


def _run(tiny_llama_dir, per_width, check_integrity):
    llm = llm_drafting_with(CountingProposer, tiny_llama_dir, dtype="float32", num_kv_blocks=256,
                            speculator="ngram", num_spec_tokens=4, prompt_lookup_min=1,
                            cost_table=cost_table(per_width))
    check_integrity(llm.engine)
    policy = llm.engine.scheduler.policy
    assert isinstance(policy, GoodputPolicy)  # the default with a drafter
    assert llm.engine.parts.policy_info.table_source.startswith("injected")
    counting = llm.engine.runner.proposer
    assert isinstance(counting, CountingProposer)
    prompts = random_prompts(6, 280, seed=5, lo=5, hi=30, repetitive=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    return llm, counting, outs, prompts


def test_losing_cost_model_runs_the_no_speculation_path(tiny_llama_dir, check_integrity):
    llm, counting, outs, prompts = _run(tiny_llama_dir, lambda w: 0.01 * w, check_integrity)
    c = llm.engine.counters
    # No drafter call and no draft verified: every step had width 1, the plain decode path.
    assert counting.calls == 0, "the drafter must not run when K is 0 everywhere"
    assert c.num_draft_tokens == 0 and set(c.steps_by_k) == {0}
    assert c.draft_skips.get("adaptive", 0) > 0
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_free_verify_drafts_and_stays_lossless(tiny_llama_dir, check_integrity):
    llm, counting, outs, prompts = _run(tiny_llama_dir, lambda w: 0.01, check_integrity)
    c = llm.engine.counters
    assert counting.calls > 0 and c.num_draft_tokens > 0
    assert max(c.steps_by_k) == 4
    policy = llm.engine.scheduler.policy
    modelled, observed = policy.goodput_report()
    assert modelled is not None and observed is not None and observed > 0
    # The scheduler reports each request's cap, so the drafter's own stops are learned
    # (suffix and n-gram drafts stop where their evidence ends), and forgotten with the request.
    assert policy.engine_lengths.num_updates > 0, policy.engine_lengths.rates
    assert policy.num_cached() == 0
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def _decode_widths(llm) -> set[str]:
    return {w for (_, w), n in llm.engine.recorder.execution_steps.items() if n and w != "mixed"}


def test_auto_with_a_constant_schedule_runs_its_width_on_every_decode_step(tiny_llama_dir):
    # The case: --num-spec-tokens 3 and [[1,8,5],[9,16,4]] clamp to constant(3).
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="ngram",
              num_spec_tokens=3, k_schedule="[[1,8,5],[9,16,4]]", prompt_lookup_min=1,
              cost_table=cost_table(lambda w: 0.01 * w))  # goodput would pick K=0 on this
    assert isinstance(llm.engine.scheduler.policy, TablePolicy)
    assert llm.engine.plan.kind == "constant" and llm.engine.plan.widths == (4,)
    prompts = random_prompts(3, 280, seed=7, lo=5, hi=20, repetitive=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert set(llm.engine.counters.steps_by_k) == {3}
    assert _decode_widths(llm) <= {"4"}, llm.engine.recorder.execution_steps


def test_goodput_with_a_schedule_is_bounded_by_it_and_may_run_k0(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="ngram",
              num_spec_tokens=3, k_schedule="[[1,8,5],[9,16,4]]", k_policy="goodput",
              prompt_lookup_min=1, cost_table=cost_table(lambda w: 0.01 * w))
    assert isinstance(llm.engine.scheduler.policy, GoodputPolicy)
    plan = llm.engine.plan
    assert plan.kind == "variable" and plan.widths == (1, 2, 3, 4)  # what can actually run
    assert llm.engine.exec_plan.widths == (1, 2, 3, 4)
    prompts = random_prompts(3, 280, seed=7, lo=5, hi=20, repetitive=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert set(llm.engine.counters.steps_by_k) == {0}  # a losing table: K=0 everywhere
    assert _decode_widths(llm) <= {"1"}


def test_synthetic_mode_drafts_on_most_steps_under_the_default_policy(tiny_llama_dir):
    # A draft costs 65% of a step: at the prior's 0.6 acceptance drafting loses (1.6 / 1.65),
    # at the simulated 0.7 it wins (1.7 / 1.65), so only a policy that prices the simulated
    # acceptance drafts from the first step on.
    llm = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=256,
        speculator="ngram",
        num_spec_tokens=1,
        prompt_lookup_min=1,
        rejection_mode="synthetic",
        synthetic_acceptance=0.7,
        cost_table=cost_table(lambda w: 0.01 * (1 + 0.65 * (w - 1))),
    )
    assert isinstance(llm.engine.scheduler.policy, GoodputPolicy)
    prompts = random_prompts(2, 280, seed=3, lo=5, hi=20, repetitive=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    by_k = llm.engine.counters.steps_by_k
    assert by_k.get(1, 0) > sum(by_k.values()) / 2, dict(by_k)


def test_measured_start_names_the_policy_table_source_and_cache_file(tiny_llama_dir, caplog,
                                                                    tmp_path, monkeypatch):
    """The measured path end to end. Whether this machine's timings pass the checks is not
    this test's business (it must not depend on them): either way the log, the engine's
    policy and its record agree, and a refused table is never saved."""
    import logging

    from dynaspec.spec_decode.policy import cost_cache
    from dynaspec.spec_decode.policy.cost_model import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # an empty cache: this start measures
    with caplog.at_level(logging.INFO, logger="dynaspec"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="ngram",
                  num_spec_tokens=2, max_num_seqs=4)
    info = llm.engine.parts.policy_info
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("K policy:"))
    assert f"K policy: {info.name}" in line and "plan as run:" in line
    if info.table_source == "refused":
        assert isinstance(llm.engine.scheduler.policy, TablePolicy) and info.cache_file is None
    else:
        assert isinstance(llm.engine.scheduler.policy, GoodputPolicy)
        assert info.cache_file and info.cache_file in line
        assert cost_cache.load_cells(info.cache_file.rsplit("/", 1)[1][:-5])  # cells saved
        assert llm.engine.plan.widths == (1, 2, 3)
    assert any("step cost profile:" in r.getMessage() for r in caplog.records)  # progress
