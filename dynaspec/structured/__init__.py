"""Structured output: grammar-constrained decoding (JSON schema, regex, EBNF, choice) that works
with speculation. `params` is dependency-free; the grammar library is imported only by its edge
module (`xgrammar_backend`)."""

from dynaspec.structured_params import StructuredOutputParams

__all__ = ["StructuredOutputParams"]
