"""Building a drafter from the engine config: one factory per `registry.SPECULATORS` entry.

The builder asks the registry for the factory of the configured speculator and gets back the
proposer plus what the engine must size around it (a draft model's own KV pool and context
limit), so no drafter's construction details live in the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from dynaspec.config import EAGLE_DEFAULT_K, EngineConfig
from dynaspec.model_arch import ModelArchConfig
from dynaspec.spec_decode.drafters.base import Proposer

if TYPE_CHECKING:
    from dynaspec.spec_decode.drafters.eagle import EagleProposer

log = logging.getLogger("dynaspec.engine")


@dataclass(frozen=True)
class DrafterTarget:
    """What a drafter may know of the target it drafts for."""

    arch: ModelArchConfig
    device: torch.device
    dtype: torch.dtype
    grammar: Any = None  # the structured-output manager, for drafters with `uses_grammar`
    # Positions the engine may run, drafts included (0: the target's max_position_embeddings);
    # past that under --allow-long-max-model-len.
    max_positions: int = 0


@dataclass(frozen=True)
class DrafterBuild:
    proposer: Proposer
    kv_tokens: int = 0  # the drafter's own KV pool (a draft model's), in tokens
    max_len: int | None = None  # the drafter's context limit; None = the target's


def build_drafter(config: EngineConfig, target: DrafterTarget) -> DrafterBuild:
    from dynaspec.registry import SPECULATORS

    return SPECULATORS.load(config.spec.speculator)(config, target)


def build_ngram(config: EngineConfig, target: DrafterTarget) -> DrafterBuild:
    from dynaspec.spec_decode.drafters.ngram import NgramProposer

    sc = config.spec
    return DrafterBuild(NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max,
                                      tree=bool(sc.draft_tree)))


def build_suffix(config: EngineConfig, target: DrafterTarget) -> DrafterBuild:
    from dynaspec.spec_decode.drafters.suffix import (
        SuffixParams,
        SuffixProposer,
        memory_bound_bytes,
    )

    sc = config.spec
    prop = SuffixProposer(SuffixParams(sc.suffix_max_depth, sc.suffix_spec_factor,
                                       sc.suffix_min_token_prob),
                          sc.suffix_cache_max_requests, sc.suffix_cache_max_tokens,
                          tree=bool(sc.draft_tree))
    log.info("suffix drafter: global cache of %d outputs / %d tokens (at most %.1f MiB)",
             sc.suffix_cache_max_requests, sc.suffix_cache_max_tokens,
             memory_bound_bytes(sc.suffix_cache_max_tokens, sc.suffix_cache_max_requests) / 2**20)
    return DrafterBuild(prop)


def build_draft_model(config: EngineConfig, target: DrafterTarget) -> DrafterBuild:
    from dynaspec.spec_decode.drafters.draft_model import DraftModelProposer

    assert config.spec.draft_model is not None  # EngineConfig requires it for "draft"
    prop = DraftModelProposer.load(config.spec.draft_model, config, target.arch.vocab_size,
                                   target.device, target.dtype, target.grammar)
    return DrafterBuild(prop, prop.num_kv_tokens, prop.max_len)


def _eagle_head(config: EngineConfig, target: DrafterTarget) -> EagleProposer:
    """The EAGLE head's proposer (--draft-head, or the one shipped for the default model),
    checked against the target's architecture as it loads."""
    from dynaspec.spec_decode.drafters.eagle import DEFAULT_HEAD, EagleProposer
    from dynaspec.spec_decode.drafters.eagle_head import compiled_step, drafting_form
    from dynaspec.spec_decode.drafters.eagle_io import load_head

    path, arch = config.spec.draft_head, target.arch
    if path is None:
        if config.model.model != "default":
            raise ValueError(f"--speculator {config.spec.speculator} needs --draft-head DIR for "
                             "a model other than the default (train one with: dynaspec "
                             "train-draft-head --model M --out DIR)")
        path = DEFAULT_HEAD
    head, emb = load_head(path, arch, target.max_positions)
    c = head.cfg
    log.info("EAGLE drafter: %s head from %s (draft vocabulary %d, target layers %s)", c.kind,
             path, c.draft_vocab_size, ",".join(map(str, c.aux_layers)))
    step = None
    if target.device.type == "cpu":
        head = drafting_form(head)
        step = compiled_step(head)
    return EagleProposer(head, c.max_positions, emb, step)


def _lookup_chains(config: EngineConfig, target: DrafterTarget) -> Proposer:
    """The lookup named by --eagle-lookup, drafting chains (a drafter pairing it with the head
    makes any tree itself)."""
    chains = replace(config, spec=replace(config.spec, draft_tree=False))
    build = {"ngram": build_ngram, "suffix": build_suffix}[config.spec.eagle_lookup]
    return build(chains, target).proposer


def build_eagle(config: EngineConfig, target: DrafterTarget) -> DrafterBuild:
    """The EAGLE head, alone or (--eagle-lookup) behind a lookup tried first."""
    prop = _eagle_head(config, target)
    if config.spec.eagle_lookup == "none":
        return DrafterBuild(prop)
    from dynaspec.spec_decode.drafters.lookup_first import LookupFirstProposer

    log.info("EAGLE drafter: %s lookup first, the head where it finds nothing",
             config.spec.eagle_lookup)
    return DrafterBuild(LookupFirstProposer(_lookup_chains(config, target), prop))


def build_hybrid(config: EngineConfig, target: DrafterTarget) -> DrafterBuild:
    """The EAGLE head and the --eagle-lookup drafter in one token tree (hybrid_tree.py); chains
    (lookup first) where trees cannot be verified here (engine/tree_setting.py)."""
    from dynaspec.spec_decode.drafters.hybrid_tree import HybridTreeProposer

    sc = config.spec
    log.info("hybrid drafter: the EAGLE head and the %s lookup in one %s", sc.eagle_lookup,
             "token tree" if sc.draft_tree else "chain (lookup first: trees are off here)")
    return DrafterBuild(HybridTreeProposer(_lookup_chains(config, target),
                                           _eagle_head(config, target), sc.eagle_lookup,
                                           tree=bool(sc.draft_tree), head_depth=EAGLE_DEFAULT_K))
