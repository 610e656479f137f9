"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from dynaspec.structured.params import StructuredOutputParams


_MAX_TOP_K = 2**31 - 1  # above any vocabulary; bounded so it fits the sampler's int64 tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = chosen only)
    structured_output: StructuredOutputParams | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        # Bounds checked here, not where tensors are built: an out-of-range value there fails
        # the whole step, every other request in it included (found by bench reliability fuzz).
        if not -1 <= self.top_k <= _MAX_TOP_K:
            raise ValueError(f"top_k must be -1, 0 (off) or in [1, {_MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        so = self.structured_output
        if so is not None and not isinstance(so, StructuredOutputParams):
            raise ValueError("structured_output must be a StructuredOutputParams, got "
                             f"{type(so).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
