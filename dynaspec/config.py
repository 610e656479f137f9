"""Frozen configuration dataclasses, composed into one EngineConfig.

Components receive only the part they need; nothing mutates a config after start-up.
Values measured at start-up (KV pool size, EOS ids) live in runtime objects, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from dynaspec import registry as reg
from dynaspec.registry import Registry

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def opt(default: Any, help: str, *, flag: str | None = None, choices: Registry | None = None,
        type: type | None = None, cli: bool = True) -> Any:
    """A config field that is also an engine flag: its default and help text live only here
    (dynaspec/engine_flags.py turns them into argparse options). `flag` overrides the name
    derived from the field; a bool field is a switch (`--no-<name>` when it defaults to True)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                            "type": type, "cli": cli})


@dataclass(frozen=True)
class ModelConfig:
    model: str = opt("default", "HF folder, .gguf file, 'default' (SmolLM2-135M-Instruct) or "
                     "'gemma3-270m'")
    dtype: str = opt("auto", "activation dtype", choices=reg.DTYPES)
    device: str = opt("auto", "where the engine runs", choices=reg.DEVICES)
    max_model_len: int | None = opt(None, "context limit (None: the model's trained context; "
                                    "above it needs --allow-long-max-model-len)", type=int)
    allow_long_max_model_len: bool = opt(False, "accept a --max-model-len above the model's "
                                         "trained context (positions it never saw in training; "
                                         "output quality may suffer)")
    seed: int = opt(0, "engine seed", cli=False)  # the commands take their own --seed
    # Quantized weights run only on the CPU in bf16; auto falls back to none elsewhere.
    quantization: str = opt("auto", "weight format", choices=reg.QUANTIZATIONS)
    # int8dot is row-invariant, so batching and speculation cannot change a request's tokens.
    linear_kernel: str = opt("auto", "CPU kernel for quantized weights",
                             choices=reg.LINEAR_KERNELS)
    # The int kernels lose to oneDNN's bf16 GEMM on wide steps, hence the copy.
    quant_dense_above: int = opt(8, "torch linear kernel only: steps with more tokens use a bf16 "
                                 "copy of quantized weights (0 = no copy)")
    # oneDNN keeps native state per distinct row count: unbucketed, RSS grows with every new
    # step size (dynaspec/models/quant_linear.py).
    dense_row_buckets: bool = opt(
        True,
        "run the bf16 copy of quantized weights at the exact row "
        "count instead of rounding rows up to a few buckets (which "
        "bounds oneDNN's per-shape memory)",
        flag="--no-dense-row-buckets",
    )
    attention_backend: str = opt("auto", "attention kernel", choices=reg.ATTENTION_BACKENDS)

    def __post_init__(self) -> None:
        for registry, value in ((reg.DTYPES, self.dtype), (reg.DEVICES, self.device),
                                (reg.QUANTIZATIONS, self.quantization),
                                (reg.ATTENTION_BACKENDS, self.attention_backend),
                                (reg.LINEAR_KERNELS, self.linear_kernel)):
            registry.check(value)
        if self.quant_dense_above < 0:
            raise ValueError(f"quant_dense_above must be >= 0, got {self.quant_dense_above}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV block")
    kv_cache_memory_gb: float = opt(1.0, "KV pool budget in GiB")
    num_kv_blocks: int | None = opt(None, "fixed KV pool size in blocks (overrides the budget)",
                                    type=int)
    enable_prefix_caching: bool = opt(True, "disable prefix caching", flag="--no-prefix-caching")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = opt(2048, "token budget per step")
    max_num_seqs: int = opt(64, "most requests running at once")
    # engine/async_loop.py; the output is the same as without it.
    async_scheduling: bool = opt(False, "schedule the next step and finish the previous one's "
                                 "outputs while the current step's forward runs (same output)")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


EAGLE_DEFAULT_K = 3  # drafts per step the shipped EAGLE head was trained for
# The lookup drafters' cap when the user names no K: cheap to ask, so the cap only bounds the
# verify width; the goodput policy picks each step's K (0 included) under it from the width
# costs it measured at start. 8: the widest verify that still paid at concurrency 1 on the
# machines measured (verify(9) 1.5-1.6x a plain step: 9 tokens for the price of 1.6).
LOOKUP_DEFAULT_K = 8
# --speculator hybrid's lookup when --eagle-lookup names none: suffix decoding, as Arctic
# Inference pairs it with a model speculator.
HYBRID_DEFAULT_LOOKUP = "suffix"


