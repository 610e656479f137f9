"""A GGUF file's tokenizer: tokenizer.ggml.* metadata -> a Tokenizer (byte-level BPE built here,
SentencePiece in gguf_spm.py) and the model's EOS ids, without reading the tensors."""

from __future__ import annotations

from functools import lru_cache
from typing import cast

from dynaspec.models.gguf_reader import GGUFMetadata, open_gguf
from dynaspec.models.gguf_spm import build_spm
from dynaspec.models.load_types import END_OF_TURN_TOKENS, ModelLoadError, collect_eos_ids
from dynaspec.models.tokenizer import Tokenizer

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


def load_gguf_tokenizer(path: str) -> tuple[Tokenizer, tuple[int, ...]]:
    """The tokenizer and EOS ids of a GGUF file, without reading its tensors."""
    return gguf_tokenizer(GGUFMetadata(open_gguf(path), path))


def gguf_tokenizer(meta: GGUFMetadata) -> tuple[Tokenizer, tuple[int, ...]]:
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
