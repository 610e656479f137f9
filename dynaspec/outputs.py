"""The dataclasses that cross the step's layer boundaries: schedule -> execute -> update."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynaspec.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # prompt/output tokens computed this step (drafts not included)
    draft_budget: int  # drafts this request may verify this step (0 = none)
    skip_reason: str | None  # why draft_budget is 0 on a sampling step (None when it may draft)
    block_table: list[int]
    # Set when the step's BatchDescriptor is on a fixed-shape path: the runner pads this
    # request's drafts to width-1 with -1 (invalid "padding", never drafts).
    pad_drafts: bool = False
    num_lookahead: int = 0  # KV slots reserved past the new tokens (an upper bound on drafts)
    # Async scheduling: budgeted draft slots found invalid once the previous step's tokens were
    # known (its caps dropped); they go down the invalid-draft channel ("async_placeholder").
    num_async_invalid: int = 0

    @property
    def sampling(self) -> bool:
        """The chunk reaches the request's last token, so this step emits a token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(frozen=True)
class BatchDescriptor:
    """Shape and path of one step's target forward, planned by `schedule()` before it runs
    (DESIGN §6). On a fixed-shape path ("compiled", "cuda_graph") every request verifies exactly
    `width` tokens and rows are padded to `num_reqs_padded`; on "eager" the step is ragged and
    `width` is the planned verify width (1+K) of a decode-only step (None: mixed prefill+decode),
    `num_tokens_padded` an upper bound on its tokens."""

    path: str  # "eager" | "compiled" | "cuda_graph"
    num_reqs_padded: int
    width: int | None
    num_tokens_padded: int

    @property
    def fixed_shape(self) -> bool:
        return self.path != "eager"

    @property
    def width_label(self) -> str:
        return "mixed" if self.width is None else str(self.width)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    step_k: int | None  # the step's K from the plan; None when speculation is off
    num_batched_tokens: int  # without drafts
    preempted_ids: list[str] = field(default_factory=list)
    schedule_seconds: float = 0.0
    batch: BatchDescriptor | None = None  # set by schedule(); None only for hand-built outputs

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)


@dataclass
class RequestResult:
    request_id: str
    token_ids: list[int]  # accepted drafts + one recovered/bonus token; [] for a partial prefill
    num_draft_tokens: int  # valid drafts verified
    num_accepted_tokens: int
    skip_reason: str | None  # set on a sampling step that verified no draft
    logprobs: list[Any] | None = None  # per emitted token: (logprob, top [(id, logprob)])
    num_padding_tokens: int = 0  # -1 pads verified (invalid, reason "padding")
    num_grammar_invalid_tokens: int = 0  # drafts cut before verification (invalid, "grammar")
    grammar_terminated: bool = False  # the request's grammar accepted its stop: finish "stop"
    # No token of the vocabulary continues the grammar (it needs a character no token spells):
    # the request alone finishes with an error; the sampled token was dropped.
    grammar_dead_end: bool = False
    num_async_invalid_tokens: int = 0  # budgeted slots invalid under async ("async_placeholder")


@dataclass
class RunnerOutput:
    results: list[RequestResult]  # in SchedulerOutput.scheduled order
    prepare_seconds: float = 0.0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    batch: BatchDescriptor | None = None
    grammar_seconds: float = 0.0  # structured output: draft checks, bitmasks, masking
    grammar_rows: int = 0  # logits rows masked by a grammar
    batch: BatchDescriptor | None = None  # the descriptor the step ran (path "eager" on a fallback)


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
    spec: dict | None = None  # per-request speculation counters (metrics issue field names)
    metrics: dict = field(default_factory=dict)  # ttft_s, e2e_s, ...
