"""What the runner reports back (RunnerOutput, RequestResult) and what the engine returns
(RequestOutput); the plan that goes in is `step_plan.StepPlan`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynaspec.draft_tree import TreeWalk
from dynaspec.metrics.stats import RequestSpecSummary
from dynaspec.step_plan import BatchDescriptor


@dataclass(frozen=True, kw_only=True)
class RequestResult:
    """One scheduled request's outcome of a step, built once by `worker/verify.py`."""

    request_id: str
    token_ids: tuple[int, ...]  # accepted drafts + one recovered/bonus token; () for a prefill
    num_draft_tokens: int = 0  # valid drafts verified
    num_accepted_tokens: int = 0
    skip_reason: str | None = None  # set on a sampling step that verified no draft
    logprobs: list[Any] | None = None  # per emitted token: (logprob, top [(id, logprob)])
    num_padding_tokens: int = 0  # -1 pads verified (invalid, reason "padding")
    num_grammar_invalid_tokens: int = 0  # drafts cut before verification (invalid, "grammar")
    grammar_terminated: bool = False  # the request's grammar accepted its stop: finish "stop"
    # No token of the vocabulary continues the grammar (it needs a character no token spells):
    # the request alone finishes with an error; the sampled token was dropped.
    grammar_dead_end: bool = False
    num_async_invalid_tokens: int = 0  # budgeted slots invalid under async ("async_placeholder")
    drafts_from_fallback: bool = False  # its drafts came from the drafter's fallback (a head)
    num_forced_tokens: int = 0  # of its valid drafts, the first ones its grammar forced (§4d)
    # (source, drafts verified, accepted) for a drafter that labels its drafts (the hybrid's
    # "eagle" / "ngram" / "suffix"); (): all of them its drafter's
    drafts_by_source: tuple[tuple[str, int, int], ...] = ()
    num_tree_nodes: int = 0  # its drafts were a tree of this many nodes (0: a chain)
    tree_depth: int = 0  # ... whose longest root path had this many nodes
    tree_path: tuple[int, ...] | None = None  # the accepted nodes of its tree (runner-internal)
    tree_walk: TreeWalk | None = None  # ... and the walk down it, for the K policy


@dataclass(frozen=True, kw_only=True)
class RunnerOutput:
    results: tuple[RequestResult, ...]  # in StepPlan.scheduled order
    prepare_seconds: float = 0.0
    draft_seconds: float = 0.0
    # Of draft_seconds, the drafter's once-per-request work (an EAGLE head's prefill of a
    # prompt): the policy's per-token drafting cost leaves it out.
    draft_setup_seconds: float = 0.0
    draft_fallback_seconds: float = 0.0  # of draft_seconds, a fallback drafter's (setup excluded)
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    grammar_seconds: float = 0.0  # structured output: draft checks, bitmasks, masking
    grammar_rows: int = 0  # logits rows masked by a grammar
    batch: BatchDescriptor | None = None  # the descriptor the step ran (path "eager" on a fallback)
    # The widest sampling row the forward verified (1 + drafts, pads included): the fixed path's
    # width, or on the eager path the longest row the plan's caps and the drafter produced. Laid
    # out before the forward; the cost model prices the step at this width.
    verified_width: int = 1


@dataclass(frozen=True)
class RequestTimings:
    """One finished request's latencies (seconds from its arrival)."""

    ttft_s: float | None  # None if it never produced a token
    e2e_s: float
    inter_token_s: tuple[float, ...]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    new_token_ids: list[int]  # emitted this step
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[Any] | None = None
    spec: RequestSpecSummary | None = None  # on the final output, when speculation is on
    timings: RequestTimings | None = None  # on the final output
