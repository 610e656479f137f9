"""A scripted drafter for the tests of drafters that pair a lookup with a head
(test_lookup_first.py, test_hybrid_tree.py): it answers each request id from a table and records
what it was asked, told to forget, and shown."""

from __future__ import annotations

from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.base import Drafts, Proposer


class FakeDrafter(Proposer):
    def __init__(self, answers: dict[str, list[int]], hidden: bool) -> None:
        self.answers, self.reads_hidden_states = answers, hidden
        self.asked: list[tuple[str, int]] = []
        self.ended: list[str] = []
        self.seen: list[object] = []

    def propose(self, requests, k_per_request, **_):
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


def request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))
