"""Building a drafter from the engine config: one factory per `registry.SPECULATORS` entry.

The builder asks the registry for the factory of the configured speculator and gets back the
proposer plus what the engine must size around it (a draft model's own KV pool and context
limit), so no drafter's construction details live in the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dynaspec.config import EngineConfig
from dynaspec.spec_decode.base import Proposer

log = logging.getLogger("dynaspec.engine")


@dataclass(frozen=True)
class DrafterBuild:
    proposer: Proposer
    kv_tokens: int = 0  # the drafter's own KV pool (a draft model's), in tokens
    max_len: int | None = None  # the drafter's context limit; None = the target's


def build_drafter(config: EngineConfig, vocab_size: int, device: torch.device,
                  dtype: torch.dtype, grammar: Any = None) -> DrafterBuild:
    """`grammar` (the structured-output manager) reaches drafters that draft under a
    request's grammar (`Proposer.uses_grammar`)."""
    from dynaspec.registry import SPECULATORS

    factory = SPECULATORS.load(config.spec.speculator)
    return factory(config, vocab_size, device, dtype, grammar)


def build_ngram(config: EngineConfig, vocab_size: int, device: torch.device,
                dtype: torch.dtype, grammar: Any = None) -> DrafterBuild:
    from dynaspec.spec_decode.ngram import NgramProposer

    sc = config.spec
    return DrafterBuild(NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max))


def build_suffix(config: EngineConfig, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, grammar: Any = None) -> DrafterBuild:
    from dynaspec.spec_decode.suffix import SuffixParams, SuffixProposer, memory_bound_bytes

    sc = config.spec
    prop = SuffixProposer(SuffixParams(sc.suffix_max_depth, sc.suffix_spec_factor,
                                       sc.suffix_min_token_prob),
                          sc.suffix_cache_max_requests, sc.suffix_cache_max_tokens)
    log.info("suffix drafter: global cache of %d outputs / %d tokens (at most %.1f MiB)",
             sc.suffix_cache_max_requests, sc.suffix_cache_max_tokens,
             memory_bound_bytes(sc.suffix_cache_max_tokens, sc.suffix_cache_max_requests) / 2**20)
    return DrafterBuild(prop)


def build_draft_model(config: EngineConfig, vocab_size: int, device: torch.device,
                      dtype: torch.dtype, grammar: Any = None) -> DrafterBuild:
    from dynaspec.spec_decode.draft_model import DraftModelProposer

    prop = DraftModelProposer.load(config.spec.draft_model, config, vocab_size, device, dtype,
                                   grammar)
    return DrafterBuild(prop, prop.num_kv_tokens, prop.max_len)
