"""A request as the scheduler sees it: tokens, how many are computed, its status and counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dynaspec.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # NOTE: counts tokens whose KV is written; catches up with num_tokens (+ drafts) step by step.
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0  # prefix-cache hit at first schedule
    num_preemptions: int = 0
    first_token_time: float | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why a FINISHED_ERROR request failed (it alone, not its step)
    # Async scheduling: tokens the step in flight may still append (1 + its drafts), counted
    # in num_tokens until its result lands, so the next step is formed for the longest outcome.
    num_placeholders: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole context (hot path)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p: end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]
