"""Frozen configuration dataclasses, composed into one EngineConfig.

Components receive only the part they need; nothing mutates a config after start-up.
Values measured at start-up (KV pool size, EOS ids) live in runtime objects, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_DTYPES = ("bfloat16", "float32", "float16", "auto")


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
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
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)


@dataclass(frozen=True)
class ModelConfig:
    model: str = "default"
    dtype: str = "auto"  # auto = bf16 on CPU, bf16 on CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    max_model_len: int | None = None  # None = the model's own limit
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: choose auto, cpu or cuda")
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

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class SpecConfig:
    speculator: str = "none"  # none | ngram | draft
    num_spec_tokens: int = 0
    k_schedule: str | None = None  # JSON text or a path to a JSON file
    k_policy: str = "auto"  # auto (= goodput with a drafter) | goodput | table | adaptive
    draft_model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if self.speculator not in ("none", "ngram", "draft"):
            raise ValueError(f"unknown speculator {self.speculator!r}: choose none, ngram or draft")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @staticmethod
    def from_kwargs(**kwargs) -> "EngineConfig":
        """Build from flat engine args (as the CLI and LLM() take them); unknown names are errors."""
        parts = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "spec": SpecConfig,
            "observability": ObservabilityConfig,
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
