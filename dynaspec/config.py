"""Frozen configuration dataclasses, composed into one EngineConfig.

Components receive only the part they need; nothing mutates a config after start-up.
Values measured at start-up (KV pool size, EOS ids) live in runtime objects, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_DTYPES = ("bfloat16", "float32", "float16", "auto")
_QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str  # "llama" | "qwen2" | "qwen3" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3 scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None means plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma-3)
    # Gemma-3: local layers attend to the last `sliding_window` positions; layer i is global iff
    # (i + 1) % sliding_window_pattern == 0 (0: every layer global). Local layers use RoPE base
    # rope_local_theta; rope_scaling applies to the global layers only.
    sliding_window: int | None = None
    sliding_window_pattern: int = 0
    rope_local_theta: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def layer_window(self, i: int) -> int | None:
        """The attention window of layer i (None: the whole context)."""
        if self.sliding_window is None or (self.sliding_window_pattern
                                           and (i + 1) % self.sliding_window_pattern == 0):
            return None
        return self.sliding_window


@dataclass(frozen=True)
class ModelConfig:
    model: str = "default"
    dtype: str = "auto"  # auto = bf16 on CPU, bf16 on CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    max_model_len: int | None = None  # None = the model's own limit
    allow_long_max_model_len: bool = False  # max_model_len above the trained context
    seed: int = 0
    # auto: a GGUF's Q4_0/Q4_1/Q8_0 weights run as int4/int8 weight-only kernels, HF weights as
    # they are; int8/int4: HF weights quantized at load too; none: everything dequantized
    # (the reference path). Only on the CPU in bf16; auto falls back to none elsewhere.
    quantization: str = "auto"
    # Quantized weights' CPU kernel: int8dot (dynaspec's int8 dot products for every row count:
    # flat in width and row-invariant, so batching and speculation cannot change a request's
    # tokens), torch (torch's int4/int8 weight-only kernels plus a bf16 copy for wide steps),
    # auto = int8dot where the C++ kernels build here, else torch.
    linear_kernel: str = "auto"
    # torch kernel only: steps with more tokens than this run a bf16 copy of the quantized
    # weights (the int kernels lose to oneDNN's bf16 GEMM on wide steps); 0 keeps no copy.
    quant_dense_above: int = 8
    # The bf16 copy runs with its rows rounded up to a few buckets (dynaspec/models/quant_linear.py):
    # oneDNN keeps native state per distinct row count, so unbucketed, RSS grows with every new
    # step size. False runs the exact row count.
    dense_row_buckets: bool = True
    # auto: the in-place C++ paged kernel on the CPU when it builds here (else eager); eager:
    # gather + SDPA (the reference); cpu_paged: the kernel, an error if it cannot be built.
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: choose auto, cpu or cuda")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}: choose one of {', '.join(_QUANTIZATIONS)}")
        if self.attention_backend not in ("auto", "eager", "cpu_paged"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}: choose auto, eager or cpu_paged")
        if self.linear_kernel not in ("auto", "int8dot", "torch"):
            raise ValueError(f"unknown linear_kernel {self.linear_kernel!r}: choose auto, int8dot or torch")
        if self.quant_dense_above < 0:
            raise ValueError(f"quant_dense_above must be >= 0, got {self.quant_dense_above}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides the memory budget for controlled experiments
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Form step N+1 and finish step N-1's outputs while step N's forward runs on a worker
    # thread (DESIGN §7b; engine/async_loop.py). Output is the same as without it.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


_SPECULATORS = ("none", "ngram", "draft", "suffix", "eagle")
_REJECTION_MODES = ("strict", "synthetic")


def parse_rates(value: object) -> tuple[float, ...]:
    """Synthetic acceptance rates from "0.9" / "0.9,0.7" / 0.9 / [0.9, 0.7]; each in [0, 1]."""
    if value is None:
        return ()
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, (int, float)):
        parts = [value]
    else:
        parts = list(value)  # type: ignore[call-overload]
    try:
        rates = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"synthetic acceptance must be rates like 0.9 or 0.9,0.7, got {value!r}") from None
    bad = [r for r in rates if not 0.0 <= r <= 1.0]
    if not rates or bad:
        raise ValueError(f"synthetic acceptance rates must be in [0, 1], got {value!r}")
    return rates


@dataclass(frozen=True)
class SpecConfig:
    speculator: str = "none"  # none | ngram | draft | suffix | eagle
    num_spec_tokens: int = 0
    k_schedule: str | None = None  # JSON text or a path to a JSON file
    k_policy: str = "auto"  # auto (= goodput with a drafter) | goodput | table | adaptive
    draft_model: str | None = None
    # EAGLE/EAGLE-3 head folder (config.json + weights) for --speculator eagle; None: the head
    # shipped for the default model.
    draft_head: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Suffix decoding, with vLLM's meanings and defaults (suffix_decoding_*); see spec_decode/suffix.py.
    suffix_max_depth: int = 24  # match length + draft length
    suffix_spec_factor: float = 1.0  # drafts <= factor * match length
    suffix_min_token_prob: float = 0.1  # stop before a token less likely than this
    suffix_cache_max_requests: int = 10000  # outputs in the global cache; 0 = no global cache
    suffix_cache_max_tokens: int = 1_000_000  # tokens in the global cache
    # strict = lossless verification; synthetic = accept drafts at `synthetic_acceptance`
    # (per-position conditional rates; the last applies to every later position). NOT lossless.
    rejection_mode: str = "strict"
    synthetic_acceptance: str | float | tuple[float, ...] | None = None
    # The goodput policy's step cost table, injected instead of measured: JSON text, a path to
    # a JSON file, or a dict ({"batches", "contexts", "widths", "seconds"[b][c][w], optional
    # "draft_seconds_per_token"}). Fixed: served steps do not change it, so the policy's
    # decisions depend on the table alone (tests run the default policy deterministically).
    cost_table: str | dict | None = None
    # Ignore cached step-cost cells and measure afresh (``dynaspec tune --reprofile``).
    reprofile_costs: bool = False

    def __post_init__(self) -> None:
        if self.speculator not in _SPECULATORS:
            raise ValueError(f"unknown speculator {self.speculator!r}: choose {', '.join(_SPECULATORS)}")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        if self.speculator == "eagle" and self.num_spec_tokens == 0 and self.k_schedule is None:
            from dynaspec.spec_decode.eagle import DEFAULT_K  # the depth the shipped head learned
            object.__setattr__(self, "num_spec_tokens", DEFAULT_K)
        if self.speculator != "none" and self.num_spec_tokens == 0 and self.k_schedule is None:
            raise ValueError(f"--speculator {self.speculator} needs --num-spec-tokens K >= 1")
        if self.speculator == "draft" and not self.draft_model:
            raise ValueError("--speculator draft needs --draft-model PATH")
        if self.k_policy not in ("auto", "goodput", "table", "adaptive"):
            raise ValueError(f"unknown k_policy {self.k_policy!r}: choose auto, goodput, table or adaptive")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}..{self.prompt_lookup_max}"
            )
        self._check_suffix()
        self._check_rejection_mode()

    def _check_suffix(self) -> None:
        if self.suffix_max_depth < 3:
            raise ValueError(f"suffix_max_depth must be >= 3, got {self.suffix_max_depth}")
        if not self.suffix_spec_factor > 0:
            raise ValueError(f"suffix_spec_factor must be > 0, got {self.suffix_spec_factor}")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError(f"suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}")
        if self.suffix_cache_max_requests < 0:
            raise ValueError(f"suffix_cache_max_requests must be >= 0, got {self.suffix_cache_max_requests}")
        if self.suffix_cache_max_tokens < 1:
            raise ValueError(f"suffix_cache_max_tokens must be >= 1, got {self.suffix_cache_max_tokens}")

    def _check_rejection_mode(self) -> None:
        if self.rejection_mode not in _REJECTION_MODES:
            raise ValueError(f"unknown rejection_mode {self.rejection_mode!r}: choose strict or synthetic")
        rates = parse_rates(self.synthetic_acceptance)  # validates the format either way
        if self.rejection_mode == "synthetic":
            if not rates:
                raise ValueError("--rejection-mode synthetic needs --synthetic-acceptance RATE[,RATE...]")
            if self.speculator == "none":
                raise ValueError("--rejection-mode synthetic needs a --speculator to draft tokens")
        elif rates:
            raise ValueError("--synthetic-acceptance only applies with --rejection-mode synthetic")

    @property
    def acceptance_rates(self) -> tuple[float, ...]:
        return parse_rates(self.synthetic_acceptance)

    @property
    def lossless(self) -> bool:
        """False when verification does not follow the target (synthetic mode)."""
        return self.rejection_mode == "strict"


@dataclass(frozen=True)
class StructuredOutputConfig:
    structured_output_backend: str = "xgrammar"
    # False: JSON grammars emit compact JSON (", " and ": " separators, no free whitespace), so a
    # small model cannot loop on newlines inside an object; True allows any JSON whitespace.
    structured_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.structured_output_backend != "xgrammar":
            raise ValueError(f"unknown structured_output_backend {self.structured_output_backend!r}:"
                             " choose xgrammar")


@dataclass(frozen=True)
class ExecutionConfig:
    """How decode/verify steps run (DESIGN §6): `eager` never compiles; `compiled` runs every
    shape of the grid on the fixed-shape path (torch.compile on CPU, CUDA graphs on CUDA);
    `auto` runs compiled only where the admission table measured it faster (else eager)."""

    execution: str = "auto"  # eager | compiled | auto
    admission: str | None = None  # admission JSON; default: next to a --k-schedule file
    compile_budget_s: float = 900.0  # total build seconds; shapes past it run eager
    precompile: bool = False  # build every fixed-shape grid shape at start-up, not on first use
    # torch.compile backend on the CPU: inductor (the real path); aot_eager traces and runs the
    # same fixed-shape graph without code generation (fast to build; used by tests).
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        if self.execution not in ("eager", "compiled", "auto"):
            raise ValueError(f"unknown execution {self.execution!r}: choose eager, compiled or auto")
        if self.compile_budget_s < 0:
            raise ValueError(f"compile_budget_s must be >= 0, got {self.compile_budget_s}")


@dataclass(frozen=True)
class ObservabilityConfig:
    log_stats_interval_s: float = 0.0  # 0 = no periodic log line


@dataclass(frozen=True)
class ParallelConfig:
    """Data parallelism (DESIGN §7; dynaspec/dp/). Ranks are processes joined by torch.distributed."""

    data_parallel_size: int = 1  # ranks in all
    dp_local_size: int | None = None  # ranks this machine starts (None: all of them)
    dp_rank_start: int = 0  # first rank this machine starts
    dp_master_addr: str | None = None  # rendezvous host (None: MASTER_ADDR, else 127.0.0.1)
    dp_master_port: int | None = None  # rendezvous port (None: MASTER_PORT, else a free port)
    dp_rank_timeout_s: float = 10.0  # a rank is declared stuck this long past the longest step
    num_threads: int | None = None  # torch threads (None: this process's cores / local ranks)

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        local = self.data_parallel_size if self.dp_local_size is None else self.dp_local_size
        if not 0 <= local <= self.data_parallel_size:
            raise ValueError(f"dp_local_size must be in [0, {self.data_parallel_size}], got {local}")
        if not 0 <= self.dp_rank_start <= self.data_parallel_size - local:
            raise ValueError(f"dp_rank_start {self.dp_rank_start} + dp_local_size {local} exceeds "
                             f"data_parallel_size {self.data_parallel_size}")
        if self.dp_master_port is not None and not 0 < self.dp_master_port < 65535:
            raise ValueError(f"dp_master_port must be in 1..65534, got {self.dp_master_port}")
        if not self.dp_rank_timeout_s > 0:
            raise ValueError(f"dp_rank_timeout_s must be > 0, got {self.dp_rank_timeout_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.scheduler.async_scheduling and self.parallel.data_parallel_size > 1:
            # DP ranks step in lockstep on one K decision per step; the async pipeline forms a
            # step before the previous one lands, which that agreement does not cover yet.
            raise ValueError("--async-scheduling cannot be combined with --data-parallel-size > 1")

    @staticmethod
    def from_kwargs(**kwargs) -> "EngineConfig":
        """Build from flat engine args (as the CLI and LLM() take them); unknown names are errors."""
        parts = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "spec": SpecConfig,
            "observability": ObservabilityConfig,
            "structured": StructuredOutputConfig,
            "execution": ExecutionConfig,
            "parallel": ParallelConfig,
        }
        values: dict[str, dict] = {name: {} for name in parts}
        for key, value in kwargs.items():
            owner = next((n for n, cls in parts.items() if key in cls.__dataclass_fields__), None)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            values[owner][key] = value
        return EngineConfig(**{n: cls(**values[n]) for n, cls in parts.items()})


def default_num_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
