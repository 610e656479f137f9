"""Engine flags come from the config dataclasses: one default and one help text per field."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from dynaspec.config import EngineConfig
from dynaspec.engine_flags import add_engine_args, engine_kwargs, parse_engine_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_defaults_round_trip_to_the_default_config():
    assert EngineConfig.from_kwargs(**engine_kwargs(_parser().parse_args([]))) == EngineConfig()


def test_every_config_field_is_a_flag_unless_marked_otherwise():
    dests = {a.dest for a in _parser()._actions}
    for cls in EngineConfig.parts().values():
        for f in fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
            assert (f.name in dests) == f.metadata.get("cli", True), f.name


def test_flags_parse_to_config_values_and_choices_come_from_the_registry():
    kw = parse_engine_args(
        [
            "--speculator",
            "ngram",
            "--num-spec-tokens",
            "3",
            "--no-prefix-caching",
            "--log-stats-interval",
            "2.5",
            "--dp-rank-timeout",
            "4",
        ]
    )
    config = EngineConfig.from_kwargs(**kw)
    assert config.spec.speculator == "ngram" and config.spec.num_spec_tokens == 3
    assert config.cache.enable_prefix_caching is False
    assert config.observability.log_stats_interval_s == 2.5
    assert config.parallel.dp_rank_timeout_s == 4.0
    action = next(a for a in _parser()._actions if a.dest == "speculator")
    assert tuple(action.choices) == ("none", "ngram", "draft", "suffix", "eagle", "hybrid",
                                    "oracle")


def test_a_three_state_switch_tells_not_given_from_off():
    # --draft-tree: None when not given (the engine's default, which may differ by model).
    assert parse_engine_args([])["draft_tree"] is None
    assert parse_engine_args(["--draft-tree"])["draft_tree"] is True
    assert parse_engine_args(["--no-draft-tree"])["draft_tree"] is False


def test_a_lookup_drafter_without_k_gets_the_default_cap_and_others_still_need_one():
    from dynaspec.config import LOOKUP_DEFAULT_K, SpecConfig

    for name in ("ngram", "suffix"):
        assert SpecConfig(speculator=name).num_spec_tokens == LOOKUP_DEFAULT_K
        assert SpecConfig(speculator=name, num_spec_tokens=3).num_spec_tokens == 3
    # a schedule sets its own maximum; a drafter that costs a model call still needs its K
    assert SpecConfig(speculator="ngram", k_schedule="[[1, 4, 2]]").num_spec_tokens == 0
    with pytest.raises(ValueError, match="needs --num-spec-tokens"):
        SpecConfig(speculator="draft", draft_model="d.gguf")


def test_every_default_on_switch_can_be_turned_off():
    """A field that defaults to True is a --no-x flag (a store_true --x could never turn it off:
    --grammar-drafts was one)."""
    assert parse_engine_args(["--no-grammar-drafts"])["grammar_drafts"] is False
    assert parse_engine_args([])["grammar_drafts"] is True
    for part in EngineConfig.parts().values():
        for f in (f for f in fields(part) if f.default is True and f.metadata.get("cli", True)):
            flag = f.metadata.get("flag", "")
            assert flag.startswith("--no-"), f"{f.name}: a default-on switch needs a --no- flag"
