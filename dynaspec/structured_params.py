"""StructuredOutputParams: which grammar a request's output must follow (one form per request).

Forms, as vLLM's `structured_outputs` names them: `json` (a JSON schema, as a dict or JSON
text), `json_object` (any JSON object), `regex`, `grammar` (EBNF/GBNF text with a `root` rule)
and `choice` (exactly one of the given strings). Frozen and hashable, so it sits in a frozen
SamplingParams and keys the compile cache; a dict schema is stored as its JSON text (key order
kept: it is the order the grammar emits properties in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FORMS = ("json", "json_object", "regex", "grammar", "choice")


def schema_text(schema: dict | str) -> str:
    """A JSON schema as the text `StructuredOutputParams.json` holds (a dict serialized)."""
    return schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)


@dataclass(frozen=True)
class StructuredOutputParams:
    json: str | None = None  # JSON schema text (a dict is accepted and serialized)
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None  # EBNF/GBNF with a root rule
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured output choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not c for c in self.choice):
                raise ValueError("structured output choice must be a non-empty list of "
                                 "non-empty strings")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured output {name} must be a non-empty string")
        given = [f for f in FORMS if self._value(f) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured output needs exactly one of json, json_object, regex, "
                             f"grammar, choice; got {', '.join(given) if given else 'none'}")

    def _value(self, form: str) -> Any:
        return getattr(self, form)

    @property
    def form(self) -> str:
        return next(f for f in FORMS if self._value(f) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The compile-cache key: (form, source text)."""
        form = self.form
        if form == "choice":
            return form, json.dumps(list(self.choice or ()), ensure_ascii=False)
        return form, "" if form == "json_object" else str(self._value(form))

    def describe(self) -> str:
        """A short label for errors and logs."""
        form, text = self.key
        return form if not text else f"{form} {text[:60]!r}{'...' if len(text) > 60 else ''}"
