"""Whether drafts run as trees: refused up front where a sliding-window model's backend cannot
window a tree's rows, a default falls back to chains there (dynaspec/engine/tree_setting.py)."""

from __future__ import annotations

import logging

import pytest

from dynaspec.attention.backend import get_backend
from dynaspec.config import SpecConfig
from dynaspec.engine import tree_setting
from dynaspec.engine.tree_setting import model_window, resolve_draft_tree
from dynaspec.model_arch import ModelArchConfig
from dynaspec.models.gemma3 import model_attention


def _arch(architecture="gemma3", window=None, pattern=6, layers=6) -> ModelArchConfig:
    return ModelArchConfig(architecture, 64, 32, 64, layers, 2, 1, 16, sliding_window=window,
                           sliding_window_pattern=pattern)


class RowWindowed:
    """A backend whose windows count rows (as the in-place CPU kernel's do)."""

    name = "cpu_paged"
    verifies_trees = True
    tree_windows = False

    def forward(self, q, k, v, kv_cache, md, scale, window=None):
        raise AssertionError("not called")


class NoWindow:
    name = "plain"

    def forward(self, q, k, v, kv_cache, md, scale):
        raise AssertionError("not called")


def _spec(tree) -> SpecConfig:
    return SpecConfig(speculator="suffix", num_spec_tokens=4, draft_tree=tree)


def test_model_window_is_the_smallest_layer_window():
    assert model_window(_arch(window=None)) is None
    assert model_window(_arch(window=512)) == 512
    assert model_window(_arch(window=512, pattern=1)) is None  # every layer global


def test_explicit_tree_on_a_windowed_model_is_refused_naming_both_parts():
    with pytest.raises(ValueError) as err:
        resolve_draft_tree(_spec(True), _arch(window=512), RowWindowed())
    msg = str(err.value)
    assert "--draft-tree" in msg and "sliding-window layers (window 512)" in msg
    assert "cpu_paged" in msg and "--attention-backend eager" in msg


def test_trees_run_where_the_backend_windows_them_or_no_layer_has_a_window():
    assert resolve_draft_tree(_spec(True), _arch(window=512), get_backend("eager")) is True
    assert resolve_draft_tree(_spec(True), _arch("llama"), RowWindowed()) is True
    assert resolve_draft_tree(_spec(False), _arch(window=512), RowWindowed()) is False
    # A backend without windows: Gemma-3's layers run the eager one, which windows trees.
    layers = model_attention(_arch(window=512), NoWindow())
    assert resolve_draft_tree(_spec(True), _arch(window=512), layers) is True


def test_a_default_of_trees_falls_back_to_chains_where_they_cannot_run(monkeypatch, caplog):
    assert resolve_draft_tree(_spec(None), _arch(window=512), RowWindowed()) is False
    monkeypatch.setattr(tree_setting, "DRAFT_TREE_DEFAULT", True)
    with caplog.at_level(logging.INFO, logger="dynaspec"):
        assert resolve_draft_tree(_spec(None), _arch(window=512), RowWindowed()) is False
    assert "draft trees off (chains)" in caplog.text and "window 512" in caplog.text
    assert resolve_draft_tree(_spec(None), _arch(window=512), get_backend("eager")) is True
    assert resolve_draft_tree(_spec(None), _arch("llama"), RowWindowed()) is True
    none = SpecConfig(speculator="none", draft_tree=None)  # no drafter that drafts trees
    assert resolve_draft_tree(none, _arch("llama"), RowWindowed()) is False


def test_the_hybrid_drafts_trees_unless_told_not_to_or_they_cannot_run():
    hybrid = SpecConfig(speculator="hybrid", draft_tree=None)
    assert hybrid.eagle_lookup == "suffix"  # its lookup when none is named
    assert resolve_draft_tree(hybrid, _arch("llama"), RowWindowed()) is True  # no default needed
    assert resolve_draft_tree(SpecConfig(speculator="hybrid", draft_tree=False), _arch("llama"),
                              RowWindowed()) is False
    assert resolve_draft_tree(hybrid, _arch("llama"), MaskBlind()) is False  # chains, not refused


class MaskBlind:
    """A backend that ignores tree masks (as the GPU backends do today)."""

    name = "gpu_paged"

    def forward(self, q, k, v, kv_cache, md, scale, window=None):
        raise AssertionError("not called")


def test_a_backend_that_ignores_tree_masks_never_verifies_a_tree(monkeypatch):
    with pytest.raises(ValueError, match="gpu_paged attention backend does not apply token-tree"):
        resolve_draft_tree(_spec(True), _arch("llama"), MaskBlind())
    monkeypatch.setattr(tree_setting, "DRAFT_TREE_DEFAULT", True)
    assert resolve_draft_tree(_spec(None), _arch("llama"), MaskBlind()) is False
    assert resolve_draft_tree(_spec(False), _arch("llama"), MaskBlind()) is False
