"""Start-up: resolve device and dtype, load weights, size the KV pool, build the SpecPlan and parts."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
import torch

from dynaspec.config import EngineConfig, default_num_threads
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.models.gemma3 import create_model
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_model_files
from dynaspec.sample.rejection_sampler import make_synthetic_verifier
from dynaspec.models.quant_linear import WeightPlan, cpu_info, linear_kernel_summary, resolve_quantization
from dynaspec.scheduler.scheduler import Scheduler
from dynaspec.spec_decode import cost_cache
from dynaspec.spec_decode.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.eagle import EagleProposer
from dynaspec.spec_decode.k_policy import KPolicy, make_policy, resolve_policy_name
from dynaspec.spec_decode.plan import SpecPlan, build_spec_plan, plan_for_policy
from dynaspec.structured.manager import StructuredOutputManager
from dynaspec.worker.compiled import make_executor
from dynaspec.worker.execution_plan import AdmissionTable, ExecutionPlan, default_admission_path
from dynaspec.worker.input_buffers import InputBuffers
from dynaspec.worker.model_runner import ModelRunner

log = logging.getLogger("dynaspec")


@dataclass
class EngineParts:
    tokenizer: object
    plan: SpecPlan
    exec_plan: ExecutionPlan
    model: LlamaModel
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    vocab_size: int
    drafter_kv_tokens: int
    eos_token_ids: tuple[int, ...]
    model_name: str
    structured: StructuredOutputManager
    policy_info: "PolicyInfo | None" = None


@dataclass(frozen=True)
class PolicyInfo:
    """The K policy that runs, as the start-up log, /v1/models and /metrics name it."""

    name: str  # table | adaptive | goodput
    requested: str  # the --k-policy value (auto resolves by whether a schedule was given)
    table_source: str | None = None  # goodput: injected | cached | measured at start-up
    cache_file: str | None = None
    note: str | None = None  # e.g. why goodput fell back to the table

    def to_json(self) -> dict:
        return {"name": self.name, "requested": self.requested, "cost_table": self.table_source,
                "cache_file": self.cache_file, "note": self.note}

    def describe(self) -> str:
        text = f"K policy: {self.name}"
        if self.requested != self.name:
            text += f" (--k-policy {self.requested})"
        if self.table_source is not None:
            text += f"; step cost table {self.table_source}"
        if self.cache_file:
            text += f", cache file {self.cache_file}"
        return text + (f"; {self.note}" if self.note else "")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    return {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float16": torch.float16}[name]


def _release_load_memory() -> None:
    """Hand the loader's freed float32/uint8 intermediates back to the OS (glibc keeps freed
    heap pages otherwise: measured here, ~120 MB of resident memory for the default model)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def resolve_attention(name: str, device: torch.device):
    """The target model's attention backend; auto prefers the in-place CPU kernel."""
    from dynaspec.attention.backend import get_backend

    if name == "auto":
        if device.type != "cpu":
            return get_backend("eager")
        from dynaspec.attention.cpu_paged import available

        ok, why = available()
        if not ok:
            log.info("attention: eager (the in-place CPU kernel could not be built: %s)", why)
            return get_backend("eager")
        name = "cpu_paged"
    if name == "cpu_paged" and device.type != "cpu":
        raise ValueError(f"--attention-backend cpu_paged runs on the CPU only (device {device.type})")
    return get_backend(name)


def num_kv_blocks(budget_gb: float, override: int | None, bytes_per_token: int, block_size: int) -> int:
    """Deterministic: the same flags give the same pool on every launch."""
    if override is not None:
        return override
    n = int(budget_gb * (1 << 30)) // (bytes_per_token * block_size)
    if n < 1:
        raise ValueError(f"kv_cache_memory_gb {budget_gb} is too small for one block "
                         f"({bytes_per_token * block_size} bytes)")
    return n


def _max_model_len(mc, trained: int) -> int:
    """The model's own context unless asked for less; more only with the explicit override
    (positions past the trained context give the model inputs it never saw)."""
    if mc.max_model_len is None:
        return trained
    if mc.max_model_len > trained and not mc.allow_long_max_model_len:
        raise ValueError(f"--max-model-len {mc.max_model_len} is above the model's trained "
                         f"context ({trained}); pass --allow-long-max-model-len to use it anyway")
    return mc.max_model_len


