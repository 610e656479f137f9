"""Rejection sampler: batched == reference, greedy exactness, lossless distribution, edges."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.rejection_sampler import rejection_sample, rejection_sample_reference
from dynaspec.sample.sampler import Sampler, processed_probs
from dynaspec.sampling_params import SamplingParams as SP

NEG_INF = float("-inf")


def make_md(params: list[SP], seeds: list[int] | None = None) -> SamplingMetadata:
    seeds = seeds if seeds is not None else [500 + i for i in range(len(params))]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return SamplingMetadata.from_params(params, gens, "cpu")


PARAM_CHOICES = [
    SP(temperature=0.0),
    SP(temperature=1.0),
    SP(temperature=0.7, top_k=3),
    SP(temperature=1.3, top_p=0.8),
    SP(temperature=1.0, min_p=0.1),
    SP(temperature=0.0, top_k=2),
]


def random_case(seed: int, num_reqs: int, vocab: int, probs_mode: str):
    """Peaked logits and drafts sampled from the target, so acceptance lengths vary."""
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, 5, (num_reqs,), generator=g).tolist()
    num_draft[0] = 0  # always include a request without drafts
    logits = torch.randn(sum(num_draft) + num_reqs, vocab, generator=g) * 2.5
    drafts, dprobs, start = [], [], 0
    for n in num_draft:
        q = torch.softmax(logits[start : start + n] + torch.randn(n, vocab, generator=g), -1)
        drafts.append(torch.multinomial(q, 1, generator=g).squeeze(1).tolist() if n else [])
        use_q = probs_mode == "all" or (probs_mode == "mixed" and len(dprobs) % 2 == 0)
        dprobs.append(q if use_q else None)
        start += n + 1
    pidx = torch.randint(0, len(PARAM_CHOICES), (num_reqs,), generator=g).tolist()
    params = [PARAM_CHOICES[i] for i in pidx]
    return logits, num_draft, drafts, (None if probs_mode == "none" else dprobs), params


@pytest.mark.parametrize("probs_mode", ["none", "all", "mixed"])
def test_batched_equals_reference(probs_mode: str) -> None:
    lengths_seen: set[tuple[int, int]] = set()
    for seed in range(40):
        logits, nd, drafts, dprobs, params = random_case(seed, 8, 12, probs_mode)
        fast = rejection_sample(logits, nd, drafts, dprobs, make_md(params))
        ref = rejection_sample_reference(logits, nd, drafts, dprobs, make_md(params))
        assert fast == ref, f"seed {seed}"
        for out, n, ids in zip(fast, nd, drafts):
            assert 1 <= len(out) <= n + 1 and out[:-1] == ids[: len(out) - 1]
            lengths_seen.add((n, len(out) - 1))
    # The cases exercised full, partial and zero acceptance.
    assert any(n == a > 0 for n, a in lengths_seen)
    assert any(0 < a < n for n, a in lengths_seen)
    assert any(a == 0 < n for n, a in lengths_seen)


@pytest.mark.parametrize("probs_mode", ["none", "all"])
def test_all_greedy_batches_equal_the_reference(probs_mode: str) -> None:
    """The all-greedy shortcut (one argmax, the rule in Python) against the per-request oracle,
    with out-of-vocabulary ids among the drafts and draft probabilities it must ignore."""
    full = 0
    for seed in range(40):
        logits, nd, drafts, dprobs, _ = random_case(seed, 8, 12, probs_mode)
        drafts = [[-1 if (seed + j) % 7 == 0 else 12 + j if (seed + j) % 11 == 0 else t
                   for j, t in enumerate(ids)] for ids in drafts]
        params = [SP(temperature=0.0)] * 8
        fast = rejection_sample(logits, nd, drafts, dprobs, make_md(params))
        assert fast == rejection_sample_reference(logits, nd, drafts, dprobs, make_md(params))
        full += sum(len(o) == n + 1 for o, n in zip(fast, nd) if n)
    assert full > 0  # some requests accepted every draft: the bonus row is read too


def test_greedy_accepts_while_argmax_then_corrects() -> None:
    logits = torch.full((7, 5), -1.0)
    for row, best in enumerate([3, 0, 4, 1, 2, 0, 2]):
        logits[row, best] = 5.0
    md = make_md([SP(temperature=0.0, top_k=1), SP(temperature=0.0)])
    # request 0 rows 0..3 (3 drafts), request 1 rows 4..6 (2 drafts)
    out = rejection_sample(logits, [3, 2], [[3, 0, 4], [2, 1]], None, md)
    assert out == [[3, 0, 4, 1], [2, 0]]
    out = rejection_sample(logits, [3, 2], [[3, 2, 4], [0, 0]], None, md)
    assert out == [[3, 0], [2]]


def test_greedy_uses_raw_argmax_not_processed() -> None:
    # min_p/top-p cannot change the argmax, but the tie-free raw argmax is the contract.
    logits = torch.tensor([[1.0, 3.0, 2.9], [0.0, 0.0, 9.0]])
    md = make_md([SP(temperature=0.0, top_p=0.1, min_p=0.9)])
    assert rejection_sample(logits, [1], [[1]], None, md) == [[1, 2]]


def test_greedy_speculation_is_token_exact_with_plain_greedy() -> None:
    vocab, steps = 16, 40
    table = torch.randn(vocab, vocab, vocab, generator=torch.Generator().manual_seed(11))

    def logits_after(seq: list[int]) -> torch.Tensor:  # a toy model: last two tokens -> logits
        return table[seq[-2], seq[-1]]

    plain = [1, 2]
    while len(plain) < steps:
        plain.append(int(logits_after(plain).argmax()))
    g = torch.Generator().manual_seed(12)
    spec = [1, 2]
    md = make_md([SP(temperature=0.0)])
    while len(spec) < steps:
        k = int(torch.randint(0, 4, (1,), generator=g))
        # A drafter that is right about half the time.
        drafts = [plain[len(spec) + j] if j + len(spec) < steps and torch.rand(1, generator=g) < 0.6
                  else int(torch.randint(0, vocab, (1,), generator=g)) for j in range(k)]
        rows = [logits_after(spec + drafts[:j]) for j in range(k + 1)]
        spec += rejection_sample(torch.stack(rows), [k], [drafts], None, md)[0]
    assert spec[:steps] == plain


def chi_ok(tokens: np.ndarray, target: np.ndarray) -> bool:
    """Chi-square goodness of fit; zero-probability tokens must never appear."""
    counts = np.bincount(tokens, minlength=len(target))
    if counts[target == 0].any():
        return False
    live = target > 0
    return chisquare(counts[live], target[live] / target[live].sum() * counts.sum()).pvalue > 0.01


P_ROWS = torch.tensor([
    [0.30, 0.05, 0.25, 0.15, 0.10, 0.15],
    [0.10, 0.40, 0.05, 0.20, 0.15, 0.10],
    [0.20, 0.20, 0.10, 0.10, 0.30, 0.10],
])  # target for draft 0, draft 1, bonus
Q_ROWS = torch.tensor([
    [0.05, 0.35, 0.20, 0.10, 0.25, 0.05],
    [0.30, 0.10, 0.30, 0.05, 0.05, 0.20],
])


def run_trials(params: SP, with_q: bool, trials: int = 12000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    drafts = torch.multinomial(Q_ROWS, trials, replacement=True, generator=gen).T.tolist()
    logits = torch.log(P_ROWS).repeat(trials, 1)  # [trials * 3, 6]
    shared = torch.Generator().manual_seed(22)  # one stream for all trials
    md = SamplingMetadata.from_params([params] * trials, [shared] * trials, "cpu")
    dprobs = [Q_ROWS] * trials if with_q else None
    return rejection_sample(logits, [2] * trials, drafts, dprobs, md)


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize(
    "params",
    [SP(temperature=1.0), SP(temperature=0.8, top_k=4), SP(temperature=1.2, top_p=0.75)],
    ids=["plain", "top_k", "top_p"],
)
def test_emitted_tokens_follow_target_distribution(params: SP, with_q: bool) -> None:
    # One-hot verification accepts only sum_x q(x) p(x) of the time: more trials for it.
    outs = run_trials(params, with_q, 12000 if with_q else 30000)
    md = make_md([params])
    target = processed_probs(torch.log(P_ROWS), md, torch.zeros(3, dtype=torch.int64))
    target = target.numpy().astype(np.float64)  # [3, 6] processed p per position
    for pos in range(3):
        # Given the earlier drafts were accepted, position pos is drawn from row pos.
        toks = np.array([o[pos] for o in outs if len(o) > pos])
        assert len(toks) > 200
        assert chi_ok(toks, target[pos]), f"position {pos}"
    if params.top_k == 0 and params.top_p == 1.0:
        # The test has power: the draft distribution itself is rejected.
        firsts = np.array([o[0] for o in outs])
        assert not chi_ok(firsts, Q_ROWS[0].numpy().astype(np.float64))


def test_accept_all_when_draft_equals_target() -> None:
    trials = 300
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(P_ROWS[:2], trials, replacement=True, generator=gen).T.tolist()
    md = make_md([SP()] * trials, list(range(trials)))
    outs = rejection_sample(torch.log(P_ROWS).repeat(trials, 1), [2] * trials, drafts,
                            [P_ROWS[:2].clone()] * trials, md)
    assert all(len(o) == 3 and o[:2] == d for o, d in zip(outs, drafts))


def test_reject_all_when_target_excludes_draft() -> None:
    # Draft token 1 has raw mass but top_k=2 removes it; token 3 has zero mass outright.
    logits = torch.tensor([[2.0, 1.5, 1.9, NEG_INF], [2.0, 1.5, 1.9, NEG_INF]])
    trials = 400
    md = make_md([SP(top_k=2)] * trials, list(range(trials)))
    outs = rejection_sample(logits[:1].repeat(2 * trials, 1), [1] * trials,
                            [[1], [3]] * (trials // 2), None, md)
    assert all(len(o) == 1 and o[0] in (0, 2) for o in outs)
    assert {o[0] for o in outs} == {0, 2}


def test_draft_token_zero_is_a_real_token() -> None:
    # Greedy: argmax is 0 and the draft 0 is accepted.
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 0.0, 7.0]])
    assert rejection_sample(logits, [1], [[0]], None, make_md([SP(temperature=0.0)])) == [[0, 2]]
    # Random, one-hot q: p = (0.5, 0.5, 0). Rejecting draft 0 must resample without token 0,
    # and accepting it must emit 0 followed by the bonus.
    trials = 400
    row = torch.log(torch.tensor([0.5, 0.5, 0.0]))
    md = make_md([SP()] * trials, list(range(trials)))
    outs = rejection_sample(row.repeat(2 * trials, 1), [1] * trials, [[0]] * trials, None, md)
    assert {tuple(o) for o in outs if len(o) == 1} == {(1,)}
    assert all(o[0] == 0 for o in outs if len(o) == 2)
    assert 100 < sum(len(o) == 2 for o in outs) < 300


def test_out_of_vocab_draft_is_rejected() -> None:
    logits = torch.tensor([[0.0, 9.0], [9.0, 0.0]])
    for temp in (0.0, 1.0):
        md = make_md([SP(temperature=temp)] * 2)
        out = rejection_sample(logits.repeat(2, 1), [1, 1], [[-1], [2]], None, md)
        assert [len(o) for o in out] == [1, 1]


def test_no_drafts_samples_like_the_plain_sampler() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4))
    params = [SP(temperature=0.9, top_p=0.9, seed=s) for s in range(6)]
    plain = Sampler()(logits, make_md(params)).token_ids.tolist()
    spec = rejection_sample(logits, [0] * 6, [[]] * 6, None, make_md(params))
    assert spec == [[t] for t in plain]


def test_seeded_request_reproduces_whatever_the_batch() -> None:
    logits, nd, drafts, dprobs, params = random_case(5, 6, 12, "mixed")
    params = [SP(temperature=1.0, top_k=5)] * 6
    full = rejection_sample(logits, nd, drafts, dprobs, make_md(params, [77] * 6))
    start = sum(n + 1 for n in nd[:3])
    alone = rejection_sample(logits[start : start + nd[3] + 1], [nd[3]], [drafts[3]],
                             [dprobs[3]], make_md(params[:1], [77]))
    assert alone == [full[3]]


def test_bad_inputs_raise() -> None:
    md = make_md([SP()])
    with pytest.raises(ValueError, match="draft ids"):
        rejection_sample(torch.zeros(3, 4), [2], [[1]], None, md)
    with pytest.raises(ValueError, match="expected"):
        rejection_sample(torch.zeros(2, 4), [2], [[1, 2]], None, md)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, 4), [2], [[1, 2]], [torch.zeros(2, 5)], md)
    with pytest.raises(ValueError, match="requests"):
        rejection_sample(torch.zeros(2, 4), [0, 0], [[], []], None, md)
