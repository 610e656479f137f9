"""The frozen records the engine reports, checked at construction (docs/design.md §5): one
request's part in a step (`RequestStepSpec`), one step (`StepStats`), the engine's state at an
instant (`EngineSnapshot`) and a finished request's latencies. The counters they fold into are
in metrics/stats.py. Impossible records are rejected here, so the folds never see one.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The one list of reasons a request verified no valid draft this step. The K policy sets the
# first five (spec_decode/policy/k_policy.py), the scheduler prefill/token_budget, the drafters the
# rest. ALL_INVALID: counted by the fold when every draft was invalid (the engine may set it).
SKIP_REASONS_DOC = {
    "schedule_zero": "the step's K is 0",
    "drafter_length": "the drafts would overflow the drafter's position limit",
    "max_tokens": "the request has no room for a draft before max_tokens",
    "max_model_len": "the request has no room for a draft before max_model_len",
    "adaptive": "the K policy (adaptive or goodput) chose fewer drafts for this request",
    "prefill": "a prefill chunk does not draft",
    "token_budget": "the step's token budget could not fit this request's drafts",
    "no_match": "the n-gram drafter found no match",
    "short_match": "a request the K policy had cut: its drafter's match was not as deep as "
                   "its cap (only such a draft is verified then)",
    "drafter_kv": "the draft model's own KV pool had no room",
}
SKIP_REASONS = frozenset(SKIP_REASONS_DOC)
INVALID_REASONS, ALL_INVALID = frozenset({"padding", "async_placeholder", "grammar"}), "all_invalid"


class FrozenCounts(dict):
    """An immutable, hashable, picklable dict of key -> count; keys sorted, zeros dropped."""

    def __init__(self, items: Mapping[Any, int] | Iterable[tuple[Any, int]] = ()) -> None:
        d = dict(items)
        super().__init__((key, d[key]) for key in sorted(d) if d[key] != 0)

    def _immutable(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("FrozenCounts is immutable")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _immutable

    # dict declares itself unhashable (__hash__ = None); a frozen one hashes by its items.
    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenCounts, (dict(self),))


NO_COUNTS = FrozenCounts()


def _count(value: Any, what: str) -> int:
    ok = hasattr(value, "__index__") and not isinstance(value, bool)
    if (n := operator.index(value) if ok else -1) < 0:
        raise ValueError(f"{what} must be an int count >= 0, got {value!r}")
    return n


def _seconds(value: Any, what: str) -> float:
    if not (math.isfinite(x := float(value)) and x >= 0):
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return x


@dataclass(frozen=True)
class RequestStepSpec:
    """One request in one engine step. Impossible records are rejected at construction."""

    request_id: str
    num_draft_tokens: int  # valid draft tokens verified (padding/invalid excluded)
    num_accepted_tokens: int  # drafts the verifier accepted
    num_emitted_tokens: int  # tokens returned this step after stop/EOS/max_tokens truncation
    skip_reason: str | None  # why no valid draft was verified (None when it verified >= 1)
    invalid_draft_tokens: Mapping[str, int] = NO_COUNTS
    num_tree_nodes: int = 0  # its drafts were a tree of this many nodes, verified as one (0: not)
    num_forced_tokens: int = 0  # of its valid drafts, the first ones its grammar forced (§4d)
    # (source, drafts, accepted) of the drafter's drafts where it labels them (the hybrid's
    # "eagle" / "ngram" / "suffix"); (): all of them under source "drafter"
    drafts_by_source: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self) -> None:  # built per request per step: plain ints take a fast path
        rid, d, a, e = self.request_id, *self.counts
        if not (type(d) is type(a) is type(e) is int and min(d, a, e) >= 0):
            for name in ("num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
                object.__setattr__(self, name, _count(getattr(self, name), f"{rid!r}: {name}"))
        invalid = dict(self.invalid_draft_tokens) if self.invalid_draft_tokens else {}
        for reason, n in invalid.items():
            invalid[reason] = _count(n, f"{rid!r}: invalid_draft_tokens[{reason!r}]")
        object.__setattr__(self, "invalid_draft_tokens", FrozenCounts(invalid) or NO_COUNTS)
        if problem := self._problem():
            raise ValueError(f"request {rid!r}: {problem}")

    @property
    def counts(self) -> tuple[int, int, int]:
        """(valid draft tokens, accepted, emitted)."""
        return self.num_draft_tokens, self.num_accepted_tokens, self.num_emitted_tokens

    def _problem(self) -> str | None:
        d, a, e = self.counts
        if a > d:
            return f"accepted {a} > valid draft tokens {d}"
        if not 0 <= self.num_forced_tokens <= d:
            return f"{self.num_forced_tokens} forced drafts of {d} valid draft tokens"
        if self.drafts_by_source:
            own = (d - self.num_forced_tokens, a - min(a, self.num_forced_tokens))
            got = (sum(n for _, n, _ in self.drafts_by_source),
                   sum(a for _, _, a in self.drafts_by_source))
            if got != own or any(not 0 <= a <= n for _, n, a in self.drafts_by_source):
                return f"drafts by source {self.drafts_by_source} do not add up to {own}"
        if self.num_tree_nodes not in (0, d):
            return f"a tree of {self.num_tree_nodes} nodes but {d} valid draft tokens"
        if e > a + 1:
            return f"emitted {e} > accepted {a} + 1 (one recovered/bonus token per step)"
        reason, unknown = self.skip_reason, set(self.invalid_draft_tokens) - INVALID_REASONS
        if unknown:
            return f"unknown invalid-draft reason(s) {sorted(unknown)} ({sorted(INVALID_REASONS)})"
        if reason is not None and reason not in SKIP_REASONS and reason != ALL_INVALID:
            return f"unknown skip_reason {reason!r} (known: {sorted(SKIP_REASONS | {ALL_INVALID})})"
        if d > 0 and reason is not None:
            return f"skip_reason {reason!r} given but {d} valid draft tokens were verified"
        if reason == ALL_INVALID and not self.invalid_draft_tokens:
            return "skip_reason 'all_invalid' without any invalid draft tokens"
        return None


@dataclass(frozen=True)
class GrammarStepStats:
    """Structured-output work in one step (the grammar-invalid drafts are in the requests)."""

    mask_seconds: float = 0.0  # draft checks, bitmask filling, masking, grammar state updates
    num_masked_rows: int = 0  # logits rows masked
    compile_seconds: tuple[float, ...] = ()  # grammars compiled since the previous step


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """One engine step. `k` is the step's K; `None` when speculation is off."""

    k: int | None
    requests: tuple[RequestStepSpec, ...]
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    schedule_seconds: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    grammar: GrammarStepStats | None = None  # None when no request in the step had a grammar
    # The execution path and verify width the step ran (BatchDescriptor), for
    # execution_steps_total{path,width}; width "mixed" for a prefill+decode step.
    path: str | None = None
    width: str | None = None

    def __post_init__(self) -> None:
        if self.k is not None:
            object.__setattr__(self, "k", _count(self.k, "StepStats.k"))
        object.__setattr__(self, "requests", tuple(self.requests))
        for name in ("draft_seconds", "verify_seconds", "schedule_seconds"):
            object.__setattr__(self, name, _seconds(getattr(self, name), f"StepStats.{name}"))
        for name in ("num_prompt_tokens", "num_generation_tokens", "num_preemptions"):
            object.__setattr__(self, name, _count(getattr(self, name), f"StepStats.{name}"))
        if len(ids := [r.request_id for r in self.requests]) != len(set(ids)):
            raise ValueError(f"StepStats: a request appears more than once in one step: {ids}")


@dataclass(frozen=True, kw_only=True)
class EngineSnapshot:
    """Engine state at one instant (gauges; the two prefix-cache fields are monotone totals)."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of the target's KV blocks in use, 0..1
    kv_pool_tokens_target: int
    kv_pool_tokens_drafter: int  # 0 when the drafter keeps no KV (n-gram, speculation off)
    prefix_cache_queries: int  # tokens looked up, total since start
    prefix_cache_hits: int  # tokens found, total since start
    num_preemptions_total: int
    modelled_goodput: float | None = None  # K policy: tokens/s its decisions expected (EMA)
    observed_goodput: float | None = None  # ... and tokens/s the same decode steps gave (EMA)
    k_policy: str | None = None  # the K policy that runs (table | adaptive | goodput), None: none
    k_policy_reprobes: int = 0  # goodput: K>0 steps its divergence guard forced, total


@dataclass(frozen=True, kw_only=True)
class FinishedRequestTimes:
    """Latencies of one finished request. `ttft_s` is None if it never produced a token."""

    ttft_s: float | None
    inter_token_s: tuple[float, ...]
    e2e_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
