"""Start-up: resolve device and dtype, load weights, size the KV pool, build the SpecPlan and
parts."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dynaspec.attention.backend import AttentionBackend
from dynaspec.config import EngineConfig, ModelConfig, default_num_threads
from dynaspec.engine.output_processor import OutputProcessor
from dynaspec.engine.tree_setting import resolve_draft_tree
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.kv.sizing import num_kv_blocks
from dynaspec.model_arch import ModelArchConfig
from dynaspec.models.gemma3 import create_model, model_attention
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_model_files
from dynaspec.models.quant_linear import (
    WeightPlan,
    cpu_info,
    linear_kernel_summary,
    resolve_quantization,
)
from dynaspec.models.tokenizer import Tokenizer
from dynaspec.sample.synthetic import SyntheticVerifier, make_synthetic_verifier
from dynaspec.scheduler.scheduler import Scheduler
from dynaspec.spec_decode.drafters.base import Proposer
from dynaspec.spec_decode.drafters.drafters import DrafterTarget, build_drafter
from dynaspec.spec_decode.drafters.grammar_draft import GrammarDrafter
from dynaspec.spec_decode.plan.execution_plan import (
    AdmissionTable,
    ExecutionPlan,
    default_admission_path,
)
from dynaspec.spec_decode.plan.plan import SpecPlan, build_spec_plan, plan_for_policy
from dynaspec.spec_decode.policy import cost_cache
from dynaspec.spec_decode.policy.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.policy.k_policy import KPolicy
from dynaspec.spec_decode.policy.policies import make_policy, resolve_policy_name
from dynaspec.structured.manager import StructuredOutputManager
from dynaspec.worker.compiled import make_executor
from dynaspec.worker.input_buffers import InputBuffers
from dynaspec.worker.model_runner import ModelRunner

log = logging.getLogger("dynaspec")


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    tokenizer: Tokenizer
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
    outputs: OutputProcessor  # detokenization and the stop-string check the scheduler calls
    policy_info: PolicyInfo | None = None


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


def resolve_attention(name: str, device: torch.device) -> AttentionBackend:
    """The target model's attention backend; auto prefers the in-place CPU kernel."""
    from dynaspec.attention.backend import get_backend

    if name == "auto":
        if device.type == "cuda":  # the in-place Triton kernel; eager where Triton is absent
            from dynaspec.attention.gpu_paged import available as gpu_available

            ok, why = gpu_available(device)
            if not ok:
                log.info("attention: eager (the GPU paged kernel is unavailable: %s)", why)
            return get_backend("gpu_paged" if ok else "eager")
        if device.type != "cpu":
            return get_backend("eager")
        from dynaspec.attention.cpu_paged import available

        ok, why = available()
        if not ok:
            log.info("attention: eager (the in-place CPU kernel could not be built: %s)", why)
            return get_backend("eager")
        name = "cpu_paged"
    if name == "cpu_paged" and device.type != "cpu":
        raise ValueError(
            f"--attention-backend cpu_paged runs on the CPU only (device {device.type})"
        )
    return get_backend(name)


def _max_model_len(mc: ModelConfig, trained: int) -> int:
    """The model's own context unless asked for less; more only with the explicit override
    (positions past the trained context give the model inputs it never saw)."""
    if mc.max_model_len is None:
        return trained
    if mc.max_model_len > trained and not mc.allow_long_max_model_len:
        raise ValueError(f"--max-model-len {mc.max_model_len} is above the model's trained "
                         f"context ({trained}); pass --allow-long-max-model-len to use it anyway")
    return mc.max_model_len


