"""Start-up: resolve device and dtype, load weights, size the KV pool, build the SpecPlan and parts."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
import torch

from dynaspec.config import EngineConfig, default_num_threads
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_model_files
from dynaspec.scheduler.scheduler import Scheduler
from dynaspec.spec_decode import cost_model
from dynaspec.spec_decode.cost_model import CostGrid, StepCostModel
from dynaspec.spec_decode.k_policy import make_policy, resolve_policy_name
from dynaspec.spec_decode.plan import SpecPlan, build_spec_plan
from dynaspec.worker.model_runner import ModelRunner

log = logging.getLogger("dynaspec")


@dataclass
class EngineParts:
    tokenizer: object
    plan: SpecPlan
    model: LlamaModel
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    vocab_size: int
    drafter_kv_tokens: int
    eos_token_ids: tuple[int, ...]
    model_name: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    return {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float16": torch.float16}[name]


def num_kv_blocks(budget_gb: float, override: int | None, bytes_per_token: int, block_size: int) -> int:
    """Deterministic: the same flags give the same pool on every launch."""
    if override is not None:
        return override
    n = int(budget_gb * (1 << 30)) // (bytes_per_token * block_size)
    if n < 1:
        raise ValueError(f"kv_cache_memory_gb {budget_gb} is too small for one block "
                         f"({bytes_per_token * block_size} bytes)")
    return n


def build_engine_parts(config: EngineConfig) -> EngineParts:
    mc, cc, sc = config.model, config.cache, config.spec
    torch.set_num_threads(config.parallel.num_threads or default_num_threads())
    device, dtype = resolve_device(mc.device), resolve_dtype(mc.dtype)
    loaded = load_model_files(mc.model)
    arch = loaded.arch
    max_model_len = min(mc.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    plan = build_spec_plan(sc.speculator, sc.num_spec_tokens, sc.k_schedule)
    proposer, drafter_tokens, drafter_max_len = _build_proposer(config, plan, arch.vocab_size,
                                                                device, dtype)
    model = LlamaModel(arch, loaded.state_dict, dtype, device, max_model_len + plan.max_k + 1)
    del loaded.state_dict
    blocks = num_kv_blocks(cc.kv_cache_memory_gb, cc.num_kv_blocks, model.kv_bytes_per_token(),
                           cc.block_size)
    kv = KVCacheManager(blocks, cc.block_size, cc.enable_prefix_caching)
    kv_caches = model.allocate_kv(blocks * cc.block_size)
    log.info("KV pool: %d blocks x %d = %d tokens (%.2f GiB)%s", blocks, cc.block_size,
             blocks * cc.block_size, blocks * cc.block_size * model.kv_bytes_per_token() / 2**30,
             f"; drafter pool {drafter_tokens} tokens" if drafter_tokens else "")
    policy = None
    if plan.speculating:
        cost = None
        if resolve_policy_name(sc.k_policy, True) == "goodput":
            cost = _step_cost_model(config, model, kv_caches, blocks, max_model_len, plan)
        policy = make_policy(plan, sc.k_policy, cost_model=cost)
    sched = Scheduler(config.scheduler, kv, plan, policy, max_model_len, loaded.eos_token_ids,
                      drafter_max_len)
    runner = ModelRunner(model, kv_caches, cc.block_size, proposer, mc.seed)
    return EngineParts(loaded.tokenizer, plan, model, kv, sched, runner, max_model_len,
                       arch.vocab_size, drafter_tokens, loaded.eos_token_ids, mc.model)


def _step_cost_model(config: EngineConfig, model: LlamaModel, kv_caches: list[torch.Tensor],
                     num_blocks: int, max_model_len: int, plan: SpecPlan) -> StepCostModel:
    """The cached cost table for this machine and these settings, else a fresh profile."""
    mc, cc = config.model, config.cache
    grid = CostGrid.default(config.scheduler.max_num_seqs, max_model_len, plan.max_width)
    key = cost_model.cache_key(model=os.path.abspath(mc.model) if os.path.exists(mc.model) else mc.model,
                               dtype=model.dtype, device=model.device, threads=torch.get_num_threads(),
                               block_size=cc.block_size,
                               quantization=getattr(mc, "quantization", "none"),
                               execution=getattr(getattr(config, "execution", None), "mode", "eager"))
    cost = cost_model.load_cached(key, grid)
    if cost is None:
        from dynaspec.engine.cost_profile import profile_step_costs
        cost = profile_step_costs(model, kv_caches, cc.block_size, num_blocks, grid)
        saved = cost_model.save_cached(key, cost)
        log.info("step cost table saved to %s", saved or "nowhere (cache dir not writable)")
    for line in cost.describe():
        log.info("%s", line)
    return cost


def _build_proposer(config: EngineConfig, plan: SpecPlan, vocab_size: int, device: torch.device,
                    dtype: torch.dtype):
    """Returns (proposer, drafter KV tokens, drafter max len). always_zero loads nothing."""
    sc = config.spec
    if not plan.speculating:
        return None, 0, None
    if sc.speculator == "ngram":
        from dynaspec.spec_decode.ngram import NgramProposer
        return NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max), 0, None
    from dynaspec.spec_decode.draft_model import DraftModelProposer
    prop = DraftModelProposer.load(sc.draft_model, config, vocab_size, device, dtype, plan.max_k)
    return prop, prop.num_kv_tokens, prop.max_len