def build_engine_parts(config: EngineConfig) -> EngineParts:
    mc, cc, sc = config.model, config.cache, config.spec
    torch.set_num_threads(config.parallel.num_threads or default_num_threads())
    device, dtype = resolve_device(mc.device), resolve_dtype(mc.dtype)
    quant = resolve_quantization(mc.quantization, device, dtype)
    loaded = load_model_files(mc.model, keep_quantized=quant != "none")
    arch = loaded.arch
    max_model_len = _max_model_len(mc, arch.max_position_embeddings)
    plan, proposer, drafter_tokens, drafter_max_len = _plan_and_proposer(config, arch.vocab_size,
                                                                         device, dtype, arch)
    weights = WeightPlan(quant, mc.quant_dense_above, dtype, device, mc.dense_row_buckets, mc.linear_kernel)
    model = create_model(arch, loaded.state_dict, dtype, device, max_model_len + plan.max_k + 1, weights)
    del loaded.state_dict
    _release_load_memory()
    model.attn = resolve_attention(mc.attention_backend, device)
    if isinstance(proposer, EagleProposer):  # the target captures the head's layers from now on
        proposer.attach(model)
    log.info("weights: quantization %s, linear kernel %s, %.1f MB read per decode step; CPU %s", quant,
             linear_kernel_summary(model), model.weight_bytes_per_step() / 1e6,
             cpu_info().summary() if device.type == "cpu" else "n/a")
    blocks = num_kv_blocks(cc.kv_cache_memory_gb, cc.num_kv_blocks, model.kv_bytes_per_token(),
                           cc.block_size)
    kv = KVCacheManager(blocks, cc.block_size, cc.enable_prefix_caching)
    # One scratch block past the pool (id `blocks`): padded rows of fixed-shape steps use it.
    kv_caches = model.allocate_kv((blocks + 1) * cc.block_size)
    log.info("KV pool: %d blocks x %d = %d tokens (%.2f GiB)%s", blocks, cc.block_size,
             blocks * cc.block_size, blocks * cc.block_size * model.kv_bytes_per_token() / 2**30,
             f"; drafter pool {drafter_tokens} tokens" if drafter_tokens else "")
    policy, info = None, None
    if plan.speculating:
        policy, plan, info = _k_policy(config, plan, model, kv_caches, blocks, max_model_len)
    exec_plan = _execution_plan(config, plan, device)
    sched = Scheduler(config.scheduler, kv, plan, policy, max_model_len, loaded.eos_token_ids,
                      drafter_max_len, exec_plan)
    verifier = make_synthetic_verifier(sc.rejection_mode, sc.acceptance_rates, mc.seed,
                                       loaded.eos_token_ids) if plan.speculating else None
    # The grammar library loads on the first structured request, not here.
    so = config.structured
    structured = StructuredOutputManager(so.structured_output_backend, loaded.tokenizer,
                                         arch.vocab_size, loaded.eos_token_ids,
                                         so.structured_any_whitespace)
    if hasattr(proposer, "grammar"):  # a draft model drafts under the request's grammar
        proposer.grammar = structured
    runner = _runner(config, model, kv_caches, blocks, proposer, exec_plan,
                     max_model_len + plan.max_k + 1, verifier, structured)
    return EngineParts(loaded.tokenizer, plan, exec_plan, model, kv, sched, runner, max_model_len,
                       arch.vocab_size, drafter_tokens, loaded.eos_token_ids, mc.model, structured,
                       info)


def _plan_and_proposer(config: EngineConfig, vocab_size: int, device: torch.device,
                       dtype: torch.dtype, arch=None):
    """The plan is built before the drafter (always_zero loads none), then rebuilt with the
    drafter's own K limit so clamping and classification see it; a drafter whose limit makes
    the plan always_zero is dropped again."""
    sc = config.spec
    plan = build_spec_plan(sc.speculator, sc.num_spec_tokens, sc.k_schedule)
    proposer, drafter_tokens, drafter_max_len = _build_proposer(config, plan, vocab_size, device, dtype, arch)
    limit = getattr(proposer, "k_limit", None)
    if limit is not None:
        plan = build_spec_plan(sc.speculator, sc.num_spec_tokens, sc.k_schedule, limit)
        if not plan.speculating:
            proposer, drafter_tokens, drafter_max_len = None, 0, None
    # The table as written and clamped; the plan as run (under the K policy) is logged with it.
    log.info("speculation table: %s%s", plan.summary(),
             "".join(f"; {c}" for c in plan.clamped))
    return plan, proposer, drafter_tokens, drafter_max_len