def build_engine_parts(config: EngineConfig,
                       wrap_policy: Callable[[KPolicy], KPolicy] | None = None,
                       wrap_proposer: Callable[[Proposer], Proposer] | None = None
                       ) -> EngineParts:
    """Every part of an engine, wired by construction. `wrap_policy`: a data-parallel rank's
    wrapper around the K policy (dp/lockstep_policy.LockstepPolicy), applied before the scheduler
    is built with it. `wrap_proposer`: what drafts in place of the configured drafter (given
    it), before the policy and the runner are built with it (a test's drafter)."""
    mc, cc, sc = config.model, config.cache, config.spec
    torch.set_num_threads(config.parallel.num_threads or default_num_threads())
    device, dtype = resolve_device(mc.device), resolve_dtype(mc.dtype)
    quant = resolve_quantization(mc.quantization, device, dtype)
    loaded = load_model_files(mc.model, keep_quantized=quant != "none")
    arch = loaded.arch
    max_model_len = _max_model_len(mc, arch.max_position_embeddings)
    # The backend first: whether drafts may be trees depends on it (refused here, not mid-run).
    attn = model_attention(arch, resolve_attention(mc.attention_backend, device))
    config = replace(config, spec=replace(sc, draft_tree=resolve_draft_tree(sc, arch, attn)))
    sc = config.spec
    # The grammar library loads on the first structured request, not here.
    so = config.structured
    structured = StructuredOutputManager(so.structured_output_backend, loaded.tokenizer,
                                         arch.vocab_size, loaded.eos_token_ids,
                                         so.structured_any_whitespace)
    plan, proposer, drafter_tokens, drafter_max_len = _plan_and_proposer(
        config, arch.vocab_size, device, dtype, structured, arch, max_model_len)
    if wrap_proposer is not None and proposer is not None:
        proposer = wrap_proposer(proposer)
    weights = WeightPlan(
        quant, mc.quant_dense_above, dtype, device, mc.dense_row_buckets, mc.linear_kernel
    )
    model = create_model(
        arch, loaded.state_dict, dtype, device, max_model_len + plan.max_k + 1, weights
    )
    del loaded.state_dict
    _release_load_memory()
    model.attn = attn
    if proposer is not None and proposer.reads_hidden_states:  # the target captures its layers
        proposer.attach(model)
    log.info(
        "weights: quantization %s, linear kernel %s, %.1f MB read per decode step; CPU %s",
        quant,
        linear_kernel_summary(model),
        model.weight_bytes_per_step() / 1e6,
        cpu_info().summary() if device.type == "cpu" else "n/a",
    )
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
        assert proposer is not None  # a speculating plan loaded its drafter
        policy, plan, info = _k_policy(config, plan, model, kv_caches, blocks, max_model_len,
                                       proposer)
    if policy is not None and wrap_policy is not None:
        policy = wrap_policy(policy)
    exec_plan = _execution_plan(config, plan, device)
    outputs = OutputProcessor(loaded.tokenizer)
    sched = Scheduler(config.scheduler, kv, plan, policy, max_model_len, loaded.eos_token_ids,
                      drafter_max_len=drafter_max_len, exec_plan=exec_plan,
                      stop_check=outputs.check_stop)
    verifier = make_synthetic_verifier(sc.rejection_mode, sc.acceptance_rates, mc.seed,
                                       loaded.eos_token_ids) if plan.speculating else None
    runner = _runner(config, model, kv_caches, blocks, proposer, exec_plan,
                     max_model_len + plan.max_k + 1, verifier, structured,
                     tuple(loaded.eos_token_ids))
    return EngineParts(tokenizer=loaded.tokenizer, plan=plan, exec_plan=exec_plan, model=model,
                       kv=kv, scheduler=sched, runner=runner, max_model_len=max_model_len,
                       vocab_size=arch.vocab_size, drafter_kv_tokens=drafter_tokens,
                       eos_token_ids=loaded.eos_token_ids, model_name=mc.model,
                       structured=structured, outputs=outputs, policy_info=info)


