"""Model file loading: one entry point for HF folders, GGUF files and the bundled default model.

Every format ends in the same LoadedModel: an architecture config, float32 CPU tensors under HF
parameter names, a Tokenizer and the EOS ids. The model code never sees file formats.
Only safetensors and GGUF are read; pickle-based checkpoints can execute code on load.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dynaspec.models.load_types import (
    PICKLE_SUFFIXES,
    LoadedModel,
    ModelLoadError,
    pickle_refusal,
)

if TYPE_CHECKING:
    from dynaspec.models.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "load_model_files", "load_tokenizer",
           "resolve_model_path", "sniff_file_kind"]


def load_model_files(model: str, keep_quantized: bool = False) -> LoadedModel:
    """Load "default", "gemma3-270m", an HF folder (config.json + safetensors) or a .gguf file.

    keep_quantized: a GGUF's Q4_0/Q4_1/Q8_0 matrices stay QuantizedTensors (models/quant.py)
    instead of being dequantized to float32.
    """
    path, kind = resolve_model_path(model)
    if kind == "hf":
        from dynaspec.models.hf_loader import load_hf_folder

        return load_hf_folder(path)
    from dynaspec.models.gguf_loader import load_gguf_file

    return load_gguf_file(path, keep_quantized)


def load_tokenizer(model: str) -> Tokenizer:
    """Only the tokenizer of a model (as load_model_files would build it), without the weights."""
    path, kind = resolve_model_path(model)
    if kind == "hf":
        from dynaspec.models.hf_loader import load_hf_tokenizer

        return load_hf_tokenizer(path)
    from dynaspec.models.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(path)[0]


def resolve_model_path(model: str) -> tuple[str, str]:
    """(resolved path, "hf" | "gguf") for a model argument, or a ModelLoadError saying why not."""
    if model == "default":
        from dynaspec.models.default_model import default_model_path

        model = default_model_path()
    elif model == "gemma3-270m":
        from dynaspec.models.default_model import gemma3_270m_path

        model = gemma3_270m_path()
    path = os.path.realpath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {model!r} does not exist")
    if os.path.isdir(path):
        return path, "hf"
    kind = sniff_file_kind(path)
    if kind == "gguf":
        return path, "gguf"
    if kind == "pickle":
        raise pickle_refusal(path)
    if os.path.basename(path) == "config.json" or path.endswith(".safetensors"):
        raise ModelLoadError(
            f"{path}: pass the folder that holds config.json and the weights, not one file"
        )
    raise ModelLoadError(
        f"{path}: not a model this engine loads; give an HF folder (config.json + *.safetensors) "
        f"or a .gguf file"
    )


def sniff_file_kind(path: str) -> str:
    """'gguf', 'pickle' or 'unknown', from the magic bytes first and the suffix second."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if head == b"GGUF" or path.endswith(".gguf"):
        return "gguf"
    # torch.save writes a zip archive (PK) or a raw pickle (protocol byte 0x80).
    if path.endswith(PICKLE_SUFFIXES) or head[:2] == b"PK" or head[:1] == b"\x80":
        return "pickle"
    return "unknown"
