"""Per-request sampling settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from dynaspec.structured_params import StructuredOutputParams

_GREEDY_BELOW = 1e-5  # temperatures below this are greedy
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
    # Logits processing (sample/logits_processor.py), applied at every verified position.
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL-style, over prompt + output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are out
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # sequences never generated (last id banned)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < _GREEDY_BELOW:
            # As vLLM: logits / 1e-40 overflow to +-inf and the softmax to NaN (found by the
            # reliability fuzz); such a temperature is greedy for every practical purpose.
            object.__setattr__(self, "temperature", 0.0)
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
        self._check_logits_processing()
        so = self.structured_output
        if so is not None and not isinstance(so, StructuredOutputParams):
            raise ValueError("structured_output must be a StructuredOutputParams, got "
                             f"{type(so).__name__}")

    def _check_logits_processing(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        object.__setattr__(
            self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias)
        )
        object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in self.bad_words_ids))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        # Bounded below: a tiny penalty divides logits into +inf (found by schemathesis).
        if not 0.01 <= self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in [0.01, 2], got "
                             f"{self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(t < 0 for t, _ in self.logit_bias):
            raise ValueError("logit_bias token ids must be >= 0")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if any(not w or min(w) < 0 for w in self.bad_words_ids):
            raise ValueError("bad_words_ids must be non-empty sequences of token ids >= 0")

    @property
    def processes_logits(self) -> bool:
        """True when the logits need the per-position step of sample/logits_processor.py."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.bad_words_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
