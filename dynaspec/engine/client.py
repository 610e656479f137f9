"""The engine client protocol: everything a front (the HTTP server, the async wrapper, the
periodic log line) may ask of an engine, implemented by `LLMEngine` and by the data-parallel
front end (`dp.front_end.DPEngine`), and the dataclasses that cross it.

A front needs nothing else: no scheduler, KV manager or step timer of the engine, so the
data-parallel front end has none to fake, and an engine in another process can implement it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from dynaspec.metrics.records import EngineSnapshot, FinishedRequestTimes, StepStats
from dynaspec.metrics.stats import SpecCounters
from dynaspec.outputs import RequestOutput
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.base import DrafterCacheStats


class EngineUnavailable(RuntimeError):
    """The engine is shutting down or has stopped (the API answers 503)."""


@dataclass(frozen=True, kw_only=True)
class PoolReport:
    """The KV pools the engine sized at start-up (per rank under data parallelism)."""

    num_blocks: int
    block_size: int
    num_tokens: int  # the target's pool
    drafter_num_tokens: int  # a draft model's own pool; 0 for drafters without KV
    drafter_cache: DrafterCacheStats | None = None  # the suffix drafter's global cache

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class ModelCard:
    """What `/v1/models` publishes about the engine besides the model's name."""

    max_model_len: int
    vocab_size: int
    spec_plan: dict  # SpecPlan.to_json()
    k_policy: dict | None  # PolicyInfo.to_json(); None without a drafter
    lossless: bool
    execution_plan: dict  # ExecutionPlan.to_json()
    block_size: int
    prefix_caching: bool

    def to_json(self) -> dict:
        return {"spec_plan": self.spec_plan, "k_policy": self.k_policy,
                "lossless": self.lossless, "execution_plan": self.execution_plan}


@dataclass(frozen=True, kw_only=True)
class EngineState:
    """Queue and pool occupancy at one instant (`/health`)."""

    num_running: int
    num_waiting: int
    kv_num_blocks: int
    kv_free_blocks: int
    kv_usage: float

    def to_json(self) -> dict:
        return {**asdict(self), "num_unfinished": self.num_running + self.num_waiting}


@runtime_checkable
class EngineClient(Protocol):
    """Called from one thread at a time (the async wrapper's engine thread)."""

    tokenizer: Any
    max_model_len: int

    @property
    def counters(self) -> SpecCounters:
        """Speculation totals since start (the log line's deltas)."""
        ...

    @property
    def log_stats_interval_s(self) -> float: ...

    def model_card(self) -> ModelCard: ...

    def compile_grammar(self, spec: Any) -> None:
        """Compile (and cache) a structured-output grammar; ValueError names what is wrong.
        Safe from any thread: the engine thread later finds it compiled."""
        ...

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue; ValueError names what is wrong."""
        ...

    def abort_request(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def progress(self) -> int:
        """A count that moves whenever a step did work (even one that returned no output: a
        prefill chunk, an async launch), so a driver can tell idle from busy."""
        ...

    def failure(self) -> str | None:
        """Why the engine cannot serve (a data-parallel rank is gone); None when healthy."""
        ...

    def state(self) -> EngineState: ...

    def snapshot(self) -> EngineSnapshot: ...

    def pool_report(self) -> PoolReport: ...

    def take_finished_times(self) -> list[FinishedRequestTimes]:
        """Latencies of requests finished since the last call (each handed out once)."""
        ...

    def take_step(self) -> StepStats | None:
        """The latest step's record if not handed out before (the Prometheus step feed)."""
        ...

    def shutdown(self) -> None: ...
