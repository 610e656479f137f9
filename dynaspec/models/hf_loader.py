"""Loading a Hugging Face model folder: config.json, safetensors weights, tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from contextlib import ExitStack
from typing import Literal, overload

import torch
from safetensors import safe_open

from dynaspec.model_arch import ModelArchConfig
from dynaspec.models.load_types import (
    PICKLE_SUFFIXES,
    LoadedModel,
    ModelLoadError,
    collect_eos_ids,
    finalize_state_dict,
    pickle_refusal,
    progress,
    validate_arch,
)
from dynaspec.models.tokenizer import Tokenizer

_ARCH_CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def load_hf_folder(path: str) -> LoadedModel:
    config = _read_json(os.path.join(path, "config.json"), required=True)
    arch = validate_arch(arch_from_hf_config(config, path), path)
    tokenizer = load_hf_tokenizer(path)  # before the weights: a missing file fails fast
    tensors = _read_safetensors(_weight_files(path))
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exports store the tied copy too
    if arch.architecture == "gemma3":  # HF Gemma norms compute x * (1 + w); ours x * w
        tensors = {
            n: t.float() + 1.0 if n.endswith("norm.weight") else t for n, t in tensors.items()
        }
    state_dict = finalize_state_dict(tensors, arch, path)
    generation = _read_json(os.path.join(path, "generation_config.json"), required=False) or {}
    declared = _as_id_list(generation.get("eos_token_id")) or _as_id_list(
        config.get("eos_token_id")
    )
    eos_ids = collect_eos_ids(tokenizer, [*declared, tokenizer.eos_token_id])
    return LoadedModel(arch, state_dict, tokenizer, eos_ids, path)


@overload
def _read_json(path: str, required: Literal[True]) -> dict: ...
@overload
def _read_json(path: str, required: bool) -> dict | None: ...
def _read_json(path: str, required: bool) -> dict | None:
    if not os.path.exists(path):
        if required:
            folder = os.path.dirname(path)
            raise ModelLoadError(
                f"{folder}: no {os.path.basename(path)}; an HF model folder needs one"
            )
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot parse JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    if not isinstance(value, (int, float, str)):  # JSON dicts: int() would reject them too
        raise TypeError(f"eos_token_id must be an integer or a list of them, not {value!r}")
    return [int(value)]


def arch_from_hf_config(config: dict, source: str) -> ModelArchConfig:
    """Map an HF config.json (transformers 4.x or 5.x layout) onto ModelArchConfig."""
    arch = _architecture_name(config, source)
    extra = _gemma3_fields(config, source) if arch == "gemma3" else {}
    if arch != "gemma3" and config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"{source}: hidden_act {config['hidden_act']!r} is not supported (only silu)"
        )
    if config.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
    if config.get("use_sliding_window"):
        raise ModelLoadError(
            f"{source}: sliding-window attention (use_sliding_window=true) is not supported"
        )
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        # transformers' defaults when a key is absent: Qwen3 fixes head_dim at 128, others divide.
        default_head_dim = 128 if arch == "qwen3" else hidden // heads
        rope_theta, rope_scaling = (extra.pop("rope_theta"), extra.pop("rope_scaling")) if extra \
            else _rope_settings(config, source)
        return ModelArchConfig(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or default_head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(config.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3"),
            **extra,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{source}/config.json: missing key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}/config.json: bad value: {exc}") from exc


def _gemma3_fields(config: dict, source: str) -> dict:
    """Gemma-3's window pattern, per-kind RoPE and scales (transformers 5 and 4.x layouts)."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"{source}: Gemma-3 hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"
        )
    if config.get("attn_logit_softcapping"):
        raise ModelLoadError(f"{source}: attn_logit_softcapping is not supported")
    n = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    pattern = int(config.get("sliding_window_pattern") or 6)
    if kinds:  # the engine's pattern form: layer i is global iff (i + 1) % pattern == 0
        pattern = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
        want = [
            "full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n)
        ]
        if kinds != want:
            raise ModelLoadError(
                f"{source}: Gemma-3 layer_types that are not a repeating pattern are not supported"
            )
    params = config.get("rope_parameters") or {}
    full = params.get("full_attention") or {"rope_theta": config.get("rope_theta", 1e6),
                                           **(config.get("rope_scaling") or {})}
    local = params.get("sliding_attention") or {
        "rope_theta": config.get("rope_local_base_freq", 10000.0)
    }
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear") or local.get("rope_type", "default") != "default":
        raise ModelLoadError(
            f"{source}: Gemma-3 rope type {kind!r} is not supported (default, linear)"
        )
    scalar = config.get("query_pre_attn_scalar")
    return {
        "rope_theta": float(full.get("rope_theta", 1e6)),
        "rope_scaling": {"rope_type": "linear", "factor": float(full["factor"])}
        if kind == "linear"
        else None,
        "rope_local_theta": float(local.get("rope_theta", 10000.0)),
        "sliding_window": int(config["sliding_window"]) if config.get("sliding_window") else None,
        "sliding_window_pattern": pattern,
        "attn_scale": float(scalar) ** -0.5 if scalar else None,
        "final_logit_softcapping": float(config["final_logit_softcapping"])
        if config.get("final_logit_softcapping")
        else None,
    }