def _plan_and_proposer(config: EngineConfig, vocab_size: int, device: torch.device,
                       dtype: torch.dtype, structured: StructuredOutputManager,
                       arch: ModelArchConfig, max_model_len: int
                       ) -> tuple[SpecPlan, Proposer | None, int, int | None]:
    """The plan is built before the drafter (always_zero loads none), then rebuilt with the
    drafter's own K limit so clamping and classification see it; a drafter whose limit makes
    the plan always_zero is dropped again."""
    sc = config.spec
    plan = build_spec_plan(sc.speculator, sc.num_spec_tokens, sc.k_schedule)
    proposer, drafter_tokens, drafter_max_len = None, 0, None
    if plan.speculating:  # always_zero loads no drafter
        drafter = build_drafter(config, DrafterTarget(arch, device, dtype, structured,
                                                      max_model_len + plan.max_k + 1))
        proposer, drafter_tokens, drafter_max_len = (drafter.proposer, drafter.kv_tokens,
                                                     drafter.max_len)
    limit = proposer.k_limit if proposer is not None else None
    if limit is not None:
        plan = build_spec_plan(sc.speculator, sc.num_spec_tokens, sc.k_schedule, limit)
        if not plan.speculating:
            proposer, drafter_tokens, drafter_max_len = None, 0, None
    # The table as written and clamped; the plan as run (under the K policy) is logged with it.
    log.info("speculation table: %s%s", plan.summary(),
             "".join(f"; {c}" for c in plan.clamped))
    return plan, proposer, drafter_tokens, drafter_max_len


def _admission_path(config: EngineConfig) -> str | None:
    """The admission table `--execution auto` reads, None where it has none."""
    ec = config.execution
    path = ec.admission or default_admission_path(config.spec.k_schedule)
    if ec.execution != "auto" or path is None:
        return None
    return path if ec.admission is not None or os.path.isfile(path) else None


def _widths_follow_drafts(config: EngineConfig, device: torch.device | None = None) -> bool:
    """Every decode step runs eager, verifying only the drafts produced (no fixed-shape path
    pads rows to the planned width): eager, or auto without an admission table (on the CPU;
    on CUDA auto runs graphs by default)."""
    cuda = device is not None and device.type == "cuda"
    return config.execution.execution == "eager" or (
        config.execution.execution == "auto" and _admission_path(config) is None and not cuda)


def _execution_plan(config: EngineConfig, plan: SpecPlan, device: torch.device) -> ExecutionPlan:
    ec = config.execution
    path = _admission_path(config)
    admission = AdmissionTable.load(path) if path is not None else None
    ep = ExecutionPlan.build(
        plan, config.scheduler.max_num_seqs, ec.execution, device.type, admission
    )
    log.info("execution plan: --execution %s, %d of %d grid shapes on %s%s", ec.execution,
             len(ep.fixed_shapes), len(ep.grid), ep.graph_path,
             f" (admission {admission.source})" if admission else "")
    return ep


