"""Whether an engine's drafts run as token trees (docs/design.md §4c), decided once at build.

A tree verifies only on an attention backend that applies the tree mask (`verifies_trees`),
and on a model with sliding-window layers (Gemma-3) only where the backend also windows a tree's
rows by their depth, not their row index (`tree_windows`). Elsewhere an explicit `--draft-tree`
is refused before any request runs, naming both parts; a tree setting that was not asked for
(`draft_tree=None` under a default of trees) falls back to chains.
"""

from __future__ import annotations

import logging

from dynaspec.attention.backend import AttentionBackend
from dynaspec.config import DRAFT_TREE_DEFAULT, SpecConfig
from dynaspec.model_arch import ModelArchConfig

log = logging.getLogger("dynaspec")

TREE_SPECULATORS = ("ngram", "suffix", "hybrid")
TREES_BY_DEFAULT = ("hybrid",)  # drafters whose point is the tree: trees unless told otherwise


def model_window(arch: ModelArchConfig) -> int | None:
    """The model's sliding window when some layer has one, else None."""
    windows = [w for i in range(arch.num_hidden_layers) if (w := arch.layer_window(i))]
    return min(windows, default=None)


def resolve_draft_tree(spec: SpecConfig, arch: ModelArchConfig, attn: AttentionBackend) -> bool:
    """The tree setting the engine runs with. `attn`: the attention backend the model's layers
    will call (after any swap the model makes). ValueError for an explicit --draft-tree that
    this model and backend cannot verify."""
    explicit = spec.draft_tree is not None
    wanted = spec.draft_tree if explicit else (
        spec.speculator in TREES_BY_DEFAULT
        or (DRAFT_TREE_DEFAULT and spec.speculator in TREE_SPECULATORS))
    if not wanted:
        return False
    name = getattr(attn, "name", type(attn).__name__)
    window = model_window(arch)
    if not getattr(attn, "verifies_trees", False):
        # A backend that ignores the tree mask would let a row see its sibling branches: wrong
        # tokens, not an error (the GPU backends today).
        why = (f"the {name} attention backend does not apply token-tree masks (a tree's rows "
               "would see their sibling branches)")
    elif window is None or getattr(attn, "tree_windows", False):
        return True
    else:
        why = (f"this model's sliding-window layers (window {window}) need token-tree rows "
               f"windowed by depth, which the {name} attention backend does not do")
    if explicit:
        raise ValueError(f"--draft-tree cannot run here: {why}; drop --draft-tree (chains) or "
                         "pass --attention-backend eager")
    log.info("draft trees off (chains): %s", why)
    return False
