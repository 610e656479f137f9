"""Loading a GGUF file (llama.cpp's format): metadata -> config, tensors -> float32 (or kept
quantized as QuantizedTensor: Q4_0/Q4_1/Q8_0, Q5_0/Q5_1, Q4_K/Q5_K/Q6_K), vocab -> tokenizer."""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import cast

import gguf
import numpy as np
import torch
from gguf import quants

from dynaspec.config import ModelArchConfig
from dynaspec.models.gguf_spm import build_spm
from dynaspec.models.loader import (
    END_OF_TURN_TOKENS,
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    ModelLoadError,
    collect_eos_ids,
    finalize_state_dict,
    progress,
    validate_arch,
)
from dynaspec.models.quant import KEPT_QUANTIZED, QuantizedTensor, from_gguf_blocks
from dynaspec.models.tokenizer import Tokenizer

log = logging.getLogger("dynaspec")
_REQUIRED = object()
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# Gemma's turn format (what its HF template renders; a system message joins the first user turn),
# for Gemma-3 files that carry no template.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

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

# Pre-tokenizer regexes, as llama.cpp applies them for each `tokenizer.ggml.pre` value.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_KINDS = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "smollm": "smollm",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "smaug-bpe": "llama3",
    "dbrx": "llama3", "falcon3": "llama3", "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}


def load_gguf_file(path: str, keep_quantized: bool = False) -> LoadedModel:
    """keep_quantized: 2-D weights of the types in quant.KEPT_QUANTIZED stay QuantizedTensors."""
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = validate_arch(arch_from_gguf(meta, reader), path)
    tokenizer, eos_ids = gguf_tokenizer(meta)
    tensors = _read_tensors(reader, arch, path, keep_quantized)
    state_dict = finalize_state_dict(tensors, arch, path)
    return LoadedModel(arch, state_dict, tokenizer, eos_ids, path)


def load_gguf_tokenizer(path: str) -> tuple[Tokenizer, tuple[int, ...]]:
    """The tokenizer and EOS ids of a GGUF file, without reading its tensors."""
    return gguf_tokenizer(_Metadata(_open(path), path))


def _open(path: str) -> gguf.GGUFReader:
    try:
        return _PlainArrayReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/... on a bad or cut file
        raise ModelLoadError(
            f"{path}: not a valid GGUF file (corrupt or truncated?): {exc}"
        ) from exc


class _PlainArrayReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    The reader slices its buffer about a million times for a 50k-token vocabulary, and each slice
    of an np.memmap runs a Python hook; a plain view of the same mapping parses ~3x faster and
    makes the tensor views faster to dequantize too. Nothing is copied.
    """

    # The base declares an np.memmap attribute; this is a plain ndarray view of that mapping.
    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = np.asarray(value)


class _Metadata:
    """Typed access to GGUF key/values, with errors that name the file and the key."""

    def __init__(self, reader, path: str) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: object = _REQUIRED):
        field = self._fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot read GGUF metadata {key!r}: {exc}") from exc


def arch_from_gguf(meta: _Metadata, reader) -> ModelArchConfig:
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


def _gemma3_fields(meta: _Metadata, arch: str) -> dict:
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


def gguf_tokenizer(meta: _Metadata) -> tuple[Tokenizer, tuple[int, ...]]:
    """The Tokenizer from tokenizer.ggml.* metadata (byte-level BPE or SentencePiece), and the
    model's EOS ids."""
    model = meta.get("tokenizer.ggml.model", None)
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if model == "gpt2":
        merges = list(meta.get("tokenizer.ggml.merges"))
        backend = _build_bpe(
            tokens, types, merges, meta.get("tokenizer.ggml.pre", "default"), meta.path
        )
        add_bos_default = False  # transformers and llama.cpp: no BOS for byte-level vocabularies
    elif model == "llama":
        scores = [float(x) for x in meta.get("tokenizer.ggml.scores")]
        backend = build_spm(
            tokens,
            scores,
            types,
            bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            meta.get("tokenizer.ggml.unknown_token_id", None),
            meta.path,
        )
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ModelLoadError(f"{meta.path}: GGUF tokenizer model {model!r} is not supported "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos", "eot", "eom")}
    token_text = {
        k: tokens[v] if v is not None and 0 <= v < len(tokens) else None for k, v in ids.items()
    }
    template = meta.get("tokenizer.chat_template", None)
    if template is None and meta.get("general.architecture", None) == "gemma3":
        template = GEMMA_TEMPLATE  # llama.cpp falls back to its built-in gemma format too
    tokenizer = Tokenizer(
        backend,
        bos_token=token_text["bos"],
        eos_token=token_text["eos"],
        chat_template=template,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
    )
    # Like llama.cpp, any control token spelled as a known end-of-turn marker also ends generation.
    control = {t for t, kind in zip(tokens, types) if kind == _CONTROL}
    extra = [t for t in END_OF_TURN_TOKENS if t in control]
    eos_ids = collect_eos_ids(tokenizer, [ids["eos"], ids["eot"], ids["eom"]], extra)
    return tokenizer, eos_ids


def _build_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str, path: str):
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as BackendTokenizer

    kind = _PRE_KINDS.get(pre)
    if kind is None:
        raise ModelLoadError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(sorted(_PRE_KINDS))}"
        )
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelled = [t if set(t) <= alphabet else _byte_level_spelling(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    # "left right"; a merge without a space is malformed and BPE rejects it
    pairs = cast(list[tuple[str, str]], [tuple(m.split(" ", 1)) for m in merges])
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=kind == "llama3",
        )
    )
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=kind in ("gpt2", "smollm")
    )
    if kind == "smollm":  # SmolLM's tokenizer splits every digit before the GPT-2 regex
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif kind == "gpt2":
        backend.pre_tokenizer = byte_level
    else:
        split = pre_tokenizers.Split(
            Regex(_LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT), behavior="isolated"
        )
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    if kind == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    # Control/user-defined tokens must match whole in text, never be cut by BPE. A control token
    # written outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocab.
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind_ in zip(tokens, types) if kind_ == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False)
            for t, s, kind_ in zip(tokens, spelled, types) if kind_ == _USER_DEFINED and t == s]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _byte_level_spelling(token: str) -> str:
    table = _byte_table()
    return "".join(table[b] for b in token.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_table() -> dict[int, str]:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
