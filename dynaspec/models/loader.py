"""Model file loading: one entry point for HF folders, GGUF files and the bundled default model.

Every format ends in the same LoadedModel: an architecture config, float32 CPU tensors under HF
parameter names, a Tokenizer and the EOS ids. The model code never sees file formats.
Only safetensors and GGUF are read; pickle-based checkpoints can execute code on load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from dynaspec.model_arch import ModelArchConfig

if TYPE_CHECKING:
    from dynaspec.models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Tokens that end a turn in common chat formats. When a model's chat template ends turns with
# one, generation must stop on it too, even if the config only names the end-of-text token.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)

_T = TypeVar("_T")


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the file and what is wrong with it."""


@dataclass
class LoadedModel:
    arch: ModelArchConfig
    # float32 (or QuantizedTensor when loaded with keep_quantized), CPU, HF names; no
    # lm_head.weight when tied
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    source: str  # resolved path of the folder or file that was loaded


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


def pickle_refusal(path: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is a pickle-based checkpoint (.bin/.pt); only safetensors and GGUF files are "
        f"loaded, "
        "because unpickling can run arbitrary code. Convert it to safetensors first."
    )


def expected_tensor_names(arch: ModelArchConfig) -> list[str]:
    """Every parameter the model code needs, under HF names."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if arch.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if arch.architecture == "gemma3":
            names += [
                p + "pre_feedforward_layernorm.weight",
                p + "post_feedforward_layernorm.weight",
            ]
    return names


def expected_shape(name: str, arch: ModelArchConfig) -> tuple[int, ...]:
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    table = {
        "embed_tokens.weight": (arch.vocab_size, h),
        "lm_head.weight": (arch.vocab_size, h),
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "o_proj.weight": (h, q),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "q_norm.weight": (hd,),
        "k_norm.weight": (hd,),
        "gate_proj.weight": (inter, h),
        "up_proj.weight": (inter, h),
        "down_proj.weight": (h, inter),
    }
    key = ".".join(name.split(".")[-2:])
    return table.get(key, (h,))  # the remaining tensors are the hidden-size RMSNorm weights


def finalize_state_dict(
    tensors: dict[str, torch.Tensor], arch: ModelArchConfig, source: str
) -> dict[str, torch.Tensor]:
    """Keep exactly the expected tensors, as contiguous float32 (QuantizedTensors as they are),
    after checking names and shapes."""
    out: dict[str, torch.Tensor] = {}
    for name in expected_tensor_names(arch):
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(
                f"{source}: missing tensor {name!r} (architecture {arch.architecture})"
            )
        want = expected_shape(name, arch)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, config implies {want}"
            )
        quantized = not isinstance(tensor, torch.Tensor)  # a QuantizedTensor, already in its form
        out[name] = tensor if quantized else tensor.to(torch.float32).contiguous()
    return out


def progress(items: Iterable[_T], total: int, desc: str) -> Iterator[_T]:
    """A tqdm bar on an interactive terminal; plain iteration in logs and tests."""
    if not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit="tensor", leave=False)


def collect_eos_ids(
    tokenizer: Tokenizer, declared: Iterable[int | None], extra_tokens: Iterable[str] = ()
) -> tuple[int, ...]:
    """All ids that end generation: declared ids first, then turn-end tokens the template uses."""
    ids: list[int] = []
    for token_id in declared:
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    template = tokenizer.chat_template or ""
    candidates = [t for t in END_OF_TURN_TOKENS if t in template] + list(extra_tokens)
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def validate_arch(arch: ModelArchConfig, source: str) -> ModelArchConfig:
    """Reject configs whose numbers cannot describe a working model, before reading weights."""
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim"):
        value = getattr(arch, field)
        if not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{source}: {field} must be a positive integer, got {value!r}")
    if arch.num_attention_heads % arch.num_key_value_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({arch.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({arch.num_key_value_heads})"
        )
    return arch
