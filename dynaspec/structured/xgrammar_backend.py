"""xgrammar as the grammar backend: the ONLY dynaspec module that imports xgrammar.

The tokenizer info is built from our own tokenizer (no transformers object needed): the vocab
strings as the tokenizer stores them, the vocab type from its decoder (byte-level BPE, byte
fallback, or raw), and special tokens mapped to "" so xgrammar treats them as never-text (a
`<|im_start|>` must not count as the characters "<|im_start|>" inside a JSON string).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import torch
import xgrammar as xgr

from dynaspec.structured.backend import GrammarCompileError, apply_bitmask_torch
from dynaspec.structured_params import StructuredOutputParams

# "[08:59:19] /project/cpp/regex_converter.cc:94: " in front of every xgrammar error.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _vocab_type(tokenizer) -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) read from the tokenizer's decoder chain."""
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK, "Strip" in kinds
    return xgr.VocabType.RAW, False


def _encoded_vocab(tokenizer, vocab_size: int) -> list[str]:
    n = min(tokenizer.vocab_size, vocab_size)
    vocab = [tokenizer.id_to_token(i) or "" for i in range(n)]
    for i, added in tokenizer.backend.get_added_tokens_decoder().items():
        if added.special and i < n:
            vocab[i] = ""
    return vocab


class _XMatcher:
    __slots__ = ("_m",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def jump_forward_tokens(self) -> list[int]:
        return list(self._m.find_jump_forward_tokens())


class XGrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 any_whitespace: bool) -> None:
        vocab_type, prefix_space = _vocab_type(tokenizer)
        info = xgr.TokenizerInfo(_encoded_vocab(tokenizer, vocab_size), vocab_type=vocab_type,
                                 vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                                 add_prefix_space=prefix_space)
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace

    def compile(self, spec: StructuredOutputParams) -> xgr.CompiledGrammar:
        form = spec.form  # the one form given: its field is set (StructuredOutputParams checks)
        try:
            if form == "json":
                assert spec.json is not None
                return self.compiler.compile_json_schema(
                    spec.json, any_whitespace=self.any_whitespace, strict_mode=True)
            if form == "json_object":  # OpenAI's json_object: any JSON object
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=self.any_whitespace)
            if form == "regex":
                assert spec.regex is not None
                return self.compiler.compile_regex(spec.regex)
            if form == "grammar":
                assert spec.grammar is not None
                return self.compiler.compile_grammar(spec.grammar)
            # choice: JSON string escapes (\" \\ \n \uXXXX) are valid EBNF literal escapes.
            rule = " | ".join(json.dumps(c) for c in spec.choice or ())
            return self.compiler.compile_grammar(f"root ::= {rule}")
        except RuntimeError as exc:
            msg = _LOG_PREFIX.sub("", str(exc).strip()).strip()
            raise GrammarCompileError(f"the {_NAMES[form]} does not compile: {msg}") from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> _XMatcher:
        return _XMatcher(xgr.GrammarMatcher(compiled))

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int] | None) -> None:
        if logits.device.type != "cpu":  # xgrammar's GPU kernels need triton or a JIT build
            apply_bitmask_torch(logits, bitmask, rows)
            return
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
          "grammar": "grammar", "choice": "choice list"}
