"""Speculative-decoding and engine counters: the pure fold and the identities.

docs/design.md §5. The records folded (`StepStats`, `RequestStepSpec`) are in metrics/records.py.
`fold_step` folds an engine `StepStats` into the engine-wide `SpecCounters`,
`fold_request` one request's part into that request's counters. Both are pure and always return
a new accumulator (never None, never an exit that drops other requests' counts, vLLM #56195).
- a speculative request-step is a *draft* (>= 1 valid draft verified) or a *skip*
  (`draft_skips[reason]`), never a 0-accepted draft for a skipped drafter (vLLM #34734);
- invalid/padded drafts are excluded from `num_draft_tokens`, counted by reason; all invalid is a
  skip (`all_invalid`); accepted (verifier) and emitted (after stop/EOS, vLLM #56101) are apart;
- d drafted, a accepted adds 1 to `drafted_per_pos[:d]`, `accepted_per_pos[:a]` (conditional
  per-position rates stay honest as K varies); `steps_by_k` counts k = 0, k=None is "off";
- a draft that was a token tree verified as one (docs/design.md §4c) also counts in the tree
  counters: `num_tree_drafts`, its nodes in `num_tree_nodes` (its drafts: a tree's valid draft
  tokens are its nodes), its accepted path in `num_tree_accepted_tokens`, and engine steps with
  >= 1 tree in `num_tree_steps` (engine-wide only).
Derived values with no denominator are None (JSON null), never 0. No prometheus_client here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from dynaspec.metrics.records import (
    ALL_INVALID,
    NO_COUNTS,
    FrozenCounts,
    RequestStepSpec,
    StepStats,
)

_INT_FIELDS = (
    "num_steps", "num_spec_off_steps", "num_request_steps", "num_spec_request_steps",
    "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
    "num_prompt_tokens", "num_generation_tokens", "num_preemptions",
)  # fmt: skip
_FLOAT_FIELDS = ("draft_seconds", "verify_seconds", "scheduler_seconds")
_POS_FIELDS = ("accepted_per_pos", "drafted_per_pos")
_MAP_FIELDS = ("steps_by_k", "draft_skips", "invalid_draft_tokens", "draft_tokens_by_source",
               "accepted_tokens_by_source")
# Where valid drafts came from: the request's grammar (forced, docs/design.md §4d) or its drafter.
GRAMMAR_SOURCE, DRAFTER_SOURCE = "grammar", "drafter"
_TREE_FIELDS = ("num_tree_steps", "num_tree_drafts", "num_tree_nodes", "num_tree_accepted_tokens")
_DICT_FIELDS = _INT_FIELDS[:8] + _FLOAT_FIELDS  # to_dict() leaves the engine-only ones out
_STEP_TOTALS = [(n, n) for n in _INT_FIELDS[8:] + _FLOAT_FIELDS[:2]]
_STEP_TOTALS.append(("scheduler_seconds", "schedule_seconds"))


@dataclass(frozen=True)
class SpecCounters:
    """Immutable counters, engine-wide or per request (then `num_steps` and `steps_by_k` count
    that request's steps). Times, prompt/generation tokens and preemptions are engine-wide only
    (a step's time cannot be split between its requests): 0 in per-request counters."""

    num_steps: int = 0  # steps folded (engine) / request-steps folded (per request)
    num_spec_off_steps: int = 0  # of those, with speculation off (k=None)
    num_request_steps: int = 0  # request-steps folded, all k
    num_spec_request_steps: int = 0  # request-steps with speculation on (draft or skip)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    drafted_per_pos: tuple[int, ...] = ()
    steps_by_k: Mapping[int, int] = NO_COUNTS
    draft_skips: Mapping[str, int] = NO_COUNTS
    invalid_draft_tokens: Mapping[str, int] = NO_COUNTS
    draft_tokens_by_source: Mapping[str, int] = NO_COUNTS  # num_draft_tokens by source
    accepted_tokens_by_source: Mapping[str, int] = NO_COUNTS  # num_accepted_tokens by source
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    scheduler_seconds: float = 0.0
    num_tree_steps: int = 0  # engine steps that verified >= 1 token tree (engine-wide only)
    num_tree_drafts: int = 0  # request-steps whose drafts were a tree verified as one
    num_tree_nodes: int = 0  # nodes those trees verified (of num_draft_tokens)
    num_tree_accepted_tokens: int = 0  # drafts their walks accepted (of num_accepted_tokens)

    def __post_init__(self) -> None:
        acc, dra = self.accepted_per_pos, self.drafted_per_pos
        width = max(len(acc), len(dra))  # same length, trailing all-zero positions dropped
        while width and not any(v[width - 1] for v in (acc, dra) if len(v) >= width):
            width -= 1
        for name in _POS_FIELDS:
            object.__setattr__(self, name, _padded(getattr(self, name), width))
        for name in _MAP_FIELDS:
            if not isinstance(m := getattr(self, name), FrozenCounts):
                object.__setattr__(self, name, FrozenCounts(m))

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / valid draft tokens; None when nothing was drafted."""
        dt = self.num_draft_tokens
        return self.num_accepted_tokens / dt if dt else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (tokens per verified draft); None when there were no drafts."""
        nd = self.num_drafts
        return 1.0 + self.num_accepted_tokens / nd if nd else None

    @property
    def acceptance_rate_per_pos(self) -> tuple[float | None, ...]:
        """Conditional rate at position i: accepted_per_pos[i] / drafted_per_pos[i]."""
        pairs = zip(self.accepted_per_pos, self.drafted_per_pos)
        return tuple(a / d if d else None for a, d in pairs)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return _combine(self, other, 1)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return _combine(self, other, -1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready `spec` object (generate --json, API responses); steps_by_k keys are str."""
        out: dict[str, Any] = {n: getattr(self, n) for n in _DICT_FIELDS}
        out.update({n: list(getattr(self, n)) for n in _POS_FIELDS})
        out.update({n: {str(k): v for k, v in getattr(self, n).items()} for n in _MAP_FIELDS})
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["acceptance_rate_per_pos"] = list(self.acceptance_rate_per_pos)
        out.update({n: getattr(self, n) for n in _TREE_FIELDS})
        return out

    def check_identities(self) -> list[str]:
        """The violated identities, as readable strings; [] when the counters are consistent."""
        return _check_identities(self)


def _padded(vec: Iterable[int], width: int) -> tuple[int, ...]:
    t = tuple(vec)[:width]
    return t + (0,) * (width - len(t))


def _combine(a: SpecCounters, b: SpecCounters, sign: int) -> SpecCounters:
    kw: dict[str, Any] = {}
    for name in _INT_FIELDS + _FLOAT_FIELDS + _TREE_FIELDS:
        kw[name] = getattr(a, name) + sign * getattr(b, name)
    width = max(len(a.drafted_per_pos), len(b.drafted_per_pos))
    for name in _POS_FIELDS:
        va, vb = _padded(getattr(a, name), width), _padded(getattr(b, name), width)
        kw[name] = tuple(x + sign * y for x, y in zip(va, vb))
    for name in _MAP_FIELDS:
        ma, mb = getattr(a, name), getattr(b, name)
        kw[name] = {key: ma.get(key, 0) + sign * mb.get(key, 0) for key in {*ma, *mb}}
    return SpecCounters(**kw)


class _Builder:
    """Mutable working copy of an accumulator; the folds copy it, add to it, and freeze it."""

    def __init__(self, acc: SpecCounters) -> None:
        self.v: dict[str, Any] = {n: getattr(acc, n)
                                  for n in _INT_FIELDS + _FLOAT_FIELDS + _TREE_FIELDS}
        self.pos: dict[str, list[int]] = {n: list(getattr(acc, n)) for n in _POS_FIELDS}
        self.maps: dict[str, dict[Any, int]] = {n: dict(getattr(acc, n)) for n in _MAP_FIELDS}

    def bump(self, map_name: str, key: Any, amount: int = 1) -> None:
        m = self.maps[map_name]
        m[key] = m.get(key, 0) + amount

    def add_requests(self, requests: Iterable[RequestStepSpec], k: int | None) -> None:
        """Each request-step is counted once: a draft, a skip, or (k=None) neither."""
        n_req = n_spec = emitted = drafts = dtok = atok = 0
        # draft / accepted run length -> request-steps
        hist_d: dict[int, int] = {}
        hist_a: dict[int, int] = {}
        for r in requests:
            _check_against_k(r, k)
            n_req += 1
            emitted += r.num_emitted_tokens
            if k is None:
                continue
            n_spec += 1
            for reason, n in r.invalid_draft_tokens.items():
                self.bump("invalid_draft_tokens", reason, n)
            if (d := r.num_draft_tokens) == 0:
                self.bump("draft_skips", r.skip_reason or ALL_INVALID)
                continue
            a = r.num_accepted_tokens
            drafts, dtok, atok = drafts + 1, dtok + d, atok + a
            self._by_source(d, a, r.num_forced_tokens, r.drafts_by_source)
            if r.num_tree_nodes:
                self.v["num_tree_drafts"] += 1
                self.v["num_tree_nodes"] += r.num_tree_nodes
                self.v["num_tree_accepted_tokens"] += a
            hist_d[d] = hist_d.get(d, 0) + 1
            hist_a[a] = hist_a.get(a, 0) + 1
        for name, x in (("num_request_steps", n_req), ("num_spec_request_steps", n_spec),
                        ("num_emitted_tokens", emitted), ("num_drafts", drafts),
                        ("num_draft_tokens", dtok), ("num_accepted_tokens", atok)):  # fmt: skip
            self.v[name] += x
        self._add_runs("drafted_per_pos", hist_d)
        self._add_runs("accepted_per_pos", hist_a)

    def _by_source(self, d: int, a: int, forced: int,
                   labelled: tuple[tuple[str, int, int], ...] = ()) -> None:
        """Forced drafts lead the row: they are accepted first, the drafter's after them, under
        the drafter's own labels where it gives them (RequestStepSpec.drafts_by_source)."""
        own = labelled or ((DRAFTER_SOURCE, d - forced, max(0, a - forced)),)
        for source, n, got in ((GRAMMAR_SOURCE, forced, min(a, forced)), *own):
            if n:
                self.bump("draft_tokens_by_source", source, n)
                self.bump("accepted_tokens_by_source", source, got)

    def _add_runs(self, pos_name: str, hist: Mapping[int, int]) -> None:
        """A run of length L adds 1 to positions 0..L-1 (run lengths histogrammed)."""
        vec, width, running = self.pos[pos_name], max(hist, default=0), 0
        vec.extend([0] * (width - len(vec)))
        for i in range(width - 1, -1, -1):
            running += hist.get(i + 1, 0)
            vec[i] += running

    def count_step(self, k: int | None) -> None:
        self.v["num_steps"] += 1
        self.v["num_spec_off_steps"] += k is None
        if k is not None:
            self.bump("steps_by_k", k)

    def build(self) -> SpecCounters:
        fields: dict[str, Any] = {**self.v, **self.pos, **self.maps}  # __post_init__ freezes
        return SpecCounters(**fields)


def _check_against_k(req: RequestStepSpec, k: int | None) -> None:
    rid = req.request_id
    spec_fields = req.num_draft_tokens or req.invalid_draft_tokens or req.skip_reason is not None
    if k is None and spec_fields:
        raise ValueError(
            f"request {rid!r}: speculation is off (k=None) but the record carries drafts, invalid "
            "drafts or a skip_reason; use k=0 for a step whose schedule chose K=0"
        )
    if k is not None and req.num_draft_tokens > k:
        raise ValueError(f"request {rid!r}: {req.num_draft_tokens} valid draft tokens > K={k}")
    if k is not None and not spec_fields:
        raise ValueError(f"request {rid!r}: no valid draft at K={k} and no skip_reason")


def fold_request(acc: SpecCounters, req: RequestStepSpec, k: int | None) -> SpecCounters:
    """Fold one request's part of a step (the step's K `k`) into that request's counters."""
    return fold_request_history(acc, ((req, k),))


def fold_request_history(
    acc: SpecCounters, history: Iterable[tuple[RequestStepSpec, int | None]]
) -> SpecCounters:
    """Fold a request's (record, step K) pairs in one go: one copy of the accumulator, so an
    engine may keep the records and fold when the request finishes instead of every step."""
    b = _Builder(acc)
    for req, k in history:
        b.add_requests((req,), k)
        b.count_step(k)
    return b.build()


# Skip reasons that mean the request ran with K = 0 this step (the step's K, or the policy's
# choice for this request), as opposed to a drafter that found nothing to propose.
_K0_REASONS = frozenset({"schedule_zero", "adaptive"})


@dataclass(frozen=True)
class RequestSpecSummary:
    """One request's speculation, on its final output. Step times are engine-wide (a step's
    time cannot be split between its requests), so the counters' seconds stay 0 and the JSON
    leaves them out; ``num_spec_off_steps`` counts the request's steps without speculation *for
    it*: speculation off (k None) or K = 0 for it (its skip reason says the K, not the drafter)."""

    counters: SpecCounters
    lossless: bool  # False under --rejection-mode synthetic

    @staticmethod
    def of(history: Iterable[tuple[RequestStepSpec, int | None]],
           lossless: bool) -> RequestSpecSummary:
        history = list(history)
        off = sum(1 for req, k in history if k is None or req.skip_reason in _K0_REASONS)
        counters = replace(fold_request_history(SpecCounters(), history), num_spec_off_steps=off)
        return RequestSpecSummary(counters, lossless)

    def to_json(self) -> dict[str, Any]:
        out = self.counters.to_dict()
        for name in _FLOAT_FIELDS:
            out.pop(name)
        out["lossless"] = self.lossless
        return out


def fold_step(acc: SpecCounters, step: StepStats) -> SpecCounters:
    """Fold one engine step into the engine-wide counters. Pure; always returns a new value."""
    b = _Builder(acc)
    b.add_requests(step.requests, step.k)
    b.count_step(step.k)
    b.v["num_tree_steps"] += any(r.num_tree_nodes for r in step.requests)
    for name, step_name in _STEP_TOTALS:
        b.v[name] += getattr(step, step_name)
    return b.build()


def _check_identities(c: SpecCounters) -> list[str]:
    acc, dt, nd, rs = c.num_accepted_tokens, c.num_draft_tokens, c.num_drafts, c.num_request_steps
    first = c.drafted_per_pos[0] if c.drafted_per_pos else 0
    steps_k, skips = sum(c.steps_by_k.values()), sum(c.draft_skips.values())
    mal = c.mean_acceptance_length
    mal_ok = (mal is None) == (nd == 0) and (mal is None or math.isclose(mal, 1 + acc / nd))
    checks = [
        (acc <= dt, f"num_accepted_tokens {acc} > num_draft_tokens {dt}"),
        (sum(c.accepted_per_pos) == acc, f"sum(accepted_per_pos) != num_accepted_tokens {acc}"),
        (sum(c.drafted_per_pos) == dt, f"sum(drafted_per_pos) != num_draft_tokens {dt}"),
        (first == nd, f"drafted_per_pos[0] {first} != num_drafts {nd}"),
        (nd <= dt, f"num_drafts {nd} > num_draft_tokens {dt}"),
        (steps_k + c.num_spec_off_steps == c.num_steps, "sum(steps_by_k) + spec-off != steps"),
        (nd + skips == c.num_spec_request_steps, "drafts + skips != spec req-steps"),
        (c.num_spec_request_steps <= rs, "speculative request-steps > request-steps"),
        (c.num_emitted_tokens <= acc + rs, "emitted > accepted + 1 per request-step"),
        (mal_ok, f"mean_acceptance_length {mal} != 1 + accepted/drafts"),
        (c.num_tree_drafts <= nd, "tree drafts > drafts"),
        (c.num_tree_nodes <= dt, "tree nodes > draft tokens"),
        (c.num_tree_accepted_tokens <= min(acc, c.num_tree_nodes), "tree accepted > nodes"),
        (c.num_tree_steps <= c.num_steps, "tree steps > steps"),
        (not c.draft_tokens_by_source or sum(c.draft_tokens_by_source.values()) == dt,
         "sum(draft_tokens_by_source) != num_draft_tokens"),
        (not c.draft_tokens_by_source or sum(c.accepted_tokens_by_source.values()) == acc,
         "sum(accepted_tokens_by_source) != num_accepted_tokens"),
    ]  # fmt: skip
    return [msg for ok, msg in checks if not ok] + _per_pos_violations(c)


def _per_pos_violations(c: SpecCounters) -> list[str]:
    bad = [
        f"accepted_per_pos[{i}] {a} > drafted_per_pos[{i}] {d}"
        for i, (a, d) in enumerate(zip(c.accepted_per_pos, c.drafted_per_pos))
        if a > d
    ]
    for name in _POS_FIELDS:
        vec = getattr(c, name)
        if any(x < y for x, y in zip(vec, vec[1:])):
            bad.append(f"{name} increases with position: {list(vec)}")
    negative = [n for n in _INT_FIELDS + _FLOAT_FIELDS + _TREE_FIELDS if getattr(c, n) < 0]
    return bad + [f"{n} is negative" for n in negative]
