"""`--rejection-mode synthetic`: drafts accepted at given per-position rates, NOT lossless.

A benchmarking aid kept apart from the rejection sampler (which is lossless by contract): it
measures what a drafter with a chosen acceptance profile would gain, on the real forward shapes.
Output is marked not lossless wherever it is reported.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.rejection_sampler import validate_inputs
from dynaspec.sample.sampler import Sampler

log = logging.getLogger("dynaspec")


class SyntheticVerifier:
    """`--rejection-mode synthetic`: accept drafts by given rates instead of by the target.

    For benchmarking cost models and K schedules with any acceptance profile, whatever the
    drafter. The target forward runs as usual (so step times are real); then, per request,
    draft j (0-based) is accepted with probability rates[min(j, len(rates) - 1)] given that
    drafts 0..j-1 were accepted (conditional rates), until the first rejection. A -1 pad or an
    id outside the vocabulary is always rejected. The request emits the accepted drafts and then
    the target's own token at the first rejected position (argmax when greedy, a sample from
    the target's processed distribution otherwise), or the bonus token when all were accepted,
    so the text stays a valid continuation of what was emitted. It is NOT the target's greedy
    output: responses say ``"lossless": false``.

    Draws come from a per-request numpy generator seeded by (seed, crc32(request id)), so one
    request's acceptance does not depend on what shares its batch, and a run is reproducible.

    Drafts are cut before their first stop token (`cut`, applied by the runner before the
    verify forward, so the cut positions are never counted as drafted): a drafter's EOS accepted
    by a coin flip would end requests early and shrink the very run being measured.
    """

    def __init__(
        self, rates: Sequence[float], seed: int, stop_token_ids: Sequence[int] = ()
    ) -> None:
        rates = tuple(float(r) for r in rates)
        if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"synthetic acceptance rates must be in [0, 1], got {list(rates)}")
        self.rates = np.asarray(rates, dtype=np.float64)
        self.seed = seed
        self.sampler = Sampler()
        self.stop_token_ids = frozenset(stop_token_ids)
        self._rngs: dict[str, np.random.Generator] = {}

    def cut(self, drafts: list[int]) -> list[int]:
        """The draft up to (not including) its first stop token."""
        for i, t in enumerate(drafts):
            if t in self.stop_token_ids:
                return drafts[:i]
        return drafts

    def forget(self, request_id: str) -> None:
        self._rngs.pop(request_id, None)

    def _rng(self, request_id: str) -> np.random.Generator:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = np.random.default_rng([self.seed, zlib.crc32(request_id.encode())])
            self._rngs[request_id] = rng
        return rng

    def num_accepted(self, request_id: str, drafts: Sequence[int], vocab: int) -> int:
        n = len(drafts)
        if n == 0:
            return 0
        u = self._rng(request_id).random(n)  # [n]
        rate = self.rates[np.minimum(np.arange(n), len(self.rates) - 1)]  # [n]
        ids = np.asarray(drafts, dtype=np.int64)
        ok = (u < rate) & (ids >= 0) & (ids < vocab)  # [n]
        return int(n if ok.all() else np.argmin(ok))

    def __call__(
        self,
        target_logits: torch.Tensor,  # [num_rows, vocab]
        num_draft: list[int],
        draft_token_ids: list[list[int]],
        md: SamplingMetadata,
        request_ids: Sequence[str],
    ) -> list[list[int]]:
        """Per request: accepted drafts + the target's token at the first rejected position."""
        validate_inputs(target_logits, num_draft, draft_token_ids, None, md)
        vocab = target_logits.shape[1]
        accepted = [
            self.num_accepted(rid, ids, vocab) for rid, ids in zip(request_ids, draft_token_ids)
        ]
        starts = np.cumsum([0] + [n + 1 for n in num_draft[:-1]])
        rows = torch.tensor([int(s) + a for s, a in zip(starts, accepted)], dtype=torch.long,
                            device=target_logits.device)  # [R]
        final = self.sampler(target_logits[rows], md).token_ids.tolist()  # [R]
        return [ids[:a] + [t] for ids, a, t in zip(draft_token_ids, accepted, final)]


def make_synthetic_verifier(mode: str, rates: Sequence[float], seed: int,
                            stop_token_ids: Sequence[int] = ()) -> SyntheticVerifier | None:
    """None for strict (lossless) verification; logs loudly when the mode is synthetic."""
    if mode == "strict":
        return None
    if mode != "synthetic":
        raise ValueError(f"unknown rejection mode {mode!r}: choose strict or synthetic")
    verifier = SyntheticVerifier(rates, seed, stop_token_ids)
    log.warning("rejection mode SYNTHETIC: drafts are accepted at rates %s, not by the target; "
                "output is NOT lossless (responses carry \"lossless\": false)", list(rates))
    return verifier
