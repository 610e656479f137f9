"""LookupFirstProposer: the lookup's drafts where it has them, the head's for the rest (with the
head's own skip reasons), and both drafters told of every end."""

from __future__ import annotations

import pytest

from dynaspec.spec_decode.drafters.base import Drafts
from dynaspec.spec_decode.drafters.lookup_first import LookupFirstProposer
from tests.unit.drafter_fakes import FakeDrafter, request


def test_lookup_drafts_first_and_the_head_fills_the_rest():
    lookup = FakeDrafter({"a": [7, 8, 9]}, hidden=False)
    head = FakeDrafter({"a": [1], "b": [4, 5]}, hidden=True)
    p = LookupFirstProposer(lookup, head)
    reqs = [request("a"), request("b"), request("c"), request("d")]
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
    head = FakeDrafter({"a": [1]}, hidden=True)
    inner = head.propose
    head.propose = lambda reqs, ks: Drafts(inner(reqs, ks).token_ids, [None], [None])
    with pytest.raises(ValueError, match="needs a deterministic head"):
        LookupFirstProposer(FakeDrafter({}, hidden=False), head).propose([request("a")], [2])


def test_refuses_a_pair_in_the_wrong_roles():
    with pytest.raises(ValueError, match="lookup drafter"):
        LookupFirstProposer(FakeDrafter({}, hidden=True), FakeDrafter({}, hidden=True))


def test_the_head_drafts_within_its_own_cap_and_is_reported_as_the_fallback():
    lookup = FakeDrafter({"a": [7, 8, 9]}, hidden=False)
    head = FakeDrafter({"b": [4, 5, 6], "c": [1, 2]}, hidden=True)
    p = LookupFirstProposer(lookup, head)
    assert p.has_fallback
    d = p.propose([request("a"), request("b"), request("c")], [3, 3, 2], fallback_k=[0, 1, 0])
    assert d.token_ids == [[7, 8, 9], [4], []]
    assert head.asked == [("b", 1)]  # "c": its fallback cap is 0, so the head is not asked
    assert d.from_fallback == [False, True, False] and d.fallback_seconds >= 0
    with pytest.raises(ValueError, match="fallback k"):
        p.propose([request("a")], [3], fallback_k=[1, 1])
