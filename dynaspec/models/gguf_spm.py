"""SentencePiece-style GGUF vocabularies (`tokenizer.ggml.model == "llama"`: Gemma, Llama 2,
Mistral) as a `tokenizers` backend that gives llama.cpp's ids.

llama.cpp's SPM tokenizer escapes spaces as U+2581, then repeatedly merges the adjacent pair
whose concatenation is a vocabulary token of the highest score (leftmost on ties), and spells
characters outside the vocabulary as <0xXX> byte tokens. That is a BPE whose merges are every
split of every token into two tokens, ranked by the merged token's score: what this builds.
Control tokens match whole in text as special tokens, user-defined ones as plain added tokens
(llama.cpp splits both out before the merges run).
"""

from __future__ import annotations

from dynaspec.models.load_types import ModelLoadError

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a token, best merged-token score first.

    llama.cpp looks pieces up by text alone, whatever their type, so every token counts as a
    merge result except byte tokens (their text, e.g. '<0x41>', is never in a text's symbols).
    """
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)  # a repeated piece: llama.cpp's text->id map keeps the first
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] == _BYTE or len(t) < 2 or ids[t] != i:
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                # ties in score: the pair whose left piece is shorter first, then by ids
                ranked.append((-scores[i], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool,
              unk_id: int | None, path: str):
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as BackendTokenizer

    if not any(t == _BYTE for t in types):
        raise ModelLoadError(
            f"{path}: SentencePiece vocabulary without <0xXX> byte tokens is not supported"
        )
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types),
                                          unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(" "))
    backend.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL and t])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t])
    return backend
