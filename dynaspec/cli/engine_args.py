"""Engine and speculation flags shared by every subcommand that starts an engine."""

from __future__ import annotations

import argparse

# flag -> (engine arg name, type, default, help)
_FLAGS = [
    ("--model", "model", str, "default", "HF folder, .gguf file, or 'default' (SmolLM2-135M-Instruct)"),
    ("--dtype", "dtype", str, "auto", "auto (bf16), bfloat16, float32, float16"),
    ("--device", "device", str, "auto", "auto (cuda if available), cpu, cuda"),
    ("--quantization", "quantization", str, "auto",
     "auto (keep a GGUF's Q4_0/Q4_1/Q8_0 as int4/int8), none (dequantize: reference), int8, int4"),
    ("--linear-kernel", "linear_kernel", str, "auto",
     "auto (int8dot where the C++ kernels build), int8dot (int8 dot products, flat in width, "
     "row-invariant), torch (torch's int4/int8 kernels + bf16 copy for wide steps)"),
    ("--quant-dense-above", "quant_dense_above", int, 8,
     "torch linear kernel only: steps with more tokens use a bf16 copy of quantized weights (0 = no copy)"),
    ("--attention-backend", "attention_backend", str, "auto",
     "auto (in-place CPU kernel when it builds, else eager), eager, cpu_paged"),
    ("--max-model-len", "max_model_len", int, None,
     "context limit (None: the model's trained context; above it needs "
     "--allow-long-max-model-len)"),
    ("--kv-cache-memory-gb", "kv_cache_memory_gb", float, 1.0, "KV pool budget in GiB"),
    ("--num-kv-blocks", "num_kv_blocks", int, None, "fixed KV pool size in blocks (overrides the budget)"),
    ("--block-size", "block_size", int, 16, "tokens per KV block"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, 2048, "token budget per step"),
    ("--max-num-seqs", "max_num_seqs", int, 64, "most requests running at once"),
    ("--speculator", "speculator", str, "none", "none, ngram, draft, suffix or eagle"),
    ("--num-spec-tokens", "num_spec_tokens", int, 0, "maximum drafts per request per step (K)"),
    ("--k-schedule", "k_schedule", str, None, "K schedule: JSON text or a JSON file"),
    ("--k-policy", "k_policy", str, "auto",
     "auto (table when --k-schedule is given, else goodput), goodput (cost model measured "
     "here; a schedule is its ceiling), table, adaptive"),
    ("--cost-table", "cost_table", str, None,
     "goodput: a fixed step cost table (JSON file or text) instead of the measured one"),
    ("--draft-model", "draft_model", str, None, "draft model (HF folder or .gguf) for --speculator draft"),
    ("--draft-head", "draft_head", str, None,
     "EAGLE/EAGLE-3 head folder for --speculator eagle (default: the head shipped for --model default)"),
    ("--prompt-lookup-min", "prompt_lookup_min", int, 2, "shortest n-gram to match"),
    ("--prompt-lookup-max", "prompt_lookup_max", int, 5, "longest n-gram to match"),
    ("--suffix-max-depth", "suffix_max_depth", int, 24, "suffix: longest match + draft length"),
    ("--suffix-spec-factor", "suffix_spec_factor", float, 1.0, "suffix: drafts <= factor x match length"),
    ("--suffix-min-token-prob", "suffix_min_token_prob", float, 0.1,
     "suffix: stop drafting before a token whose estimated probability is below this"),
    ("--suffix-cache-max-requests", "suffix_cache_max_requests", int, 10000,
     "suffix: outputs kept in the global cache, least recently used evicted (0 = off)"),
    ("--suffix-cache-max-tokens", "suffix_cache_max_tokens", int, 1_000_000,
     "suffix: tokens kept in the global cache"),
    ("--rejection-mode", "rejection_mode", str, "strict",
     "strict (lossless) or synthetic (accept drafts at --synthetic-acceptance; NOT lossless)"),
    ("--synthetic-acceptance", "synthetic_acceptance", str, None,
     "synthetic mode: per-position conditional acceptance RATE[,RATE...]; the last repeats"),
    ("--execution", "execution", str, "auto",
     "decode/verify path: eager, compiled (torch.compile / CUDA graphs) or auto (compiled where "
     "the admission table measured it faster)"),
    ("--admission", "admission", str, None, "admission JSON from `dynaspec bench admission` "
     "(default: next to a --k-schedule file)"),
    ("--compile-budget-s", "compile_budget_s", float, 900.0,
     "total seconds spent compiling/capturing shapes; later shapes run eager"),
    ("--compile-backend", "compile_backend", str, "inductor",
     "torch.compile backend for --execution compiled on the CPU (inductor; aot_eager for tests)"),
    ("--log-stats-interval", "log_stats_interval_s", float, 0.0, "seconds between metric log lines (0 = off)"),
    ("--structured-output-backend", "structured_output_backend", str, "xgrammar", "grammar library for structured output"),
    ("--data-parallel-size", "data_parallel_size", int, 1,
     "engine ranks (processes), each with its own model, KV pool and scheduler; one K per step"),
    ("--dp-local-size", "dp_local_size", int, None, "ranks this machine starts (default: all)"),
    ("--dp-rank-start", "dp_rank_start", int, 0, "first rank this machine starts"),
    ("--dp-master-addr", "dp_master_addr", str, None, "rendezvous host (default MASTER_ADDR or 127.0.0.1)"),
    ("--dp-master-port", "dp_master_port", int, None,
     "rendezvous port; the control channel uses port+1 (default MASTER_PORT or a free port)"),
    ("--dp-rank-timeout", "dp_rank_timeout_s", float, 10.0,
     "seconds past the longest step after which a silent rank is declared stuck"),
    ("--num-threads", "num_threads", int, None, "torch threads per rank (default: cores / local ranks)"),
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    for flag, dest, typ, default, help_ in _FLAGS:
        g.add_argument(flag, dest=dest, type=typ, default=default, help=help_)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="disable prefix caching")
    g.add_argument("--no-dense-row-buckets", dest="dense_row_buckets", action="store_false",
                   help="run the bf16 copy of quantized weights at the exact row count instead of "
                   "rounding rows up to a few buckets (which bounds oneDNN's per-shape memory)")
    g.add_argument("--allow-long-max-model-len", dest="allow_long_max_model_len",
                   action="store_true", help="accept a --max-model-len above the model's trained "
                   "context (positions it never saw in training; output quality may suffer)")
    g.add_argument("--structured-any-whitespace", dest="structured_any_whitespace",
                   action="store_true", help="JSON grammars allow any whitespace (default: compact)")
    g.add_argument("--precompile", action="store_true",
                   help="build every compiled/graph shape at start-up instead of on first use")
    g.add_argument("--async-scheduling", dest="async_scheduling", action="store_true",
                   help="schedule the next step and finish the previous one's outputs while "
                   "the current step's forward runs (same output)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = {dest: getattr(args, dest) for _, dest, *_ in _FLAGS}
    kw["enable_prefix_caching"] = args.enable_prefix_caching
    kw["dense_row_buckets"] = args.dense_row_buckets
    kw["structured_any_whitespace"] = args.structured_any_whitespace
    kw["allow_long_max_model_len"] = args.allow_long_max_model_len
    kw["precompile"] = args.precompile
    kw["async_scheduling"] = args.async_scheduling
    return kw


def parse_engine_args(argv: list[str]) -> dict:
    """Engine kwargs from a flag string's tokens (used by `bench compare --a "..."`)."""
    p = argparse.ArgumentParser(prog="engine-args", add_help=False)
    add_engine_args(p)
    return engine_kwargs(p.parse_args(argv))