def _execution_plan(config: EngineConfig, plan: SpecPlan, device: torch.device) -> ExecutionPlan:
    ec = config.execution
    path = ec.admission or default_admission_path(config.spec.k_schedule)
    admission = None
    if ec.execution == "auto" and path is not None:
        if ec.admission is not None or os.path.isfile(path):
            admission = AdmissionTable.load(path)
    ep = ExecutionPlan.build(plan, config.scheduler.max_num_seqs, ec.execution, device.type, admission)
    fixed = [s for s in ep.grid if ep.path_for(*s)[0] != "eager"]
    log.info("execution plan: --execution %s, %d of %d grid shapes on %s%s", ec.execution,
             len(fixed), len(ep.grid), ep.graph_path,
             f" (admission {admission.source})" if admission else "")
    return ep


def _runner(config: EngineConfig, model: LlamaModel, kv_caches: list, blocks: int, proposer,
            ep: ExecutionPlan, max_positions: int, verifier, structured) -> ModelRunner:
    cc, sc = config.cache, config.scheduler
    max_tokens = max(sc.max_num_batched_tokens, max(ep.buckets) * max(ep.widths))
    max_reqs = max(sc.max_num_seqs, max(ep.buckets))
    max_blocks = -(-max_positions // cc.block_size)
    buffers = InputBuffers.allocate(max_tokens, max_reqs, max_blocks, blocks, model.device)
    executor = None
    if any(ep.path_for(*s)[0] != "eager" for s in ep.grid):
        ec = config.execution
        executor = make_executor(model, kv_caches, model.device, ec.compile_budget_s, len(ep.grid),
                                 ec.compile_backend)
    runner = ModelRunner(model, kv_caches, cc.block_size, proposer, config.model.seed, buffers,
                         executor, verifier, structured,
                         hidden_sink=proposer if isinstance(proposer, EagleProposer) else None)
    if executor is not None and config.execution.precompile:
        shapes = [s for s in ep.grid if ep.path_for(*s)[0] != "eager"]
        log.info("precompiling %d %s shapes", len(shapes), ep.graph_path)
        secs = runner.precompile(shapes)
        log.info("precompiled %d shapes in %.1f s", len(executor.build_seconds), secs)
    return runner


def _kernel_build() -> str:
    """The C++ kernels' build (source hash): a kernel change changes every step's time, so a
    cost table measured with other kernels is another cache entry, never reused."""
    from dynaspec import cpu_kernels

    ok, _ = cpu_kernels.available()
    return cpu_kernels.extension().build_info()[1] if ok else "none"


def _k_policy(config: EngineConfig, plan: SpecPlan, model: LlamaModel, kv_caches: list,
              blocks: int, max_model_len: int) -> tuple[KPolicy, SpecPlan, PolicyInfo]:
    """The policy, the plan as it runs under it (goodput adds width 1: plan_for_policy) and
    what the logs and the card say about it. A refused cost table runs the plan's table."""
    from dynaspec.spec_decode.goodput_policy import GoodputSettings

    sc = config.spec
    name = resolve_policy_name(sc.k_policy, True, sc.k_schedule is not None)
    cost, info = None, PolicyInfo(name, sc.k_policy)
    if name == "goodput":
        cost, info = _step_cost_model(config, model, kv_caches, blocks, max_model_len, plan)
        if cost is None:
            name = "table"
    plan = plan_for_policy(plan, name)
    settings = GoodputSettings(synthetic_rates=sc.acceptance_rates if not sc.lossless else ())
    # Only widths the plan produces (plus plain decode, K=0): the execution plan's grid,
    # metrics and buffers are sized for them, so the policy never steps off it.
    widths = tuple(sorted({1, *plan.widths}))
    policy = make_policy(plan, name, cost_model=cost, allowed_widths=widths, settings=settings)
    log.info("%s; plan as run: %s", info.describe(), plan.summary())
    return policy, plan, info


def _step_cost_model(config: EngineConfig, model: LlamaModel, kv_caches: list[torch.Tensor],
                     num_blocks: int, max_model_len: int,
                     plan: SpecPlan) -> tuple[StepCostModel | None, PolicyInfo]:
    """The injected table, else the checked cached/measured one (engine/cost_profile)."""
    from dynaspec.engine.cost_profile import model_prober, startup_cost_model

    mc, cc, sc = config.model, config.cache, config.spec
    if sc.cost_table is not None:
        cost = StepCostModel.injected(sc.cost_table)
        return cost, PolicyInfo("goodput", sc.k_policy, "injected (fixed)")
    grid = CostGrid.default(config.scheduler.max_num_seqs, max_model_len, plan.max_width)
    key = cost_cache.cache_key(
        model=os.path.abspath(mc.model) if os.path.exists(mc.model) else mc.model,
        dtype=model.dtype, device=model.device, threads=torch.get_num_threads(),
        block_size=cc.block_size, quantization=mc.quantization,
        quant_dense_above=mc.quant_dense_above, dense_row_buckets=mc.dense_row_buckets,
        # the quantized linear kernel (main's --linear-kernel) changes every step's time
        linear_kernel=mc.linear_kernel, attention=getattr(model.attn, "name", "?"),
        execution=config.execution.execution, kernels=_kernel_build())
    prober = model_prober(model, kv_caches, cc.block_size, num_blocks)
    table = startup_cost_model(prober, grid, key, reprofile=sc.reprofile_costs)
    if table.model is None:
        log.warning("step cost table refused (%s): the goodput policy is replaced by the plan's "
                    "table for this run; nothing was saved", "; ".join(table.problems[:3]))
        return None, PolicyInfo("table", sc.k_policy, "refused", None,
                                "goodput fell back to the table: the measured step costs failed "
                                "their checks")
    how = table.source
    if table.num_measured:
        how += f" ({table.num_measured} cells in {table.seconds:.1f} s, the rest estimated)"
    for line in table.model.describe():
        log.info("%s", line)
    return table.model, PolicyInfo("goodput", sc.k_policy, how, table.cache_file)


def _build_proposer(config: EngineConfig, plan: SpecPlan, vocab_size: int, device: torch.device,
                    dtype: torch.dtype, arch=None):
    """Returns (proposer, drafter KV tokens, drafter max len). always_zero loads nothing."""
    sc = config.spec
    if not plan.speculating:
        return None, 0, None
    if sc.speculator == "ngram":
        from dynaspec.spec_decode.ngram import NgramProposer
        return NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max), 0, None
    if sc.speculator == "suffix":
        from dynaspec.spec_decode.suffix import SuffixParams, SuffixProposer, memory_bound_bytes
        prop = SuffixProposer(SuffixParams(sc.suffix_max_depth, sc.suffix_spec_factor,
                                           sc.suffix_min_token_prob),
                              sc.suffix_cache_max_requests, sc.suffix_cache_max_tokens)
        log.info("suffix drafter: global cache of %d outputs / %d tokens (at most %.1f MiB)",
                 sc.suffix_cache_max_requests, sc.suffix_cache_max_tokens,
                 memory_bound_bytes(sc.suffix_cache_max_tokens, sc.suffix_cache_max_requests) / 2**20)
        return prop, 0, None
    if sc.speculator == "eagle":
        return _eagle_proposer(config, arch), 0, None
    from dynaspec.spec_decode.draft_model import DraftModelProposer
    prop = DraftModelProposer.load(sc.draft_model, config, vocab_size, device, dtype)
    return prop, prop.num_kv_tokens, prop.max_len


def _eagle_proposer(config: EngineConfig, arch) -> EagleProposer:
    """The EAGLE head (--draft-head, or the one shipped for the default model), checked against
    the target's architecture as it loads."""
    from dynaspec.spec_decode.eagle import DEFAULT_HEAD
    from dynaspec.spec_decode.eagle_io import load_head

    path = config.spec.draft_head
    if path is None:
        if config.model.model != "default":
            raise ValueError("--speculator eagle needs --draft-head DIR for a model other than the default "
                             "(train one with: dynaspec train-draft-head --model M --out DIR)")
        path = DEFAULT_HEAD
    head, emb = load_head(path, arch)
    c = head.cfg
    log.info("EAGLE drafter: %s head from %s (draft vocabulary %d, target layers %s)", c.kind, path,
             c.draft_vocab_size, ",".join(map(str, c.aux_layers)))
    return EagleProposer(head, arch.max_position_embeddings, emb)
