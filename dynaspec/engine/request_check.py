"""The one check a request passes before it is queued (the engine's and the DP front end's)."""

from __future__ import annotations

from typing import Any

from dynaspec.sampling_params import SamplingParams


def check_request(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                  lossless: bool, structured: Any) -> None:
    """Raises ValueError naming what is wrong with a request; compiles its grammar (a cache hit
    when pre-compiled, `structured` is the StructuredOutputManager) so a bad one is refused
    here."""
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    if not lossless and params.structured_output is not None:
        raise ValueError("structured output cannot be combined with --rejection-mode synthetic: "
                         "synthetic acceptance takes drafts the grammar never checked")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, which leaves no room to generate within "
                         f"max_model_len {max_model_len}")
    if params.structured_output is not None:
        structured.compile(params.structured_output)