def parse_rates(value: object) -> tuple[float, ...]:
    """Synthetic acceptance rates from "0.9" / "0.9,0.7" / 0.9 / [0.9, 0.7]; each in [0, 1]."""
    if value is None:
        return ()
    parts: list[Any]
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, (int, float)):
        parts = [value]
    else:
        parts = list(value)  # type: ignore[call-overload]  # a list or tuple; else list() says
    try:
        rates = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(
            f"synthetic acceptance must be rates like 0.9 or 0.9,0.7, got {value!r}"
        ) from None
    bad = [r for r in rates if not 0.0 <= r <= 1.0]
    if not rates or bad:
        raise ValueError(f"synthetic acceptance rates must be in [0, 1], got {value!r}")
    return rates


# What SpecConfig.draft_tree=None means: chains today; a later default of trees falls back to
# chains wherever trees cannot run instead of refusing the engine.
DRAFT_TREE_DEFAULT = False


@dataclass(frozen=True)
class SpecConfig:
    speculator: str = opt("none", "drafter", choices=reg.SPECULATORS)
    num_spec_tokens: int = opt(0, "maximum drafts per request per step (K); ngram/suffix "
                               "without it: 8, the goodput policy choosing each step's K")
    k_schedule: str | None = opt(None, "K schedule: JSON text or a JSON file", type=str)
    k_policy: str = opt("auto", "who picks K each step", choices=reg.K_POLICIES)
    draft_model: str | None = opt(None, "draft model (HF folder or .gguf) for --speculator draft",
                                  type=str)
    draft_head: str | None = opt(None, "EAGLE/EAGLE-3 head folder for --speculator eagle "
                                 "(default: the head shipped for --model default)", type=str)
    eagle_lookup: str = opt("none", "eagle: a lookup drafter tried first; the head drafts only "
                            "where it finds nothing (none | ngram | suffix); hybrid: the "
                            "lookup in the head's tree (default suffix)", type=str)
    prompt_lookup_min: int = opt(2, "shortest n-gram to match")
    prompt_lookup_max: int = opt(5, "longest n-gram to match")
    # Suffix decoding, with vLLM's meanings and defaults (suffix_decoding_*):
    # spec_decode/drafters/suffix.py.
    suffix_max_depth: int = opt(24, "suffix: longest match + draft length")
    suffix_spec_factor: float = opt(1.0, "suffix: drafts <= factor x match length")
    suffix_min_token_prob: float = opt(0.1, "suffix: stop drafting before a token whose "
                                       "estimated probability is below this")
    suffix_cache_max_requests: int = opt(10000, "suffix: outputs kept in the global cache, least "
                                         "recently used evicted (0 = off)")
    suffix_cache_max_tokens: int = opt(1_000_000, "suffix: tokens kept in the global cache")
    # Token trees (docs/design.md §4c): the request's draft budget becomes a node budget.
    # None: not asked either way, DRAFT_TREE_DEFAULT applies, and a model or attention backend
    # that cannot verify trees falls back to chains; an explicit True there is refused
    # (dynaspec/engine/tree_setting.py).
    draft_tree: bool | None = opt(None, "ngram/suffix draft token trees (several continuations, "
                                  "verified in one step) instead of chains (not given: "
                                  "chains)", type=bool)
    # Structured output: the tokens a request's grammar forces are drafts before the drafter's
    # (spec_decode/drafters/grammar_draft.py); off for A/B runs against lookup drafts alone.
    grammar_drafts: bool = opt(True, "structured output: do not draft the tokens the grammar "
                               "forces before the drafter's own (lookup drafts alone, for A/B)",
                               flag="--no-grammar-drafts")
    # The replay oracle's input (spec_decode/drafters/oracle.py); a dict is its JSON object.
    oracle_recording: str | dict | None = opt(
        None, "oracle: the target's recorded outputs it replays, a JSON file or text "
        '({"requests": [{"prompt": [ids], "output": [ids]}]}); bench and tests only', type=str)
    rejection_mode: str = opt("strict", "verification", choices=reg.REJECTION_MODES)
    # Per-position conditional rates; the last applies to every later position.
    synthetic_acceptance: str | float | tuple[float, ...] | None = opt(
        None, "synthetic mode: per-position conditional acceptance RATE[,RATE...]; the last "
        "repeats", type=str)
    # Injected instead of measured: JSON text, a path, or a dict ({"batches", "contexts",
    # "widths", "seconds"[b][c][w], optional "draft_seconds_per_token"}). Served steps do not
    # change it, so the policy's decisions depend on the table alone (deterministic tests).
    cost_table: str | dict | None = opt(None, "goodput: a fixed step cost table (JSON file or "
                                        "text) instead of the measured one", type=str)
    reprofile_costs: bool = opt(False, "ignore cached step-cost cells and measure afresh",
                                cli=False)  # `dynaspec tune --reprofile`

    def __post_init__(self) -> None:
        reg.SPECULATORS.check(self.speculator)
        reg.K_POLICIES.check(self.k_policy)
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        if self.speculator == "eagle" and self.num_spec_tokens == 0 and self.k_schedule is None:
            # The depth the shipped head was trained to draft, when the user names no K.
            object.__setattr__(self, "num_spec_tokens", EAGLE_DEFAULT_K)
        if self.speculator == "hybrid" and self.eagle_lookup == "none":
            object.__setattr__(self, "eagle_lookup", HYBRID_DEFAULT_LOOKUP)
        if (self.speculator in ("ngram", "suffix", "hybrid") and self.num_spec_tokens == 0
                and self.k_schedule is None):
            object.__setattr__(self, "num_spec_tokens", LOOKUP_DEFAULT_K)
        if self.speculator != "none" and self.num_spec_tokens == 0 and self.k_schedule is None:
            raise ValueError(f"--speculator {self.speculator} needs --num-spec-tokens K >= 1")
        if self.eagle_lookup not in ("none", "ngram", "suffix"):
            raise ValueError(
                f"eagle_lookup must be none, ngram or suffix, got {self.eagle_lookup!r}"
            )
        if self.eagle_lookup != "none" and self.speculator not in ("eagle", "hybrid"):
            raise ValueError("--eagle-lookup applies to --speculator eagle or hybrid only, got "
                             f"--speculator {self.speculator}")
        if self.speculator == "draft" and not self.draft_model:
            raise ValueError("--speculator draft needs --draft-model PATH")
        if (self.speculator == "oracle") != (self.oracle_recording is not None):
            raise ValueError("--speculator oracle needs --oracle-recording, which applies to it "
                             f"only (got --speculator {self.speculator})")
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
            raise ValueError(
                f"suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}"
            )
        if self.suffix_cache_max_requests < 0:
            raise ValueError(
                f"suffix_cache_max_requests must be >= 0, got {self.suffix_cache_max_requests}"
            )
        if self.suffix_cache_max_tokens < 1:
            raise ValueError(
                f"suffix_cache_max_tokens must be >= 1, got {self.suffix_cache_max_tokens}"
            )

    def _check_rejection_mode(self) -> None:
        reg.REJECTION_MODES.check(self.rejection_mode)
        rates = parse_rates(self.synthetic_acceptance)  # validates the format either way
        if self.rejection_mode == "synthetic":
            if not rates:
                raise ValueError(
                    "--rejection-mode synthetic needs --synthetic-acceptance RATE[,RATE...]"
                )
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
    structured_output_backend: str = opt("xgrammar", "grammar library for structured output",
                                         choices=reg.STRUCTURED_BACKENDS)
    # Compact JSON by default: a small model cannot loop on newlines inside an object.
    structured_any_whitespace: bool = opt(False, "JSON grammars allow any whitespace (default: "
                                          "compact)")

    def __post_init__(self) -> None:
        reg.STRUCTURED_BACKENDS.check(self.structured_output_backend)


