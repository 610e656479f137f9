"""Batched sampler: greedy, temperature/top-k/top-p/min-p support, seeding, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.sampler import Sampler, inverse_cdf_sample, processed_probs
from dynaspec.sampling_params import SamplingParams as SP


def make_md(params: list[SP], seeds: list[int] | None = None) -> SamplingMetadata:
    seeds = seeds if seeds is not None else [1000 + i for i in range(len(params))]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return SamplingMetadata.from_params(params, gens, "cpu")


def probs_of(logits: torch.Tensor, p: SP) -> torch.Tensor:  # [vocab] for one request
    md = make_md([p])
    return processed_probs(logits.unsqueeze(0), md, torch.zeros(1, dtype=torch.int64))[0]


# probabilities 0.5, 0.3, 0.15, 0.05 at ids 2, 0, 3, 1 (ids shuffled so order != id order)
HAND = torch.log(torch.tensor([0.3, 0.05, 0.5, 0.15]))


def support(probs: torch.Tensor) -> set[int]:
    return set((probs > 0).nonzero().squeeze(1).tolist())


def test_from_params_normalizes_top_k_and_checks_lengths() -> None:
    md = make_md([SP(top_k=-1), SP(top_k=0), SP(top_k=7, temperature=0.0)])
    assert md.top_k.tolist() == [0, 0, 7]
    assert md.top_k.dtype == torch.int64 and md.temperature.dtype == torch.float32
    assert not md.all_greedy
    assert make_md([SP(temperature=0.0)] * 2).all_greedy
    with pytest.raises(ValueError, match="one generator per request"):
        SamplingMetadata.from_params([SP()], [], "cpu")


def test_all_greedy_is_argmax_and_draws_nothing() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    md = make_md([SP(temperature=0.0, top_k=3, top_p=0.5)] * 16)
    states = [g.get_state().clone() for g in md.generators]
    out = Sampler()(logits, md)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs == [None] * 16
    assert all(torch.equal(s, g.get_state()) for s, g in zip(states, md.generators))


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SP(temperature=0.0), SP(temperature=1.5)] * 3
    md = make_md(params)
    greedy_state = md.generators[0].get_state().clone()
    out = Sampler()(logits, md)
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))
    # Greedy rows never consume their generator.
    assert torch.equal(greedy_state, md.generators[0].get_state())


def test_temperature_scales_logits() -> None:
    logits = torch.randn(30, generator=torch.Generator().manual_seed(6))
    for t in (0.3, 1.0, 2.5):
        assert torch.allclose(probs_of(logits, SP(temperature=t)), torch.softmax(logits / t, -1))


def test_top_k_restricts_support() -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2))
    top5 = set(logits.topk(5).indices.tolist())
    probs = probs_of(logits, SP(top_k=5))
    assert support(probs) == top5
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    # Kept tokens keep their relative odds.
    kept = logits.topk(5).indices
    assert torch.allclose(probs[kept], torch.softmax(logits[kept], -1))
    assert len(support(probs_of(logits, SP(top_k=100)))) == 40  # k > vocab = off
    assert len(support(probs_of(logits, SP(top_k=-1)))) == 40
    # Sampled tokens stay inside the support.
    md = make_md([SP(top_k=5)] * 200)
    assert set(Sampler()(logits.expand(200, -1), md).token_ids.tolist()) <= top5


@pytest.mark.parametrize(
    ("top_p", "expected"), [(0.4, {2}), (0.75, {2, 0}), (0.85, {2, 0, 3}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_restricts_support(top_p: float, expected: set[int]) -> None:
    probs = probs_of(HAND, SP(top_p=top_p))
    assert support(probs) == expected
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, {0, 1, 2, 3}), (0.2, {0, 2, 3}), (0.7, {2})])
def test_min_p_restricts_support(min_p: float, expected: set[int]) -> None:
    assert support(probs_of(HAND, SP(min_p=min_p))) == expected


def test_filters_apply_after_temperature_and_combine() -> None:
    # At temperature 2 the distribution flattens, so top_p=0.75 needs more tokens.
    flat = torch.softmax(HAND / 2, -1)
    order = flat.argsort(descending=True)
    need = int((torch.cumsum(flat[order], 0) < 0.75).sum()) + 1
    probs = probs_of(HAND, SP(temperature=2.0, top_p=0.75))
    assert support(probs) == set(order[:need].tolist())
    # top_k=3 then top_p on the renormalized three: 0.5/0.95 < 0.75 <= 0.8/0.95.
    assert support(probs_of(HAND, SP(top_k=3, top_p=0.75))) == {2, 0}
    assert support(probs_of(HAND, SP(top_k=3, min_p=0.7))) == {2}


def test_rows_use_their_own_request_params() -> None:
    md = make_md([SP(top_k=1), SP(top_p=1.0), SP(min_p=0.2)])
    rows = HAND.expand(5, -1)
    probs = processed_probs(rows, md, torch.tensor([1, 0, 2, 0, 1]))
    assert [len(support(r)) for r in probs] == [4, 1, 3, 1, 4]


def test_sampled_distribution_matches_processed_probs() -> None:
    n = 12000
    logits = torch.log(torch.tensor([0.3, 0.05, 0.25, 0.15, 0.1, 0.15]))
    for p in (SP(temperature=1.0), SP(temperature=0.7, top_k=4), SP(temperature=1.3, top_p=0.8)):
        target = probs_of(logits, p).numpy().astype(np.float64)
        # One shared generator: one draw stream for the whole batch, still a valid sample.
        g = torch.Generator().manual_seed(7)
        md = SamplingMetadata.from_params([p] * n, [g] * n, "cpu")
        toks = Sampler()(logits.expand(n, -1), md).token_ids.numpy()
        counts = np.bincount(toks, minlength=6)
        assert (counts[target == 0] == 0).all()
        live = target > 0
        assert chisquare(counts[live], target[live] / target[live].sum() * n).pvalue > 0.01


def test_seeded_request_reproduces_whatever_the_batch() -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(5, vocab, generator=gen) for _ in range(4)]
    p = SP(temperature=1.0, top_p=0.9, seed=42)

    alone_g = torch.Generator().manual_seed(42)
    alone = [
        int(Sampler()(s[2:3], SamplingMetadata.from_params([p], [alone_g], "cpu")).token_ids[0])
        for s in steps
    ]
    batch_g = torch.Generator().manual_seed(42)
    others = [torch.Generator().manual_seed(9) for _ in range(4)]
    params = [SP(temperature=0.8), SP(temperature=0.0), p, SP(top_k=3), SP(temperature=2.0)]
    in_batch = []
    for s in steps:
        md = SamplingMetadata.from_params(params, others[:2] + [batch_g] + others[2:], "cpu")
        in_batch.append(int(Sampler()(s, md).token_ids[2]))
    assert alone == in_batch
    assert len(set(alone)) > 1  # the generator advances between steps


def test_inverse_cdf_never_draws_a_zero_weight_token() -> None:
    weights = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0, 0.0]] * 3)  # [3, 7]
    # 0, the largest double below 1, and 1 itself (as if u * total rounded up to total).
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 1.0], dtype=torch.float64)
    assert inverse_cdf_sample(weights, u).tolist() == [1, 4, 4]
    # The boundary between two tokens goes to the later one: cdf[1] = 0.2 is not "> 0.2".
    edge = torch.tensor([[0.25, 0.0, 0.25, 0.5]])
    assert inverse_cdf_sample(edge, torch.tensor([0.25], dtype=torch.float64)).tolist() == [2]


def test_inverse_cdf_row_is_independent_of_its_batch() -> None:
    gen = torch.Generator().manual_seed(11)
    weights = torch.rand(9, 5000, generator=gen) ** 8  # [9, 5000], uneven mass
    u = torch.rand(9, generator=gen, dtype=torch.float64)  # [9]
    batched = inverse_cdf_sample(weights, u)
    alone = [int(inverse_cdf_sample(weights[i : i + 1], u[i : i + 1])) for i in range(9)]
    assert batched.tolist() == alone
    assert len(set(alone)) > 1


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    params = [SP(temperature=0.0, logprobs=3), SP(logprobs=None), SP(temperature=0.5, logprobs=0),
              SP(temperature=2.0, top_k=2, logprobs=5)]
    out = Sampler()(logits, make_md(params))
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i, n in [(0, 3), (2, 0), (3, 5)]:
        entry = out.logprobs[i]
        assert entry is not None
        chosen, top = entry
        assert math.isclose(chosen, float(lp[i, out.token_ids[i]]), abs_tol=1e-5)
        assert len(top) == n
        ref_vals, ref_ids = lp[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in top] == ref_ids.tolist()
        assert np.allclose([v for _, v in top], ref_vals.tolist(), atol=1e-5)
    assert out.logprobs[0] is not None and out.logprobs[0][1][0][0] == int(out.token_ids[0])


def test_top_p_below_float32_range_keeps_the_top_token():
    """top_p = 1e-117 rounds to 0 in float32; the top token must still survive (it used to be
    dropped with every other one, so a grammar request sampled token 0 from NaNs)."""
    from dynaspec.sample.metadata import SamplingMetadata
    from dynaspec.sample.sampler import processed_probs
    from dynaspec.sampling_params import SamplingParams

    logits = torch.tensor([[0.5, 3.0, -1.0, float("-inf")]])
    md = SamplingMetadata.from_params([SamplingParams(top_p=7.8e-117)], [torch.Generator()], "cpu")
    probs = processed_probs(logits, md, torch.tensor([0]))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_tiny_temperature_is_greedy_and_never_nan():
    """logits / 1e-40 overflowed to inf and the softmax to NaN (reliability fuzz)."""
    from dynaspec.sample.metadata import SamplingMetadata
    from dynaspec.sample.sampler import processed_probs
    from dynaspec.sampling_params import SamplingParams

    assert SamplingParams(temperature=1e-40).greedy
    logits = torch.tensor([[0.5, 3.0, float("-inf")]])
    md = SamplingMetadata.from_params(
        [SamplingParams(temperature=1e-4)], [torch.Generator()], "cpu"
    )
    md.temperature[0] = 1e-40  # the transform itself must stay finite too
    probs = processed_probs(logits, md, torch.tensor([0]))
    assert torch.isfinite(probs).all() and probs[0, 2] == 0.0  # the masked token stays out
