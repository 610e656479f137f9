"""One step of grammar work: check drafts, mask the target's logits, advance the grammar state.

For a request with drafts d_0..d_{n-1}, logits row j verifies d_j (row n is the bonus row). Row j
must be masked with the grammar state after the accepted output plus d_0..d_{j-1}, exactly the
state non-speculative decoding would be in at that position, so constrained greedy output with
speculation equals constrained greedy output without it. `add` walks the drafts through the
matcher: at position j it fills row j's bitmask, and stops at the first draft that mask rejects
(the rest are cut and counted `invalid{grammar}`; `add` returns how many it keeps and `cuts`
collects them, so the step's rows take the drafts up to there and nothing edits a draft list).
Drafts reach `add` unpadded: on a fixed-shape step the rows are padded to the planned width after
the cut, and `mask` leaves the pad rows past the first one unmasked (their logits are never
sampled). The matcher then holds the
state after the valid drafts; `commit` rolls back the drafts the verifier rejected and accepts
the one recovered/bonus token, so the state only ever covers accepted output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dynaspec.structured.backend import GrammarBackend, Matcher, allocate_bitmask, is_allowed


@dataclass(frozen=True)
class GrammarCommit:
    """A request's grammar after its step: the tokens it keeps, and how it ended."""

    token_ids: tuple[int, ...]  # the step's tokens, cut after an accepted stop or a dead end
    terminated: bool  # the grammar accepted its stop: finish "stop"
    dead_end: bool  # no token continues the grammar: the request alone ends with an error
    num_invalid: int  # drafts cut before verification ("grammar")


@dataclass
class _Entry:
    index: int  # position in StepPlan.scheduled
    request_id: str
    matcher: Matcher
    num_fed: int  # valid drafts the matcher advanced over
    num_invalid: int  # drafts cut by the grammar
    bitmask: torch.Tensor  # [len(drafts) + 1, words] int32


class GrammarStep:
    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend
        self.entries: dict[int, _Entry] = {}
        self.seconds = 0.0  # bitmask filling, draft checks, masking and state updates
        self.num_rows = 0

    @property
    def cuts(self) -> dict[str, int]:
        """Request id -> the drafts it keeps, for each request whose drafts the grammar cut."""
        return {e.request_id: e.num_fed for e in self.entries.values() if e.num_invalid}

    def add(self, index: int, request_id: str, m: Matcher, drafts: Sequence[int]) -> int:
        """Walk the request's drafts through its matcher, filling one bitmask row per position;
        returns how many of them it keeps (the rest are cut)."""
        t0 = time.perf_counter()
        d = drafts
        bitmask = allocate_bitmask(len(d) + 1, self.backend.vocab_size)  # [n + 1, words]
        fed = 0
        for j in range(len(d) + 1):
            if m.is_terminated():  # after an accepted stop token nothing more is allowed
                break
            m.fill_bitmask(bitmask, j)
            if j == len(d) or not is_allowed(bitmask, j, d[j]):
                break
            if not m.accept(d[j]):
                raise RuntimeError(f"grammar matcher refused draft {d[j]} its own bitmask allowed")
            fed += 1
        invalid = len(d) - fed
        if invalid:
            bitmask = bitmask[: fed + 1]
        self.entries[index] = _Entry(index, request_id, m, fed, invalid, bitmask)
        self.seconds += time.perf_counter() - t0
        return fed

    def mask(self, logits: torch.Tensor, sampling: list[tuple[int, int]]) -> None:
        """Mask grammar rows of `logits` [R, vocab] in place; `sampling` is the runner's row
        layout: per sampling request in order, (scheduled index, drafts verified, pads
        included). Rows past a row's checked drafts + 1 are pads' rows: left unmasked."""
        t0 = time.perf_counter()
        rows: list[int] = []
        spans: list[tuple[int, torch.Tensor]] = []
        start = 0
        for i, n in sampling:
            e = self.entries.get(i)
            if e is not None:
                checked = e.bitmask.shape[0]  # valid drafts + 1
                if checked > n + 1:
                    raise RuntimeError(f"request {e.request_id!r}: {n} drafts verified but the "
                                       f"grammar checked {checked - 1}")
                rows.extend(range(start, start + checked))
                spans.append((start, e.bitmask))
            start += n + 1
        if len(rows) == logits.shape[0]:  # every row is constrained: no gather needed
            self.backend.apply_bitmask(logits, torch.cat([b for _, b in spans]), None)
        elif rows:
            full = allocate_bitmask(logits.shape[0], self.backend.vocab_size)  # [R, words]
            for at, b in spans:
                full[at: at + b.shape[0]] = b
            self.backend.apply_bitmask(logits, full, rows)
        self.num_rows += len(rows)
        self.seconds += time.perf_counter() - t0

    def _dead_end(self, matcher: Matcher) -> bool:
        """No token continues the grammar from the matcher's state (a grammar that needs a
        character no token spells, e.g. one of the control characters a vocabulary lacks)."""
        mask = allocate_bitmask(1, self.backend.vocab_size)
        matcher.fill_bitmask(mask, 0)
        return not bool(mask.any())

    def commit(self, index: int, tokens: list[int], num_accepted: int) -> GrammarCommit | None:
        """Advance the grammar of the request at `index` (None if it has none) over the step's
        tokens (accepted drafts, then the recovered/bonus token); what it kept and why."""
        e = self.entries.get(index)
        if e is None or not tokens:
            return None
        t0 = time.perf_counter()
        a, dead_end = num_accepted, False
        e.matcher.rollback(e.num_fed - a)  # the state after the accepted drafts
        if e.matcher.is_terminated():  # an accepted draft was the stop token: drop the bonus
            tokens = tokens[:a]
        elif not e.matcher.accept(tokens[a]):
            if not self._dead_end(e.matcher):
                raise RuntimeError(f"request {e.request_id!r}: sampled token "
                                   f"{tokens[a]} is outside its grammar mask")
            # Every token was masked: the sample is noise. This request alone ends.
            tokens, dead_end = tokens[:a], True
        self.seconds += time.perf_counter() - t0
        return GrammarCommit(tuple(tokens), e.matcher.is_terminated(), dead_end, e.num_invalid)
