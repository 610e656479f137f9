"""N-gram proposer: exact drafts on hand-made sequences, a brute-force property check, the cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynaspec.spec_decode.drafters.ngram as ngram_mod
from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.ngram import NgramProposer, ngram_match


def reference_match(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out naively: longest n first, then the most recent earlier start."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                out = list(tokens)  # LZ77 copy: the draft may copy from itself
                for i in range(k):
                    out.append(out[start + n + i])
                return out[length:]
    return []


def match(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return ngram_match(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def make_request(rid: str, prompt: list[int], output: list[int] | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(), output_token_ids=list(output or []))


# ---------------------------------------------------------------- ngram_match, hand-made cases


def test_match_n1() -> None:
    # Only the last token (7) recurs; it was followed by 8, 9.
    assert match([7, 8, 9, 7], 1, 3, 2) == [8, 9]


def test_longer_match_beats_more_recent_shorter_one() -> None:
    # Suffix [1, 2, 3]: a 3-gram occurs at 0 (followed by 10, 11); only [2, 3] occurs at 5
    # (followed by 20). Longest n wins over recency.
    seq = [1, 2, 3, 10, 11, 2, 3, 20, 1, 2, 3]
    assert match(seq, 1, 3, 2) == [10, 11]
    # With max_n = 2 the 3-gram is invisible: the most recent 2-gram wins.
    assert match(seq, 1, 2, 2) == [20, 1]


def test_max_n_caps_length_then_recency_decides() -> None:
    # Suffix 4-gram [5, 1, 2, 3] occurs at 0 only; its 3-gram tail also occurs later at 7.
    seq = [5, 1, 2, 3, 40, 41, 9, 1, 2, 3, 50, 5, 1, 2, 3]
    assert match(seq, 1, 4, 1) == [40]
    assert match(seq, 1, 3, 1) == [50]


def test_min_n_respected() -> None:
    # Only a 1-gram matches; min_n = 2 rejects it.
    seq = [4, 6, 9, 1, 4]
    assert match(seq, 1, 3, 3) == [6, 9, 1]
    assert match(seq, 2, 3, 3) == []
    # A 2-gram match satisfies min_n = 2 but not min_n = 3.
    seq2 = [4, 5, 6, 7, 4, 5]
    assert match(seq2, 2, 3, 2) == [6, 7]
    assert match(seq2, 3, 3, 2) == []


def test_most_recent_occurrence_wins() -> None:
    seq = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert match(seq, 2, 2, 1) == [30]
    assert match(seq, 1, 2, 4) == [30, 1, 2, 30]  # the copy runs on periodically


def test_occurrence_may_overlap_suffix() -> None:
    # [0, 0, 0, 0]: suffix [0, 0, 0] occurs at 0 (overlapping); the copy continues LZ77-style.
    assert match([0, 0, 0, 0], 1, 3, 5) == [0, 0, 0, 0, 0]
    # Periodic run: the latest copy of [1, 2] is followed by one period, repeated to k.
    assert match([1, 2, 1, 2, 1, 2], 2, 2, 5) == [1, 2, 1, 2, 1]


def test_copy_continues_past_context_end_and_is_cut_by_k() -> None:
    seq = [3, 4, 5, 6, 3]
    assert match(seq, 1, 2, 10) == [4, 5, 6, 3] * 2 + [4, 5]
    assert match(seq, 1, 2, 2) == [4, 5]
    assert match([8, 9, 8], 1, 1, 4) == [9, 8, 9, 8]


def test_no_match_and_degenerate_inputs() -> None:
    assert match([1, 2, 3, 4], 1, 3, 3) == []
    assert match([], 1, 3, 3) == []
    assert match([5], 1, 3, 3) == []
    # Suffix longer than any possible earlier occurrence.
    assert match([5, 5], 2, 3, 3) == []


def test_k_zero_or_negative() -> None:
    assert match([7, 8, 7], 1, 2, 0) == []
    assert match([7, 8, 7], 1, 2, -1) == []


def test_token_zero_is_an_ordinary_token() -> None:
    assert match([0, 1, 0, 2, 0], 1, 2, 3) == [2, 0, 2]
    assert match([0, 0, 5, 9, 0, 0], 2, 2, 2) == [5, 9]
    assert match([3, 0, 0, 7, 3], 1, 1, 3) == [0, 0, 7]


def test_returns_int_array_for_list_input() -> None:
    out = ngram_match(np.array([1, 2, 1], dtype=np.int32), 1, 1, 2)
    assert out.tolist() == [2, 1]  # k == period: no continuation needed


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
    k=st.integers(-1, 8),
)
def test_matches_brute_force_reference(tokens: list[int], min_n: int, extra_n: int, k: int) -> None:
    max_n = min_n + extra_n
    assert match(tokens, min_n, max_n, k) == reference_match(tokens, min_n, max_n, k)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), min_size=1, max_size=60),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 4),
    tail=st.integers(1, 6),
)
def test_recent_candidates_shortcut_matches_reference(
    tokens: list[int], min_n: int, extra_n: int, tail: int
) -> None:
    # Shrink the threshold so short sequences take the "most recent candidates first" path.
    saved = ngram_mod._TAIL_CANDIDATES
    ngram_mod._TAIL_CANDIDATES = tail
    try:
        max_n = min_n + extra_n
        assert match(tokens, min_n, max_n, 3) == reference_match(tokens, min_n, max_n, 3)
    finally:
        ngram_mod._TAIL_CANDIDATES = saved


@pytest.mark.parametrize("period", [1, 2, 3, 7])
def test_long_periodic_context(period: int) -> None:
    # Thousands of candidates at every length: the shortcut path at the default threshold.
    tokens = (list(range(period)) * (3000 // period + 1))[:3000]
    assert match(tokens, 2, 5, 4) == reference_match(tokens, 2, 5, 4)
    tokens[-2] = 99  # the suffix now breaks the period: only a 1-gram ([last]) can match
    assert match(tokens, 1, 5, 4) == reference_match(tokens, 1, 5, 4)
    assert match(tokens, 2, 5, 4) == []


# ---------------------------------------------------------------- NgramProposer


def test_propose_reports_drafts_and_reasons() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    reqs = [
        make_request("a", [1, 2, 3, 1, 2]),  # match -> [3, 1]
        make_request("b", [1, 2, 3, 4]),  # no match
        make_request("c", [5, 6, 5]),  # k = 0: caller's decision, no reason here
        make_request(
            "d", [0, 9], [0]
        ),  # prompt + output: [0, 9, 0] -> [9, 0, 9, 0, 9] (periodic copy)
    ]
    drafts = proposer.propose(reqs, [2, 2, 0, 5])
    assert drafts.token_ids == [[3, 1], [], [], [9, 0, 9, 0, 9]]
    assert drafts.skip_reasons == [None, "no_match", None, None]
    assert drafts.probs is None
    assert all(type(t) is int for ids in drafts.token_ids for t in ids)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
    with pytest.raises(ValueError):
        NgramProposer(1, 2).propose([make_request("a", [1])], [])


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), max_size=30),
    steps=st.lists(st.lists(st.integers(0, 3), max_size=3), max_size=40),
    k=st.integers(1, 5),
)
def test_incremental_cache_equals_fresh(prompt: list[int], steps: list[list[int]], k: int) -> None:
    # Output grows by 0..3 tokens per step (accepted drafts + bonus), as in spec decode.
    cached = NgramProposer(1, 3)
    req = make_request("r", prompt)
    for new_tokens in steps:
        req.output_token_ids.extend(new_tokens)
        got = cached.propose([req], [k]).token_ids[0]
        fresh = NgramProposer(1, 3).propose([req], [k]).token_ids[0]
        assert got == fresh == reference_match(req.all_token_ids, 1, 3, k)


def test_buffer_grows_past_initial_capacity() -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 4)
    req = make_request("r", rng.integers(0, 50, 300).tolist())
    for _ in range(700):
        req.output_token_ids.append(int(rng.integers(0, 50)))
        got = proposer.propose([req], [4]).token_ids[0]
    assert got == reference_match(req.all_token_ids, 2, 4, 4)


def test_forget_and_id_reuse() -> None:
    proposer = NgramProposer(1, 2)
    proposer.propose([make_request("r", [1, 2, 1])], [2])
    assert proposer.num_cached() == 1
    proposer.forget("r")
    proposer.forget("r")  # idempotent
    assert proposer.num_cached() == 0
    # Same id, different sequence, after forget: fresh result.
    assert proposer.propose([make_request("r", [4, 5, 6, 4])], [2]).token_ids == [[5, 6]]
    # Same id reused WITHOUT forget (a new Request object): must not reuse stale tokens.
    assert proposer.propose([make_request("r", [7, 8, 9, 7, 8])], [3]).token_ids == [[9, 7, 8]]


def test_rewritten_output_under_same_request_is_detected() -> None:
    proposer = NgramProposer(1, 2)
    req = make_request("r", [1, 2, 3], [1])
    assert proposer.propose([req], [2]).token_ids == [[2, 3]]
    # The output shrinks then regrows to a different token (e.g. a rolled-back step).
    req.output_token_ids[:] = [3]  # [1, 2, 3, 3]
    assert proposer.propose([req], [2]).token_ids == [[3, 3]]
    req.output_token_ids[:] = [2]  # [1, 2, 3, 2]
    assert proposer.propose([req], [2]).token_ids == [[3, 2]]
