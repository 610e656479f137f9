"""What every model loader shares: the error, the LoadedModel every format ends in, and the
checks on a config and a state dict.

The loaders (hf_loader.py, gguf_loader.py and their readers) import this module; loader.py, the
one entry point, imports the loaders. Nothing here imports a loader, so the imports run one way.
"""

from __future__ import annotations

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