@dataclass(frozen=True)
class ExecutionConfig:
    """How decode/verify steps run (docs/design.md §6): the fixed-shape path is torch.compile
    on the CPU and CUDA graphs on CUDA."""

    execution: str = opt("auto", "decode/verify path", choices=reg.EXECUTIONS)
    admission: str | None = opt(None, "admission JSON from `dynaspec bench admission` (default: "
                                "next to a --k-schedule file)", type=str)
    compile_budget_s: float = opt(900.0, "total seconds spent compiling/capturing shapes; later "
                                  "shapes run eager")
    precompile: bool = opt(False, "build every compiled/graph shape at start-up instead of on "
                           "first use")
    # aot_eager traces and runs the same fixed-shape graph without code generation: fast to
    # build, so tests use it.
    compile_backend: str = opt("inductor", "torch.compile backend for --execution compiled on "
                               "the CPU (inductor; aot_eager for tests)")

    def __post_init__(self) -> None:
        reg.EXECUTIONS.check(self.execution)
        if self.compile_budget_s < 0:
            raise ValueError(f"compile_budget_s must be >= 0, got {self.compile_budget_s}")


@dataclass(frozen=True)
class ObservabilityConfig:
    log_stats_interval_s: float = opt(0.0, "seconds between metric log lines (0 = off)",
                                      flag="--log-stats-interval")


