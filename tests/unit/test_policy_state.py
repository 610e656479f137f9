"""The goodput policy's engine-wide state as one value (spec_decode/policy/policy_state.py):
what ``decide(view, state)`` prices from beyond its view, exported and loaded whole."""

from __future__ import annotations

import pickle
import random

from dynaspec.spec_decode.plan.plan import build_spec_plan
from dynaspec.spec_decode.policy.goodput_policy import GoodputPolicy
from dynaspec.spec_decode.policy.k_policy import GlobalStepView, RequestView, StepView
from tests.unit.test_dp_agreement import _cost

PLAN = build_spec_plan("ngram", 3, None)


def _lived(seed: int, steps: int = 80) -> GoodputPolicy:
    """A policy after its own random history of steps: costs, draft cost, acceptance, guard."""
    rng, p = random.Random(seed), GoodputPolicy(PLAN, _cost())
    for i in range(steps):
        k = rng.randrange(0, 4)
        p.observe(f"r{i % 5}", k, rng.randrange(0, k + 1), 100 + i)
        p.observe_step(rng.randrange(1, 17), rng.randrange(16, 600), 1 + k,
                       rng.uniform(0.001, 0.05), 0.0004 * k, k, 1 + k,
                       modelled_goodput=rng.uniform(50, 500))
    return p


def test_state_round_trips_and_survives_pickling():
    a, b = _lived(1), _lived(2)
    assert a.state() != b.state()
    b.load(pickle.loads(pickle.dumps(a.state())))
    assert b.state() == a.state()


def test_the_lockstep_decision_is_a_function_of_the_view_and_the_state():
    """Two policies with different lives decide alike on one agreed view once given one state
    (their per-request histories differ: a DP decision never reads them), and differently
    given their own states."""
    a, b = _lived(3), _lived(4)
    reqs = tuple(RequestView(f"q{i}", 100 + 50 * i, 40, 1000) for i in range(3))
    views = [StepView(reqs, n, GlobalStepView(n, 3, sum(r.context_len for r in reqs), 200, n))
             for n in (3, 6, 12)]
    state = a.state()
    for v in views:
        assert a.decide(v, state).goodput_by_k == b.decide(v, state).goodput_by_k
    assert b.state() == state  # deciding from it loaded it, and changed nothing else
    c, d = _lived(3), _lived(4)
    assert any(c.decide(v, c.state()).goodput_by_k != d.decide(v, d.state()).goodput_by_k
               for v in views), "the two lives priced alike: the test shows nothing"