def _runner(config: EngineConfig, model: LlamaModel, kv_caches: list[torch.Tensor], blocks: int,
            proposer: Proposer | None, ep: ExecutionPlan, max_positions: int,
            verifier: SyntheticVerifier | None, structured: StructuredOutputManager,
            eos_token_ids: tuple[int, ...]) -> ModelRunner:
    cc, sc = config.cache, config.scheduler
    max_tokens = max(sc.max_num_batched_tokens, max(ep.buckets) * max(ep.widths))
    max_reqs = max(sc.max_num_seqs, max(ep.buckets))
    max_blocks = -(-max_positions // cc.block_size)
    buffers = InputBuffers.allocate(max_tokens, max_reqs, max_blocks, blocks, model.device)
    executor = None
    if ep.fixed_shapes:
        ec = config.execution
        executor = make_executor(model, kv_caches, model.device, ec.compile_budget_s, len(ep.grid),
                                 ec.compile_backend)
    grammar = GrammarDrafter(structured) \
        if proposer is not None and config.spec.grammar_drafts else None
    runner = ModelRunner(model, kv_caches, cc.block_size, proposer, config.model.seed, buffers,
                         executor, verifier, structured, eos_token_ids,
                         hidden_sink=proposer if proposer is not None
                         and proposer.reads_hidden_states else None, grammar_drafter=grammar)
    if executor is not None and config.execution.precompile:
        log.info("precompiling %d %s shapes", len(ep.fixed_shapes), ep.graph_path)
        secs = runner.precompile(ep.fixed_shapes)
        log.info("precompiled %d shapes in %.1f s", len(executor.build_seconds), secs)
    return runner


def _kernel_build() -> str:
    """The C++ kernels' build (source hash): a kernel change changes every step's time, so a
    cost table measured with other kernels is another cache entry, never reused."""
    from dynaspec import cpu_kernels

    ok, _ = cpu_kernels.available()
    return cpu_kernels.extension().build_info()[1] if ok else "none"


def _k_policy(config: EngineConfig, plan: SpecPlan, model: LlamaModel, kv_caches: list,
              blocks: int, max_model_len: int,
              proposer: Proposer) -> tuple[KPolicy, SpecPlan, PolicyInfo]:
    """The policy, the plan as it runs under it (goodput adds width 1: plan_for_policy) and
    what the logs and the card say about it. A refused cost table runs the plan's table."""
    from dynaspec.spec_decode.policy.goodput_policy import GoodputSettings

    sc = config.spec
    name = resolve_policy_name(sc.k_policy, True, sc.k_schedule is not None)
    assert name is not None  # speculating: some policy runs
    cost, info = None, PolicyInfo(name, sc.k_policy)
    if name == "goodput":
        cost, info = _step_cost_model(config, model, kv_caches, blocks, max_model_len, plan)
        if cost is None:
            name = "table"
    plan = plan_for_policy(plan, name)
    settings = GoodputSettings(synthetic_rates=sc.acceptance_rates if not sc.lossless else (),
                               widths_follow_drafts=_widths_follow_drafts(config, model.device),
                               whole_cap=proposer.sizes_own_drafts,
                               prices_fallback=proposer.has_fallback,
                               prices_grammar=sc.grammar_drafts,
                               # trees run as trees only under strict verification (tree_step)
                               drafts_trees=proposer.drafts_trees and sc.lossless,
                               draft_cost_prior=_draft_cost(proposer, name))
    # Only widths the plan produces, so the policy never steps off the execution plan's grid.
    policy = make_policy(plan, name, cost_model=cost, allowed_widths=plan.policy_widths,
                         settings=settings)
    log.info("%s; plan as run: %s", info.describe(), plan.summary())
    return policy, plan, info


def _draft_cost(proposer: Proposer, policy: str) -> float:
    """The drafter's start-up measurement of its cost per drafted token (0: none), for the
    goodput policy only (the others do not price drafting)."""
    cost = proposer.measure_draft_cost() if policy == "goodput" else None
    if cost is not None:
        log.info("drafter: %.3f ms per drafted token at batch 1 (start-up measurement; served "
                 "drafting steps replace it)", cost * 1e3)
    return cost or 0.0


def _step_cost_model(config: EngineConfig, model: LlamaModel, kv_caches: list[torch.Tensor],
                     num_blocks: int, max_model_len: int,
                     plan: SpecPlan) -> tuple[StepCostModel | None, PolicyInfo]:
    """The injected table, else the checked cached/measured one (spec_decode/cost_profile)."""
    from dynaspec.spec_decode.policy.cost_profile import (
        ProfileSettings,
        gpu_profile_settings,
        model_prober,
        startup_cost_model,
    )

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
    settings = gpu_profile_settings() if model.device.type == "cuda" else ProfileSettings()
    prober = model_prober(model, kv_caches, cc.block_size, num_blocks, settings.reps)
    table = startup_cost_model(prober, grid, key, reprofile=sc.reprofile_costs,
                               settings=settings)
    if table.model is None:
        log.warning("step cost table refused (%s): the goodput policy is replaced by the plan's "
                    "table for this run; nothing was saved", "; ".join(table.problems[:3]))
        # The note says why (the page and /v1/models show it): most often the machine was busy
        # while the table was measured, which makes the costs non-monotone or not reproducible.
        return None, PolicyInfo("table", sc.k_policy, "refused", None,
                                "goodput fell back to the table: the step costs measured at "
                                f"start-up ({table.seconds:.0f} s) failed their checks, as they "
                                "do when the machine is busy while measuring: "
                                + "; ".join(table.problems[:2]))
    how = table.source
    if table.num_measured:
        how += f" ({table.num_measured} cells in {table.seconds:.1f} s, the rest estimated)"
    for line in table.model.describe():
        log.info("%s", line)
    return table.model, PolicyInfo("goodput", sc.k_policy, how, table.cache_file)