@dataclass(frozen=True)
class ParallelConfig:
    """Data parallelism (docs/design.md §7; dynaspec/dp/): ranks are processes joined by
    torch.distributed."""

    data_parallel_size: int = opt(1, "engine ranks (processes), each with its own model, KV pool "
                                  "and scheduler; one K per step")
    dp_local_size: int | None = opt(None, "ranks this machine starts (default: all)", type=int)
    dp_rank_start: int = opt(0, "first rank this machine starts")
    dp_master_addr: str | None = opt(None, "rendezvous host (default MASTER_ADDR or 127.0.0.1)",
                                     type=str)
    dp_master_port: int | None = opt(None, "rendezvous port; the control channel uses port+1 "
                                     "(default MASTER_PORT or a free port)", type=int)
    dp_rank_timeout_s: float = opt(10.0, "seconds past the longest step after which a silent "
                                   "rank is declared stuck", flag="--dp-rank-timeout")
    # 1 s: five missed beats (one every 0.2 s), so a stopped rank is named, killed and its
    # survivors re-grouped within the 3 s gap bound of §7d; a rank busy in a long step keeps
    # beating (its heartbeat thread needs the GIL only briefly).
    dp_heartbeat_timeout_s: float = opt(1.0, "seconds without a rank's heartbeat (sent every "
                                        "0.2 s by a thread of its own) after which it is "
                                        "declared stopped and killed; 0 = off",
                                        flag="--dp-heartbeat-timeout")
    num_threads: int | None = opt(None, "torch threads per rank (default: cores / local ranks)",
                                  type=int)
    # The HTTP process then only validates, streams and frames; the step never waits on its GIL.
    engine_process: bool = opt(False, "run the engine core in its own process (a data-parallel "
                               "front end with one rank), as vLLM does")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        local = self.data_parallel_size if self.dp_local_size is None else self.dp_local_size
        if not 0 <= local <= self.data_parallel_size:
            raise ValueError(
                f"dp_local_size must be in [0, {self.data_parallel_size}], got {local}"
            )
        if not 0 <= self.dp_rank_start <= self.data_parallel_size - local:
            raise ValueError(f"dp_rank_start {self.dp_rank_start} + dp_local_size {local} exceeds "
                             f"data_parallel_size {self.data_parallel_size}")
        if self.dp_master_port is not None and not 0 < self.dp_master_port < 65535:
            raise ValueError(f"dp_master_port must be in 1..65534, got {self.dp_master_port}")
        if not self.dp_rank_timeout_s > 0:
            raise ValueError(f"dp_rank_timeout_s must be > 0, got {self.dp_rank_timeout_s}")
        if not self.dp_heartbeat_timeout_s >= 0:
            raise ValueError("dp_heartbeat_timeout_s must be >= 0 (0 = off), got "
                             f"{self.dp_heartbeat_timeout_s}")
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
        # Trees compose with async scheduling and data parallelism (docs/design.md §4c, §7b):
        # a tree's node budget is its row's draft cap, so holds, recaps and the agreed width
        # treat it as a chain of that many drafts. Only the drafter limits trees.
        if self.spec.draft_tree and self.spec.speculator not in ("ngram", "suffix", "hybrid"):
            raise ValueError(f"--draft-tree needs --speculator ngram or suffix, got "
                             f"{self.spec.speculator!r} (or hybrid: the EAGLE head and a lookup "
                             "in one tree)")

    @staticmethod
    def parts() -> dict[str, type[DataclassInstance]]:
        """Each part's name and config class, in flag order."""
        # Every field's default_factory is its config class (typeshed: a factory or MISSING).
        return {f.name: f.default_factory for f in fields(EngineConfig)}  # type: ignore[misc]

    @staticmethod
    def from_kwargs(**kwargs) -> EngineConfig:
        """Build from flat engine args (as the CLI and LLM() take them); unknown names are
        errors."""
        parts = EngineConfig.parts()
        values: dict[str, dict] = {name: {} for name in parts}
        for key, value in kwargs.items():
            owner = next((n for n, cls in parts.items() if key in cls.__dataclass_fields__), None)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            values[owner][key] = value
        configs: dict[str, Any] = {n: cls(**values[n]) for n, cls in parts.items()}
        return EngineConfig(**configs)


def default_num_threads() -> int:
    return max(
        1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )


def server_num_threads() -> int:
    """Torch threads of a `dynaspec serve` engine: every core but one, which the HTTP loop, the
    SSE streams and detokenization need (vLLM's CPU backend also leaves cores to its front end).
    An OpenMP team that shares its cores with them loses its barriers to preemption: on 2 cores
    under an aiperf c16 load, one engine thread gave 1.63x the output tokens of two
    (docs/history/benchmarks-waves-1-4.md, eighth session)."""
    return max(1, default_num_threads() - 1)
