"""--rejection-mode synthetic: measured per-position conditional acceptance matches the requested
rates within binomial error, draws are seeded (deterministic), pads never pass, and each request
emits its accepted drafts plus the target's own token at the first rejected position."""

from __future__ import annotations

import math

import pytest
import torch

from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.synthetic import SyntheticVerifier, make_synthetic_verifier
from dynaspec.sampling_params import SamplingParams

VOCAB = 32


def _md(n: int, temperature: float = 0.0) -> SamplingMetadata:
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(n)]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return SamplingMetadata.from_params(params, gens, "cpu")


def _run(verifier: SyntheticVerifier, steps: int, k: int, num_reqs: int):
    """Per position j: (drafted, accepted) counted the way the metrics count them."""
    drafted, accepted = [0] * k, [0] * k
    outs = []
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        drafts = [torch.randint(0, VOCAB, (k,), generator=g).tolist() for _ in range(num_reqs)]
        logits = torch.randn(num_reqs * (k + 1), VOCAB, generator=g)
        res = verifier(
            logits, [k] * num_reqs, drafts, _md(num_reqs), [f"r{i}" for i in range(num_reqs)]
        )
        outs.append(res)
        for toks in res:
            a = len(toks) - 1
            for j in range(min(a + 1, k)):  # position j is drafted given 0..j-1 accepted
                drafted[j] += 1
                accepted[j] += j < a
    return drafted, accepted, outs


@pytest.mark.parametrize("rates", [(0.9,), (0.8, 0.6, 0.4), (0.5,)])
def test_per_position_rates_within_binomial_error(rates):
    k, verifier = 4, SyntheticVerifier(rates, seed=7)
    drafted, accepted, _ = _run(verifier, steps=700, k=k, num_reqs=8)  # 5,600 request-steps
    assert sum(drafted) >= 5000
    for j in range(k):
        want = rates[min(j, len(rates) - 1)]
        got = accepted[j] / drafted[j]
        sigma = math.sqrt(want * (1 - want) / drafted[j])
        assert abs(got - want) <= 4 * sigma, f"position {j}: {got:.4f} vs {want} (n={drafted[j]})"


def test_seeded_and_independent_of_batch_neighbours():
    a = _run(SyntheticVerifier((0.7,), seed=3), steps=50, k=3, num_reqs=4)[2]
    b = _run(SyntheticVerifier((0.7,), seed=3), steps=50, k=3, num_reqs=4)[2]
    assert a == b
    c = _run(SyntheticVerifier((0.7,), seed=4), steps=50, k=3, num_reqs=4)[2]
    assert a != c
    # Request r0's accept counts depend only on its own draws, not on who shares the batch.
    solo = SyntheticVerifier((0.7,), seed=3)
    pair = SyntheticVerifier((0.7,), seed=3)
    for _ in range(30):
        assert solo.num_accepted("r0", [1, 2, 3], VOCAB) == pair.num_accepted(
            "r0", [1, 2, 3], VOCAB
        )
        pair.num_accepted("r1", [1, 2, 3], VOCAB)


def test_emits_accepted_drafts_then_the_targets_token():
    v = SyntheticVerifier((1.0, 1.0, 0.0), seed=0)
    logits = torch.randn(2 * 5, VOCAB, generator=torch.Generator().manual_seed(0))
    drafts = [[3, 4, 5, 6], [7, -1, 8, 9]]  # request 1 has a pad at position 1
    out = v(logits, [4, 4], drafts, _md(2), ["a", "b"])
    assert out[0] == [3, 4, int(logits[2].argmax())], "rate 0 at position 2 rejects there"
    assert out[1] == [7, int(logits[5 + 1].argmax())], "a -1 pad is never accepted"
    all_in = SyntheticVerifier((1.0,), seed=0)(
        logits, [4, 4], [[1, 2, 3, 4], [5, 6, 7, 8]], _md(2), ["a", "b"]
    )
    assert all_in == [[1, 2, 3, 4, int(logits[4].argmax())], [5, 6, 7, 8, int(logits[9].argmax())]]
    random_out = SyntheticVerifier((0.0,), seed=0)(logits, [4, 4], drafts, _md(2, 1.0), ["a", "b"])
    assert [len(t) for t in random_out] == [1, 1] and all(0 <= t[0] < VOCAB for t in random_out)


def test_strict_is_no_verifier_and_bad_rates_are_errors():
    assert make_synthetic_verifier("strict", (), 0) is None
    with pytest.raises(ValueError, match="unknown rejection mode"):
        make_synthetic_verifier("fast", (0.5,), 0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SyntheticVerifier((1.2,), 0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SyntheticVerifier((), 0)


def test_drafts_are_cut_before_a_stop_token():
    v = SyntheticVerifier((1.0,), seed=0, stop_token_ids=(2, 0))
    assert v.cut([5, 6, 2, 7]) == [5, 6] and v.cut([0, 1]) == [] and v.cut([3, 4]) == [3, 4]
    assert SyntheticVerifier((1.0,), seed=0).cut([5, 2]) == [5, 2]
