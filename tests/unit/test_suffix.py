"""Suffix index and drafter: matches and paths against brute force, draft-length rules, the
bounded LRU global cache (10,000 requests within the memory bound), per-request sync."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.suffix import (
    GlobalSuffixCache,
    SuffixParams,
    SuffixProposer,
    memory_bound_bytes,
)
from dynaspec.spec_decode.drafters.suffix_index import SuffixIndex


def _brute_match(seq: list[int], pattern: list[int], before: int) -> tuple[list[int], int]:
    """Longest suffix (>= 2) of pattern ending at some p < before in seq, and every such p."""
    best: tuple[list[int], int] = ([], 0)
    for m in range(2, len(pattern) + 1):
        suf = pattern[-m:]
        ends = [p for p in range(m - 1, min(before, len(seq))) if seq[p - m + 1: p + 1] == suf]
        if not ends:
            break
        best = (ends, m)
    return best


def _brute_follow(seq: list[int], ends: list[int], n: int, min_prob: float) -> list[int]:
    pos, out, prob = [e + 1 for e in ends], [], 1.0
    for _ in range(n):
        pos = [p for p in pos if p < len(seq) and seq[p] >= 0]
        if not pos:
            break
        counts = Counter(seq[p] for p in pos)
        top = max(counts.values())
        best = max(
            (t for t in counts if counts[t] == top),
            key=lambda t: max(p for p in pos if seq[p] == t),
        )
        prob *= top / len(pos)
        if prob < min_prob:
            break
        out.append(best)
        pos = [p + 1 for p in pos if seq[p] == best]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_match_and_follow_equal_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    seq = [rng.randrange(vocab) for _ in range(rng.randrange(5, 400))]
    ix = SuffixIndex()
    for i in range(0, len(seq), 37):  # mixed append sizes exercise the dict and rebuild paths
        ix.append(seq[i:i + 37])
    assert ix.view().tolist() == seq
    pattern = seq[-rng.randrange(2, 12):]
    ends, m = ix.match(np.asarray(pattern, dtype=np.int32), before=len(seq) - 1)
    want_ends, want_m = _brute_match(seq, pattern, len(seq) - 1)
    assert m == want_m and ends.tolist() == want_ends
    if m:
        for min_prob in (0.0, 0.3, 0.9):
            got, probs = ix.follow(ends, 10, min_prob)
            assert got == _brute_follow(seq, want_ends, 10, min_prob)
            assert all(p >= min_prob for p in probs) and probs == sorted(probs, reverse=True)


def test_killed_slots_never_match_and_separators_stop_paths():
    ix = SuffixIndex()
    ix.append([-1, 1, 2, 3, 4, -1, 1, 2, 9])
    ends, m = ix.match(np.array([1, 2]))
    assert ends.tolist() == [2, 7] and m == 2
    ix.kill(6, 9)
    ends, _ = ix.match(np.array([1, 2]))
    assert ends.tolist() == [2]
    ix.kill(1, 5)
    assert ix.match(np.array([1, 2]))[1] == 0
    ix2 = SuffixIndex()
    ix2.append([5, 6, 7, -1, 8])
    assert ix2.follow(ix2.match(np.array([5, 6]))[0], 5, 0.0)[0] == [7]


def test_draft_length_follows_match_length_spec_factor_and_depth():
    p = SuffixParams(max_depth=24, spec_factor=1.0, min_token_prob=0.1)
    assert p.draft_len(8, 2) == 2 and p.draft_len(8, 5) == 5 and p.draft_len(8, 16) == 8
    assert p.draft_len(8, 20) == 4, "match + draft <= max_depth"
    assert SuffixParams(spec_factor=0.5).draft_len(8, 6) == 3
    assert p.pattern_len(8) == 16 and p.pattern_len(20) == 12 and p.pattern_len(1) == 23
    with pytest.raises(ValueError, match="max_depth"):
        SuffixParams(max_depth=2)


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=100))


def test_proposer_prefers_the_more_confident_source_and_reports_no_match():
    prop = SuffixProposer(SuffixParams(), max_cached_requests=4, max_cached_tokens=1000)
    done = _req("old", [1, 2])
    done.output_token_ids += [10, 11, 12, 13, 14, 15, 16, 17]
    prop.propose([done], [4])
    prop.forget("old")  # its output joins the global cache
    r = _req("new", [50, 51, 10, 11, 12, 13])
    d = prop.propose([r], [4])
    assert d.token_ids == [[14, 15, 16, 17]] and d.probs is None and d.skip_reasons == [None]
    assert prop.cache_stats().global_drafts == 1
    miss = prop.propose([_req("x", [90, 91, 92])], [4])
    assert miss.token_ids == [[]] and miss.skip_reasons == ["no_match"]
    assert prop.propose([r], [0]).skip_reasons == [None], "k = 0 is the caller's skip"


def test_proposer_syncs_appended_tokens_and_rebuilds_for_a_new_request_object():
    prop = SuffixProposer(SuffixParams(), max_cached_requests=0)
    r = _req("a", [1, 2, 3, 4, 1, 2])
    assert prop.propose([r], [3]).token_ids == [[3, 4]]  # spec_factor 1: match 2 -> 2 drafts
    r.output_token_ids += [3, 4]
    assert prop.propose([r], [3]).token_ids == [[1, 2, 3]]
    prop.preempt("a")
    assert prop.num_cached() == 0 and prop.cache.stats()["requests"] == 0, "preempt caches nothing"
    other = _req("a", [7, 8, 9, 7, 8])
    assert prop.propose([other], [3]).token_ids == [[9, 7]]


def test_lru_eviction_keeps_recently_used_outputs():
    cache = GlobalSuffixCache(max_cached_requests=3, max_cached_tokens=10_000)
    for i in range(3):
        cache.insert(f"r{i}", [100 + i, 200 + i, 300 + i, 400 + i])
    params = SuffixParams()
    assert cache.draft(np.array([100, 200]), 2, params).token_ids == [300, 400]  # uses r0
    cache.insert("r3", [1, 2, 3])
    assert list(cache.entries) == ["r2", "r0", "r3"], "r1 was least recently used"
    assert cache.draft(np.array([101, 201]), 2, params).token_ids == []


def test_global_cache_bounded_under_10000_requests():
    max_requests, max_tokens = 500, 20_000
    cache = GlobalSuffixCache(max_requests, max_tokens)
    bound = memory_bound_bytes(max_tokens, max_requests)
    rng = np.random.default_rng(0)
    params = SuffixParams()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    peak_reported = 0
    for i in range(10_000):
        out = rng.integers(0, 50_000, size=int(rng.integers(2, 120))).tolist()
        if i % 7 == 0:  # repeated outputs too, so drafts touch entries (LRU reordering)
            out = [1, 2, 3, 4, 5, 6] + out[:10]
        cache.insert(f"req-{i}", out)
        if i % 50 == 0:
            cache.draft(np.array([1, 2, 3]), 4, params)
        assert len(cache.entries) <= max_requests and cache.live_tokens <= max_tokens
        if i % 500 == 0:
            peak_reported = max(peak_reported, cache.nbytes())
            assert cache.nbytes() <= bound
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    stats = cache.stats()
    assert stats["evictions"] >= 10_000 - max_requests and stats["compactions"] > 0
    assert stats["dead_tokens"] <= max(stats["live_tokens"], 4096)
    assert traced <= bound, f"traced {traced} bytes > bound {bound}"
    assert cache.nbytes() <= bound and peak_reported <= bound


def test_cache_off_and_reset():
    prop = SuffixProposer(SuffixParams(), max_cached_requests=0)
    r = _req("a", [1, 2])
    r.output_token_ids += [3, 4, 5]
    prop.propose([r], [2])
    prop.forget("a")
    assert prop.cache_stats().requests == 0
    on = GlobalSuffixCache(10, 100)
    on.insert("a", [1, 2, 3])
    on.reset()
    assert on.stats()["requests"] == 0 and on.index.length == 0
    with pytest.raises(ValueError, match="max_cached_tokens"):
        GlobalSuffixCache(1, 0)
