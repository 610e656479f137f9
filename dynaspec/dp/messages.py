"""What crosses the control channel between the front end and a rank: dataclasses only.

Front end -> rank: AddRequest, AbortRequest, Query, Wake, Stop, Regroup.
Rank -> front end: Hello, RankReady, TickReport once per engine step, Reply, RankFailed,
GroupLost, Joined, and Heartbeat from a thread of its own (dp/heartbeat.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynaspec.config import EngineConfig
from dynaspec.engine.client import PoolReport
from dynaspec.metrics.records import EngineSnapshot, FinishedRequestTimes, StepStats
from dynaspec.metrics.stats import RequestSpecSummary
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
    joining: bool = False  # a replacement: it waits for a Regroup instead of forming group 0


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


# ---- control messages (front end -> rank) -------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Query:
    """Ask a rank for a fact (``decisions``, ``counters``, ``kv``, ``integrity``, ``pid``)."""

    qid: int
    name: str


@dataclass(frozen=True)
class Wake:
    """An idle rank waits on its pipe: a request added elsewhere makes it tick now."""


@dataclass(frozen=True)
class Stop:
    """Leave the step loop (every rank leaves on the same tick)."""


@dataclass(frozen=True)
class Regroup:
    """Move to a new group (dp/group.py). ``agree``: the current group is whole (a replacement
    joins), so the members move together after the tick where every one of them has this;
    else a member was lost and the old group cannot complete an exchange: move now."""

    epoch: int
    members: tuple[int, ...]
    agree: bool


# ---- rank -> front end (besides RankReady and TickReport) ---------------------------------------
@dataclass(frozen=True)
class Hello:
    rank: int


@dataclass(frozen=True)
class Reply:
    qid: int
    rank: int
    value: Any  # the answer, or the exception the query raised


@dataclass(frozen=True)
class RankFailed:
    rank: int
    reason: str
    victim: bool  # its step exchange failed: a peer is the culprit, not this rank


@dataclass(frozen=True)
class GroupLost:
    """This rank's step exchange (or a group's forming) failed: it is alive, keeps its requests,
    and waits for a Regroup."""

    rank: int
    epoch: int
    reason: str


@dataclass(frozen=True)
class Joined:
    """This rank steps in group ``epoch`` from now on."""

    rank: int
    epoch: int


@dataclass(frozen=True)
class Heartbeat:
    """Sent every fraction of a second by a rank's heartbeat thread, outside the step loop: it
    stops only when the whole process does (SIGSTOP, a machine gone), not during a long step."""

    rank: int
