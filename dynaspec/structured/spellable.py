"""The characters a vocabulary cannot spell, so grammars that need one are refused up front.

A byte-level vocabulary spells a character when a token exists for each byte of its UTF-8 form;
a byte-fallback one when the character is a piece or each byte has a `<0xNN>` token. SmolLM2's
vocabulary lacks six control characters (U+0004, U+0006, U+0013, U+0014, U+0016, U+001D) and
the lead bytes of U+40000..U+BFFFF: a `choice` or a regex that needs one of them has no token to
continue with (a grammar dead end). The published schema excludes them from those fields
(`pattern_class`) and the server checks the same set (`first_unspellable`).
"""

from __future__ import annotations

import json
from functools import lru_cache

Ranges = tuple[tuple[int, int], ...]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level vocabularies store)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _missing_bytes(tokenizer) -> tuple[set[int], bool] | None:
    """(bytes no token spells, whether single-character pieces also spell characters), or None
    when the vocabulary is neither byte-level nor byte-fallback (nothing known: nothing
    refused)."""
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return {b for b, ch in _byte_chars().items() if tokenizer.token_to_id(ch) is None}, False
    if "ByteFallback" in kinds:
        return {b for b in range(256) if tokenizer.token_to_id(f"<0x{b:02X}>") is None}, True
    return None


def _to_ranges(cps: list[int]) -> Ranges:
    out: list[tuple[int, int]] = []
    for cp in cps:
        if out and out[-1][1] == cp - 1:
            out[-1] = (out[-1][0], cp)
        else:
            out.append((cp, cp))
    return tuple(out)


@lru_cache(maxsize=4)
def _ranges_for(missing: frozenset[int], pieces: frozenset[str]) -> Ranges:
    if not missing:
        return ()
    ascii_only = all(b < 0x80 or b in (0xC0, 0xC1) or b >= 0xF5 for b in missing)
    top = 0x80 if ascii_only else 0x110000  # bytes never in UTF-8 (C0, C1, F5+) spell nothing
    bad = [cp for cp in range(top) if not 0xD800 <= cp <= 0xDFFF and chr(cp) not in pieces
           and not missing.isdisjoint(chr(cp).encode())]
    return _to_ranges(bad)


def unspellable_ranges(tokenizer) -> Ranges:
    """Code point ranges (inclusive) no token sequence of `tokenizer` decodes to."""
    found = _missing_bytes(tokenizer)
    if found is None or not found[0]:
        return ()
    missing, by_piece = found
    pieces: frozenset[str] = frozenset()
    if by_piece:  # a character that is a piece of its own needs no byte tokens
        pieces = frozenset(t for t in map(tokenizer.id_to_token, range(tokenizer.vocab_size))
                           if t and len(t) == 1)
    return _ranges_for(frozenset(missing), pieces)


def first_unspellable(text: str, ranges: Ranges) -> str | None:
    for ch in text:
        cp = ord(ch)
        if any(lo <= cp <= hi for lo, hi in ranges):
            return ch
    return None


def pattern_class(ranges: Ranges) -> str:
    """The ranges as the inside of a regex character class, with literal characters (read the
    same by ECMA-262 with the u flag, Python's re and Rust's regex)."""
    def esc(cp: int) -> str:
        ch = chr(cp)
        return "\\" + ch if ch in "\\]-^[" else ch
    return "".join(esc(lo) if lo == hi else f"{esc(lo)}-{esc(hi)}" for lo, hi in ranges)