def _architecture_name(config: dict, source: str) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in _ARCH_CLASSES:
            return _ARCH_CLASSES[name]
    model_types = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
    if not names and config.get("model_type") in model_types:
        return model_types[config["model_type"]]
    shown = ", ".join(names) or f"model_type {config.get('model_type')!r}"
    raise ModelLoadError(
        f"{source}: unknown architecture {shown}; supported: {', '.join(_ARCH_CLASSES)}"
    )


def _rope_settings(config: dict, source: str) -> tuple[float, dict | None]:
    # transformers 5 writes rope_parameters (theta included); 4.x wrote rope_theta + rope_scaling.
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"{source}: rope scaling type {rope_type!r} is not supported (only llama3)"
        )
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_ROPE_KEYS}}


def _weight_files(path: str) -> list[str]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        index = _read_json(index_path, required=True) or {}
        names = sorted(set((index.get("weight_map") or {}).values()))
        if not names:
            raise ModelLoadError(f"{index_path}: empty weight_map")
        files = [os.path.join(path, n) for n in names]
        absent = [n for n in names if not os.path.exists(os.path.join(path, n))]
        if absent:
            raise ModelLoadError(
                f"{path}: shard(s) listed in the index are missing: {', '.join(absent)}"
            )
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    pickles = [f for f in sorted(os.listdir(path)) if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise pickle_refusal(os.path.join(path, pickles[0]))
    raise ModelLoadError(f"{path}: no weight files (*.safetensors) found")


def _read_safetensors(files: list[str]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = [(file, stack.enter_context(_open_safetensors(file))) for file in files]
        total = sum(len(handle.keys()) for _, handle in handles)
        pairs = ((file, handle, key) for file, handle in handles for key in handle.keys())
        for file, handle, key in progress(pairs, total, "loading weights"):
            try:
                tensors[key] = handle.get_tensor(key)
            except Exception as exc:  # safetensors raises its own error types for bad data
                raise ModelLoadError(
                    f"{file}: cannot read tensor {key!r} (corrupt or truncated?): {exc}"
                ) from exc
    return tensors


def _open_safetensors(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError / OSError for a bad header or a truncated file
        raise ModelLoadError(
            f"{file}: not a valid safetensors file (corrupt or truncated?): {exc}"
        ) from exc


def load_hf_tokenizer(path: str) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (chat template, special tokens, add_bos_token)."""
    import tokenizers

    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise ModelLoadError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(tok_path)
    except Exception as exc:
        raise ModelLoadError(f"{tok_path}: cannot parse tokenizer: {exc}") from exc
    tok_config = _read_json(os.path.join(path, "tokenizer_config.json"), required=False) or {}
    template = tok_config.get("chat_template")
    template_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(template_file):
        with open(template_file, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    add_bos = tok_config.get("add_bos_token")
    return Tokenizer(
        backend,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
        chat_template=template,
        add_bos_token=bool(add_bos) if add_bos is not None else None,
    )


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ..., ...}
        return value.get("content")
    return value if isinstance(value, str) else None
