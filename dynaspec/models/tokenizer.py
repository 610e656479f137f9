"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer`, plus chat templates and streaming decode.

The loaders (hf_loader, gguf_tokenizer) build the backend; this module only knows how to use it, so
the engine sees one tokenizer type whatever file format the model came from.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache

import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# How many prompt tokens an IncrementalDetokenizer keeps as context: enough for decoders whose
# output depends on the previous token (a leading space, a byte sequence split over tokens).
_DETOKENIZE_CONTEXT = 6
_REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """A chat template raised (via raise_exception) or the model has no template."""


class Tokenizer:
    """Encode/decode and chat-template rendering for one model.

    add_bos_token: None leaves special-token insertion to the backend's own post-processor (what a
    tokenizer.json says); True/False is an explicit model setting (tokenizer_config.json or GGUF
    metadata) and replaces the post-processor so encode() adds BOS exactly when the model says so.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        extra_template_vars: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._template_vars = dict(extra_template_vars or {})
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        if add_bos_token is not None:
            self._set_bos_policy(add_bos_token)
        self.add_bos_token = add_bos_token

    # -- basic properties -------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's embedding may be
        larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _set_bos_policy(self, add_bos: bool) -> None:
        if add_bos and self.bos_token_id is None:
            raise ValueError(
                f"add_bos_token is set but the BOS token {self.bos_token!r} is not in the "
                f"vocabulary"
            )
        if add_bos:
            bos = self.bos_token
            self._backend.post_processor = tokenizers.processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, self.bos_token_id)],
            )
        else:
            # An explicit "no BOS" beats a tokenizer.json template that would add one.
            self._backend.post_processor = None

    # -- encode / decode --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A rendered chat template already starts with the BOS token (Gemma's, Llama 3's): a
        # second one would change the prompt (HF tokenizes templates without special tokens).
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token
            and text.startswith(self.bos_token)
        ):
            add_special_tokens = False
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if ids and min(ids) < 0:  # the backend would raise an opaque OverflowError
            raise ValueError(
                f"cannot decode negative token id {min(ids)} (padding must not reach decode)"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: object
    ) -> str:
        """Render messages with the model's Jinja template, with the variables HF templates
        expect."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        template = _compile_template(self.chat_template)
        variables: dict[str, object] = dict(self._template_vars)
        variables.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        variables.update(kwargs)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same as transformers' filter: jinja's own tojson escapes HTML characters, which changes
    # prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): render the body as
    is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=16)
def _compile_template(source: str):
    # trim_blocks/lstrip_blocks and the helpers below are what HF templates are written against.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Decodes a small window of ids (the last emitted ones as context plus the pending ones) and
    emits only the new suffix, and only once it does not end in U+FFFD: a multi-byte character
    split across tokens stays pending until its last byte arrives. Concatenating every delta
    and flush() gives the same text as decoding all fed ids at once.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_DETOKENIZE_CONTEXT:]) if prompt_ids else []
        self._prefix = 0  # start of the context window within _ids
        self._read = len(self._ids)  # ids before this index have been emitted
        self.text = ""

    def feed(self, new_ids: Iterable[int]) -> str:
        """Add token ids; return the text that became final (possibly "")."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        # The emitted ids become the next context; older ids are no longer needed.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: emit whatever is pending, even an incomplete character (as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""
