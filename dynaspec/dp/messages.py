"""What crosses the control channel between the front end and a rank (only dataclasses and tuples).

Front end -> rank: ("add", request_id, prompt_ids, SamplingParams), ("abort", request_id),
("query", query_id, name), ("wake",), ("stop",).
Rank -> front end: ("hello", rank), RankReady, TickReport once per engine step,
("reply", query_id, rank, value), ("failed", rank, message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynaspec.config import EngineConfig
from dynaspec.engine.client import PoolReport
from dynaspec.metrics.stats import (EngineSnapshot, FinishedRequestTimes, RequestSpecSummary,
                                    StepStats)
from dynaspec.outputs import RequestTimings


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start (pickled to it)."""

    config: EngineConfig
    rank: int
    world_size: int
    store_addr: str
    store_port: int
    control_addr: str
    control_port: int
    authkey: bytes
    start_timeout_s: float = 600.0  # loading weights and profiling on a busy machine


@dataclass
class RankReady:
    rank: int
    tokenizer: Any  # rank 0 only (the front end tokenizes and validates prompts)
    max_model_len: int
    vocab_size: int
    plan: Any
    model_name: str
    pool: PoolReport
    pid: int
    host: str
    exec_plan: Any = None  # ExecutionPlan (the same on every rank: same config)
    lossless: bool = True
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankOutput:
    """One request's progress on a rank after one step: only what is new, plus the text."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    new_logprobs: list | None
    num_cached_tokens: int
    spec: RequestSpecSummary | None
    timings: RequestTimings | None = None


@dataclass
class TickReport:
    rank: int
    tick: int
    outputs: list[RankOutput]
    step: StepStats | None  # the engine step this tick ran, None for a dummy step
    snapshot: EngineSnapshot
    finished_times: list[FinishedRequestTimes]
    kv_free_blocks: int
    kv_num_blocks: int
