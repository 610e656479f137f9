"""Loading a GGUF file (llama.cpp's format): metadata -> config, tensors -> float32 (or kept
quantized as QuantizedTensor: Q4_0/Q4_1/Q8_0, Q5_0/Q5_1, Q4_K/Q5_K/Q6_K); the vocab -> tokenizer
is gguf_tokenizer.py, the file and its metadata gguf_reader.py."""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import quants

from dynaspec.model_arch import ModelArchConfig
from dynaspec.models.gguf_reader import GGUFMetadata, open_gguf
from dynaspec.models.gguf_tokenizer import gguf_tokenizer
from dynaspec.models.load_types import (
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    ModelLoadError,
    finalize_state_dict,
    progress,
    validate_arch,
)
from dynaspec.models.quant import KEPT_QUANTIZED, QuantizedTensor, from_gguf_blocks

log = logging.getLogger("dynaspec")

# GGUF per-layer tensor names -> HF names (the "blk.N." prefix becomes "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma-3 sandwiches each block in norms: its ffn_norm is the pre-MLP norm, not Llama's
# post-attention one.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GEMMA3_SWA_PATTERN = 6  # llama.cpp's default for gemma3 files: every 6th layer is global
_GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's RoPE base for gemma3 local layers (not in the file)

def load_gguf_file(path: str, keep_quantized: bool = False) -> LoadedModel:
    """keep_quantized: 2-D weights of the types in quant.KEPT_QUANTIZED stay QuantizedTensors."""
    reader = open_gguf(path)
    meta = GGUFMetadata(reader, path)
    arch = validate_arch(arch_from_gguf(meta, reader), path)
    tokenizer, eos_ids = gguf_tokenizer(meta)
    tensors = _read_tensors(reader, arch, path, keep_quantized)
    state_dict = finalize_state_dict(tensors, arch, path)
    return LoadedModel(arch, state_dict, tokenizer, eos_ids, path)


