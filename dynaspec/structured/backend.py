"""The grammar-backend seam: what the engine needs from a grammar library, and how to load one.

A backend compiles a `StructuredOutputParams` into a grammar, makes per-request matchers over it,
and applies token bitmasks to logits. Bitmasks are int32 tensors [rows, ceil(vocab / 32)]: bit
`t % 32` of word `t // 32` is 1 when token t is allowed (the layout xgrammar and llguidance
share). Only `load_backend` knows the library modules, and imports them lazily, so dynaspec
runs without the `structured` extra until a request asks for a grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dynaspec.structured_params import StructuredOutputParams

EXTRA_HINT = "pip install 'dynaspec[structured]'"


class GrammarCompileError(ValueError):
    """The schema, regex or grammar of a request does not compile; the message says why."""


class StructuredOutputUnavailable(ValueError):
    """The grammar library is not installed; the message names the extra to install."""


class Matcher(Protocol):
    """One request's grammar state. Not thread-safe: used by the engine thread only."""

    def accept(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def jump_forward_tokens(self) -> list[int]:
        """Tokens spelling the continuation the grammar forces from this state (empty where it
        forces nothing); the state is unchanged. The library's tokenization of that text, which
        may not be the one the model would choose."""
        ...


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, spec: StructuredOutputParams) -> object:
        """Thread-safe; raises GrammarCompileError naming the problem."""
        ...

    def matcher(self, compiled: object) -> Matcher: ...

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int] | None) -> None:
        """Set disallowed logits to -inf in place, in `rows` only (None: all).
        logits [R, vocab], bitmask [R, words]."""
        ...


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed (all bits set)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int] | None) -> None:
    """Device-agnostic masking in plain torch (for devices the library's kernel may not serve)."""
    idx = None if rows is None else torch.tensor(rows, dtype=torch.long, device=logits.device)
    bm = bitmask.to(logits.device) if idx is None else bitmask.to(logits.device)[idx]  # [G, words]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((bm.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [G, words * 32]
    allowed = allowed[:, : logits.shape[1]]  # [G, vocab]
    if idx is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def is_allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    # Python's >> on a negative int is arithmetic, so the sign bit (token 31 of a word) tests right.
    return (int(bitmask[row, token_id >> 5]) >> (token_id & 31)) & 1 == 1


def single_allowed(bitmask: torch.Tensor, row: int) -> int | None:
    """The one token row `row` allows, or None where it allows none or several."""
    words = bitmask[row]  # [words] int32
    nonzero = torch.nonzero(words).flatten()
    if nonzero.numel() != 1:
        return None
    w = int(nonzero[0])
    bits = int(words[w]) & 0xFFFFFFFF  # the word as unsigned: bit 31 is token 32w + 31
    if bits & (bits - 1):
        return None
    return 32 * w + bits.bit_length() - 1


def load_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 any_whitespace: bool) -> GrammarBackend:
    """Build the named backend; a missing library raises StructuredOutputUnavailable."""
    from dynaspec.registry import STRUCTURED_BACKENDS

    STRUCTURED_BACKENDS.check(name)
    try:
        backend_cls = STRUCTURED_BACKENDS.load(name)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in ("xgrammar", "tvm_ffi"):
            raise  # a bug of ours, not a missing library
        raise StructuredOutputUnavailable(
            f"structured output needs the xgrammar package ({exc}); install it with: {EXTRA_HINT}"
        ) from None
    return backend_cls(tokenizer, vocab_size, stop_token_ids, any_whitespace)
