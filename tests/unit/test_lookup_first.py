"""LookupFirstProposer: the lookup's drafts where it has them, the head's for the rest (with the
head's own skip reasons), and both drafters told of every end."""

from __future__ import annotations

import pytest

from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.base import Drafts, Proposer
from dynaspec.spec_decode.drafters.lookup_first import LookupFirstProposer


class _Fake(Proposer):
    def __init__(self, answers: dict[str, list[int]], hidden: bool) -> None:
        self.answers, self.reads_hidden_states = answers, hidden
        self.asked: list[tuple[str, int]] = []
        self.ended: list[str] = []
        self.seen: list[object] = []

    def propose(self, requests, k_per_request):
        self.asked += [(r.request_id, k) for r, k in zip(requests, k_per_request)]
        ids = [self.answers.get(r.request_id, [])[:k] if k > 0 else []
               for r, k in zip(requests, k_per_request)]
        why = ["no_match" if k > 0 and not d else None for d, k in zip(ids, k_per_request)]
        return Drafts(ids, None, why)

    def forget(self, request_id):
        self.ended.append(request_id)

    def preempt(self, request_id):
        self.ended.append(request_id)

    def num_cached(self):
        return 0

    def observe_hidden(self, hs):
        self.seen.append(hs)


def _req(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))


def test_lookup_drafts_first_and_the_head_fills_the_rest():
    lookup = _Fake({"a": [7, 8, 9]}, hidden=False)
    head = _Fake({"a": [1], "b": [4, 5]}, hidden=True)
    p = LookupFirstProposer(lookup, head)
    reqs = [_req("a"), _req("b"), _req("c"), _req("d")]
    d = p.propose(reqs, [3, 2, 1, 0])
    assert d.token_ids == [[7, 8, 9], [4, 5], [], []]
    assert d.skip_reasons == [None, None, "no_match", None]
    assert head.asked == [("b", 2), ("c", 1)]  # never "a" (the lookup drafted) nor "d" (k=0)
    p.observe_hidden("hs")
    assert head.seen == ["hs"]
    p.forget("a")
    p.preempt("b")
    assert lookup.ended == head.ended == ["a", "b"]


def test_refuses_a_head_that_drafts_with_probabilities():
    head = _Fake({"a": [1]}, hidden=True)
    inner = head.propose
    head.propose = lambda reqs, ks: Drafts(inner(reqs, ks).token_ids, [None], [None])
    with pytest.raises(ValueError, match="needs a deterministic head"):
        LookupFirstProposer(_Fake({}, hidden=False), head).propose([_req("a")], [2])


def test_refuses_a_pair_in_the_wrong_roles():
    with pytest.raises(ValueError, match="lookup drafter"):
        LookupFirstProposer(_Fake({}, hidden=True), _Fake({}, hidden=True))


def test_the_head_drafts_within_its_own_cap_and_is_reported_as_the_fallback():
    lookup = _Fake({"a": [7, 8, 9]}, hidden=False)
    head = _Fake({"b": [4, 5, 6], "c": [1, 2]}, hidden=True)
    p = LookupFirstProposer(lookup, head)
    assert p.has_fallback
    d = p.propose([_req("a"), _req("b"), _req("c")], [3, 3, 2], fallback_k=[0, 1, 0])
    assert d.token_ids == [[7, 8, 9], [4], []]
    assert head.asked == [("b", 1)]  # "c": its fallback cap is 0, so the head is not asked
    assert d.from_fallback == [False, True, False] and d.fallback_seconds >= 0
    with pytest.raises(ValueError, match="fallback k"):
        p.propose([_req("a")], [3], fallback_k=[1, 1])
