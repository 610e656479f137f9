"""The replay oracle (docs/design.md §8): a drafter that proposes the target's own continuation,
recorded in an earlier plain run, so what speculation could gain is measured on this machine,
through the same K policy, trees, verification and kernels as every other drafter.

Bench and tests only: it needs the outputs of the very prompts it serves, which no real traffic
has, and the server refuses it (server/api_server.py). `bench compare --oracle` and `bench
matrix` record a plain pass and hand it over as `--oracle-recording`.

Rule: for a request whose prompt is in the recording and whose output so far is a prefix of the
recorded output, the draft is the next k recorded tokens; anything else (an unknown prompt, an
output that left the recording, the recording's end) drafts nothing. Under greedy decoding the
drafts are then always accepted and the output is the plain one; when sampling, the recording is
one sample, followed until the request's own samples leave it. The draft is always a chain: a
perfect drafter's best tree is its chain, so an oracle arm measuring a `--draft-tree` arm's
ceiling runs as a chain drafter of the same K (config.py keeps trees to ngram and suffix).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dynaspec.config import EngineConfig
from dynaspec.request import Request
from dynaspec.spec_decode.drafters.base import Drafts, Proposer, deterministic_drafts
from dynaspec.spec_decode.drafters.drafters import DrafterBuild, DrafterTarget


@dataclass(frozen=True)
class Recording:
    """Prompt token ids -> the output token ids the target produced for it."""

    outputs: Mapping[tuple[int, ...], tuple[int, ...]]

    @staticmethod
    def of(pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> Recording:
        """From (prompt ids, output ids) pairs; a prompt given twice keeps its last output."""
        return Recording({tuple(p): tuple(o) for p, o in pairs})

    def to_json(self) -> dict:
        return {"requests": [{"prompt": list(p), "output": list(o)}
                             for p, o in self.outputs.items()]}

    @staticmethod
    def from_json(obj: object) -> Recording:
        """From {"requests": [{"prompt": [ids], "output": [ids]}, ...]}."""
        reqs = obj.get("requests") if isinstance(obj, dict) else None
        if not isinstance(reqs, list):
            raise ValueError('an oracle recording is {"requests": [{"prompt": [ids], "output": '
                             f'[ids]}}, ...]}}, got {type(obj).__name__}')
        pairs = []
        for i, r in enumerate(reqs):
            if not (isinstance(r, dict) and _ids(r.get("prompt")) and _ids(r.get("output"))):
                raise ValueError(f"oracle recording request {i}: needs 'prompt' and 'output' "
                                 "lists of token ids")
            pairs.append((r["prompt"], r["output"]))
        return Recording.of(pairs)


def _ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and t >= 0 for t in x)


def load_recording(source: str | dict | Recording) -> Recording:
    """A recording from a Recording, its JSON object, JSON text, or a JSON file's path."""
    if isinstance(source, Recording):
        return source
    if isinstance(source, str):
        if os.path.exists(source):
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        else:
            text = source
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"--oracle-recording {source[:80]!r}: neither a JSON file nor JSON "
                             "text") from None
        return Recording.from_json(obj)
    return Recording.from_json(source)


@dataclass
class _Follow:
    """How far a request's output has followed its recording."""

    prompt_ref: list[int]  # identity: a new Request under an old id starts afresh
    recorded: tuple[int, ...]
    matched: int = 0  # output tokens checked equal to the recording
    left: bool = False  # the output left the recording: outputs only grow, so for good


class OracleProposer(Proposer):
    """Drafts each request's recorded continuation; deterministic (probs None)."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._follows: dict[str, _Follow] = {}

    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int], *,
                fallback_k: Sequence[int] | None = None,
                trees: Sequence[bool] | None = None) -> Drafts:
        return deterministic_drafts(requests, k_per_request, self._draft_one,
                                    [False] * len(requests))

    def _draft_one(self, request: Request, k: int, tree: bool) -> list[int]:
        f = self._follow(request)
        if f.left:
            return []
        n = len(request.output_token_ids)
        return list(f.recorded[n:n + k])

    def _follow(self, request: Request) -> _Follow:
        """The request's follow state, brought up to its output so far (only new tokens are
        compared: O(new) per step)."""
        f = self._follows.get(request.request_id)
        out = request.output_token_ids
        if f is None or f.prompt_ref is not request.prompt_token_ids or f.matched > len(out):
            recorded = self.recording.outputs.get(tuple(request.prompt_token_ids))
            # An unknown prompt is remembered as left, so its lookup is not repeated each step.
            f = _Follow(request.prompt_token_ids, recorded or (), left=recorded is None)
            self._follows[request.request_id] = f
        if not f.left and f.matched < len(out):
            new = out[f.matched:]
            f.left = tuple(new) != f.recorded[f.matched:len(out)]
            f.matched = len(out)
        return f

    def forget(self, request_id: str) -> None:
        self._follows.pop(request_id, None)

    def preempt(self, request_id: str) -> None:
        self.forget(request_id)

    def num_cached(self) -> int:
        return len(self._follows)


def build_oracle(config: EngineConfig, target: DrafterTarget) -> DrafterBuild:
    """The registry's factory for `--speculator oracle` (config.spec.oracle_recording)."""
    source = config.spec.oracle_recording
    if source is None:
        raise ValueError("--speculator oracle needs --oracle-recording (a JSON file of the "
                         "target's recorded outputs)")
    return DrafterBuild(OracleProposer(load_recording(source)))
