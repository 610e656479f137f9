"""Generators for the grammar string formats /openapi.json declares (server/structured_body.py).

JSON Schema cannot say which strings are grammars that compile, so the schema names each
language in `format` and a fuzzer needs a generator per format, as OpenAPI intends for custom
formats; without one schemathesis would send arbitrary text as "valid" grammars and count the
400 a bad grammar deserves as a rejected valid request. `regex` needs none: schemathesis'
built-in generator for JSON Schema's `regex` format builds patterns from atoms xgrammar reads.

Used by the `fuzz` reliability scenario and by scripts/clients/fuzz_hooks.py (`register()`).
Every value is meant to compile: tests/unit/test_fuzz_formats.py compiles a few hundred draws.
"""

from __future__ import annotations

import json
from typing import Any

from dynaspec.server.structured_body import EBNF_FORMAT, JSON_SCHEMA_TEXT_FORMAT

_CLASSES = ("[a-z]", "[0-9]", "[A-Za-z_]", "[^\\n]", "[ \\t]", "[-+.]")
_QUANTIFIERS = ("", "", "*", "+", "?")
_TYPES = ("string", "integer", "number", "boolean", "null")


def _chars(st: Any) -> Any:
    # BMP, no surrogates and no control characters: every literal is one JSON escape or one
    # plain character, and one the vocabulary can spell (SmolLM2 lacks U+0014 and a few other
    # controls, and U+40000..U+BFFFF: a grammar needing one is a 400 grammar_dead_end).
    return st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs", "Cc"))


def ebnf_values() -> Any:
    """`root ::= ...` grammars: alternatives of sequences of quoted literals and character
    classes, each optionally repeated, sometimes through a second rule."""
    from hypothesis import strategies as st

    literal = st.text(_chars(st), min_size=1, max_size=4).map(json.dumps)
    atom = st.one_of(literal, st.sampled_from(_CLASSES))
    item = st.builds(str.__add__, atom, st.sampled_from(_QUANTIFIERS))
    seq = st.lists(item, min_size=1, max_size=4).map(" ".join)
    alts = st.lists(seq, min_size=1, max_size=3).map(" | ".join)
    one_rule = alts.map("root ::= {}".format)
    two_rules = st.builds("root ::= item (\",\" item)*\nitem ::= {}".format, alts)
    return st.one_of(one_rule, two_rules)


def json_schema_values() -> Any:
    """Small JSON Schemas (scalars, enums, arrays, objects with required properties)."""
    from hypothesis import strategies as st

    scalar = st.sampled_from([{"type": t} for t in _TYPES])
    enum = st.lists(st.one_of(st.integers(-9, 9), st.text(_chars(st), max_size=4)),
                    min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v})
    name = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)

    def containers(inner: Any) -> Any:
        array = inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3})
        obj = st.dictionaries(name, inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req}))
        return st.one_of(array, obj)

    return st.recursive(st.one_of(scalar, enum), containers, max_leaves=5)


def strategies() -> dict[str, Any]:
    return {EBNF_FORMAT: ebnf_values(),
            JSON_SCHEMA_TEXT_FORMAT: json_schema_values().map(json.dumps)}


def register() -> None:
    """Register the generators with schemathesis (process-wide)."""
    import schemathesis

    for name, strategy in strategies().items():
        schemathesis.openapi.format(name, strategy)
