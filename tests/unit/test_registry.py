"""The registries: config validation, CLI choices and the builder read one table per part."""

from __future__ import annotations

import pytest

from dynaspec import registry as reg
from dynaspec.config import EngineConfig
from dynaspec.spec_decode.drafters.base import Proposer
from dynaspec.spec_decode.drafters.drafters import DrafterBuild, DrafterTarget, build_drafter


def test_check_names_the_value_and_every_choice():
    with pytest.raises(ValueError, match=r"unknown speculator 'ngam': choose none, ngram, draft, "
                                         r"suffix, eagle, hybrid or oracle"):
        EngineConfig.from_kwargs(speculator="ngam", num_spec_tokens=2)
    with pytest.raises(ValueError, match="unknown attention backend 'uniform'"):
        EngineConfig.from_kwargs(attention_backend="uniform")  # internal, not a user choice


def test_every_drafter_entry_loads_a_factory():
    for name in reg.SPECULATORS.names:
        if name != "none":
            assert callable(reg.SPECULATORS.load(name))
    with pytest.raises(ValueError, match="unknown speculator 'none'"):
        reg.SPECULATORS.load("none")  # nothing to build


def _target() -> DrafterTarget:
    import torch

    from dynaspec.model_arch import ModelArchConfig

    arch = ModelArchConfig("llama", 100, 32, 64, 2, 4, 2, 8)
    return DrafterTarget(arch, torch.device("cpu"), torch.float32)


def test_build_drafter_returns_a_proposer_with_capabilities():
    config = EngineConfig.from_kwargs(speculator="suffix", num_spec_tokens=3)
    built = build_drafter(config, _target())
    assert isinstance(built, DrafterBuild) and isinstance(built.proposer, Proposer)
    assert built.kv_tokens == 0 and built.proposer.k_limit is None
    assert built.proposer.cache_stats().requests == 0  # the suffix drafter keeps a global cache
    ngram = build_drafter(EngineConfig.from_kwargs(speculator="ngram", num_spec_tokens=3),
                          _target()).proposer
    assert ngram.cache_stats() is None and not ngram.uses_grammar
    assert not ngram.reads_hidden_states


def test_eagle_on_another_model_needs_a_head():
    config = EngineConfig.from_kwargs(model="/some/model.gguf", speculator="eagle")
    assert config.spec.num_spec_tokens == 3  # the depth the shipped head drafts
    with pytest.raises(ValueError, match="needs --draft-head DIR"):
        build_drafter(config, _target())


def test_attention_backends_load_from_the_registry():
    from dynaspec.attention.backend import get_backend

    assert get_backend("eager").name == "eager"
    assert reg.ATTENTION_BACKENDS.load("uniform").__name__ == "UniformDecodeBackend"
