"""Start-up: resolve device and dtype, load weights, size the KV pool, build the SpecPlan and parts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from dynaspec.config import EngineConfig, default_num_threads
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_model_files
from dynaspec.models.quant_linear import WeightPlan, cpu_info, resolve_quantization
from dynaspec.scheduler.scheduler import Scheduler
from dynaspec.spec_decode.k_policy import make_policy
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
    new_history: Callable[[], object | None]
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


def build_engine_parts(config: EngineConfig) -> EngineParts:
    mc, cc, sc = config.model, config.cache, config.spec
    torch.set_num_threads(default_num_threads())
    device, dtype = resolve_device(mc.device), resolve_dtype(mc.dtype)
    quant = resolve_quantization(mc.quantization, device, dtype)
    loaded = load_model_files(mc.model, keep_quantized=quant != "none")
    arch = loaded.arch
    max_model_len = min(mc.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    plan = build_spec_plan(sc.speculator, sc.num_spec_tokens, sc.k_schedule)
    proposer, drafter_tokens, drafter_max_len = _build_proposer(config, plan, arch.vocab_size,
                                                                device, dtype)
    weights = WeightPlan(quant, mc.quant_dense_above, dtype, device)
    model = LlamaModel(arch, loaded.state_dict, dtype, device, max_model_len + plan.max_k + 1, weights)
    del loaded.state_dict
    _release_load_memory()
    model.attn = resolve_attention(mc.attention_backend, device)
    log.info("weights: quantization %s, %.1f MB read per decode step; CPU %s", quant,
             model.weight_bytes_per_step() / 1e6, cpu_info().summary() if device.type == "cpu" else "n/a")
    blocks = num_kv_blocks(cc.kv_cache_memory_gb, cc.num_kv_blocks, model.kv_bytes_per_token(),
                           cc.block_size)
    kv = KVCacheManager(blocks, cc.block_size, cc.enable_prefix_caching)
    kv_caches = model.allocate_kv(blocks * cc.block_size)
    log.info("KV pool: %d blocks x %d = %d tokens (%.2f GiB)%s", blocks, cc.block_size,
             blocks * cc.block_size, blocks * cc.block_size * model.kv_bytes_per_token() / 2**30,
             f"; drafter pool {drafter_tokens} tokens" if drafter_tokens else "")
    policy = make_policy(plan, sc.k_policy) if plan.speculating else None
    sched = Scheduler(config.scheduler, kv, plan, policy, max_model_len, loaded.eos_token_ids,
                      drafter_max_len)
    runner = ModelRunner(model, kv_caches, cc.block_size, proposer, mc.seed)
    return EngineParts(loaded.tokenizer, plan, model, kv, sched, runner, max_model_len,
                       arch.vocab_size, _history_factory(plan, sc.k_policy), drafter_tokens,
                       loaded.eos_token_ids, mc.model)


def _history_factory(plan: SpecPlan, policy: str) -> Callable[[], object | None]:
    if not plan.speculating or policy != "adaptive":
        return lambda: None
    from dynaspec.spec_decode.k_policy import AcceptanceHistory
    return AcceptanceHistory


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