def arch_from_gguf(meta: GGUFMetadata, reader) -> ModelArchConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    extra = _gemma3_fields(meta, arch) if arch == "gemma3" else {}
    if "rope_scaling" in extra:
        scaling = "none"  # linear scaling of Gemma-3's global layers: handled
    if scaling not in ("none", None) or "rope_freqs.weight" in names:
        # llama.cpp bakes llama3.1-style scaling into a rope_freqs tensor whose parameters the
        # file does not keep; running without it would give silently wrong long-context output.
        kind = scaling if scaling not in ("none", None) else "rope_freqs (llama3.1)"
        raise ModelLoadError(
            f"{meta.path}: GGUF rope scaling {kind!r} is not supported; load the HF folder instead"
        )
    hidden = int(meta.get(f"{arch}.embedding_length"))
    heads = int(meta.get(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{meta.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens", None)
    vocab = len(tokens) if tokens else int(meta.get(f"{arch}.vocab_size"))
    return ModelArchConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.get(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        qk_norm=arch in ("qwen3", "gemma3"),
        **extra,
    )


def _gemma3_fields(meta: GGUFMetadata, arch: str) -> dict:
    """Gemma-3's attention pattern, RoPE bases and scales, with llama.cpp's defaults where the
    file is silent (it stores neither the local RoPE base nor the layer pattern)."""
    out: dict = {"rope_local_theta": _GEMMA3_LOCAL_THETA}
    window = meta.get(f"{arch}.attention.sliding_window", None)
    if window is not None:
        out["sliding_window"] = int(window)
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
        if not isinstance(pattern, int):
            raise ModelLoadError(
                f"{meta.path}: a per-layer sliding_window_pattern array is not supported"
            )
        out["sliding_window_pattern"] = pattern
    if meta.get(f"{arch}.rope.scaling.type", "none") == "linear":
        out["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(meta.get(f"{arch}.rope.scaling.factor")),
        }
    cap = meta.get(f"{arch}.final_logit_softcapping", None)
    out["final_logit_softcapping"] = float(cap) if cap else None
    if int(meta.get(f"{arch}.block_count")) == 62:  # llama.cpp: 27B scales by hidden/heads
        hidden, heads = (
            int(meta.get(f"{arch}.embedding_length")),
            int(meta.get(f"{arch}.attention.head_count")),
        )
        out["attn_scale"] = (hidden // heads) ** -0.5
    return out


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name for a GGUF tensor name; None for tensors the model does not use."""
    parts = gguf_name.split(".")
    layer_names = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def _read_tensors(reader, arch: ModelArchConfig, path: str, keep_quantized: bool) -> dict:
    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    dequantized: set[str] = set()
    for tensor in progress(reader.tensors, len(reader.tensors), "loading weights"):
        name = hf_tensor_name(tensor.name, arch.architecture)
        if name is None:  # e.g. rope_freqs or tensors of other heads: not part of this model
            continue
        kind = tensor.tensor_type.name
        weight: torch.Tensor | QuantizedTensor
        if keep_quantized and kind in KEPT_QUANTIZED and len(tensor.shape) == 2:
            weight = _quantized(tensor, path)
        else:
            weight = _dequantize(tensor, path)
            if keep_quantized and kind not in ("F32", "F16", "BF16") and len(tensor.shape) == 2:
                dequantized.add(kind)
        # Only llama-arch files are permuted; llama.cpp runs qwen2/qwen3 with NEOX-style RoPE.
        if arch.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = arch.num_attention_heads if ".q_proj." in name else arch.num_key_value_heads
            weight = _unpermute(weight, heads)
        out[name] = weight
    if dequantized:
        log.info("%s: GGUF types %s have no weight-only kernel here; those weights are dequantized",
                 path, ", ".join(sorted(dequantized)))
    return out


def _unpermute(
    weight: torch.Tensor | QuantizedTensor, heads: int
) -> torch.Tensor | QuantizedTensor:
    if isinstance(weight, QuantizedTensor):  # rows are whole blocks: reorder them, not the values
        order = unpermute_qk(torch.arange(weight.shape[0])[:, None], heads)[:, 0]
        return weight.rows(order)
    return unpermute_qk(weight, heads)


def _quantized(tensor, path: str) -> QuantizedTensor:
    k, n = (int(d) for d in tensor.shape.tolist())  # GGUF lists [K, N]; called for 2-D only
    try:
        return from_gguf_blocks(np.asarray(tensor.data), tensor.tensor_type.name, (n, k))
    except ValueError as exc:  # a short read of a truncated file shows up as a reshape error
        raise ModelLoadError(
            f"{path}: cannot read tensor {tensor.name!r} (corrupt or truncated?): {exc}"
        ) from exc


def _dequantize(tensor, path: str) -> torch.Tensor:
    kind = tensor.tensor_type
    try:
        values = quants.dequantize(tensor.data, kind)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} has GGUF type {kind.name}, which cannot be dequantized"
        ) from exc
    except Exception as exc:  # a short read of a truncated file shows up here as a shape error
        raise ModelLoadError(
            f"{path}: cannot read tensor {tensor.name!r} (corrupt or truncated?): {exc}"
        ) from exc
    if values.dtype != np.float32:  # quants keeps integer types (I8/I32...) as integers
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} has GGUF type {kind.name}, which is not a float weight"
        )
    # GGUF lists dimensions fastest-first; torch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if not values.flags.writeable:  # F32 tensors are views of the read-only file mapping
        values = values.copy()
    try:
        return torch.from_numpy(np.ascontiguousarray(values).reshape(shape))
    except ValueError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} data does not fit shape {shape}: {exc}"
        ) from exc


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time q/k row permutation (interleaved RoPE -> HF's rotate_half).

    llama.cpp stores w.reshape(n_head, 2, d/2, *rest).swapaxes(1, 2).reshape(w.shape), for weights
    and biases alike; this is the inverse.
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)
    )
