"""The goodput policy in the engine: where the cost model says speculation loses, the engine runs
the plain decode path (no drafter call, width 1); where it wins, it drafts; output is lossless."""

from __future__ import annotations

from dynaspec import LLM, SamplingParams
from dynaspec.spec_decode.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.goodput_policy import GoodputPolicy
from tests.e2e.conftest import random_prompts

WIDTHS = tuple(range(1, 6))


def _cost(per_width) -> StepCostModel:
    grid = CostGrid((1, 64), (1, 4096), WIDTHS)
    return StepCostModel(grid, [[[per_width(w) for w in WIDTHS]] * 2] * 2, alpha=1e-9)


class CountingProposer:
    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def propose(self, requests, k_per_request):
        self.calls += 1
        return self.inner.propose(requests, k_per_request)

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)


def _run(tiny_llama_dir, per_width, check_integrity):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256, speculator="ngram",
              num_spec_tokens=4, prompt_lookup_min=1)
    check_integrity(llm.engine)
    policy = llm.engine.scheduler.policy
    assert isinstance(policy, GoodputPolicy)  # the default with a drafter
    policy.cost_model = _cost(per_width)  # alpha ~0: observed steps cannot move it in this test
    counting = CountingProposer(llm.engine.runner.proposer)
    llm.engine.runner.proposer = counting
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
    modelled, observed = llm.engine.scheduler.policy.goodput_report()
    assert modelled is not None and observed is not None and observed > 0
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=256)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
