"""Penalties, logit_bias, min_tokens and bad words: one logits step at every verified position.

A request with drafts d_0..d_{n-1} owns n + 1 logits rows; row j is the distribution
token-by-token decoding would sample from after the output so far plus d_0..d_{j-1}. So every
row is processed with exactly that context: the output counts for the penalties, the number of
tokens out for min_tokens, the tail for multi-token bad words all include the drafts before j.
The greedy argmax and the random target distribution both read the processed rows, so greedy
output with speculation equals greedy output without it under each of these, and random output
keeps the processed target distribution (docs/design.md §4).

Order (as vLLM's sampler): bans (min_tokens, bad words) -> logit_bias -> repetition penalty ->
frequency and presence penalties. Temperature, top-k/top-p/min-p come after, in processed_probs.
Frequency and presence count output tokens only; the repetition penalty sees prompt + output.

The plan is built on the engine thread (`prepare`, which copies the tokens it needs) and applied
in `run`, which may be on a worker thread under async scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.sampling_params import SamplingParams


@dataclass
class RowSpan:
    """One request's rows in the step's logits and the context they are processed with."""

    row: int  # first logits row of the request
    drafts: list[int]  # the drafts its rows verify (a -1 pad ends them)
    output: list[int]  # output tokens before this step
    prompt: list[int] | None  # only when the repetition penalty needs it
    params: SamplingParams


class LogitsProcessing:
    def __init__(self, spans: list[RowSpan], stop_ids: tuple[int, ...]) -> None:
        self.spans = spans
        self.eos = stop_ids

    @staticmethod
    def build(reqs: list, sampling: list[tuple[int, int]], drafts: dict[str, list[int]],
              eos_token_ids: tuple[int, ...]) -> LogitsProcessing | None:
        """`reqs[k]` verifies `sampling[k][1]` drafts in rows laid out request after request;
        None when no request in the step asks for any of this."""
        spans, row = [], 0
        for req, (_, n) in zip(reqs, sampling):
            sp = req.sampling_params
            if sp.processes_logits:
                prompt = list(req.prompt_token_ids) if sp.repetition_penalty != 1.0 else None
                spans.append(RowSpan(row, list(drafts.get(req.request_id, ()))[:n],
                                     list(req.output_token_ids), prompt, sp))
            row += n + 1
        return LogitsProcessing(spans, tuple(eos_token_ids)) if spans else None

    @torch.inference_mode()  # the forward's logits are inference tensors
    def apply(self, logits: torch.Tensor) -> None:
        """Process `logits` [rows, vocab] in place."""
        for s in self.spans:
            n = _num_rows(s.drafts)
            rows = logits[s.row: s.row + n]
            # A copy: process_rows works in place, and a dead row is restored from `rows`.
            out = process_rows(rows.to(torch.float32, copy=True), s, self.eos)
            # A row with nothing left (min_tokens against a grammar that can only end) keeps
            # its unprocessed values rather than sampling from an empty distribution.
            dead = ~torch.isfinite(out).any(dim=-1)
            if bool(dead.any()):
                out[dead] = rows[dead].float()
            rows.copy_(out.to(rows.dtype))


def _num_rows(drafts: list[int]) -> int:
    """Rows that have a real context: up to and including the row at the first pad."""
    real = next((j for j, t in enumerate(drafts) if t < 0), len(drafts))
    return real + 1


def process_rows(x: torch.Tensor, s: RowSpan, eos: tuple[int, ...]) -> torch.Tensor:
    """x: [n, vocab] float32 rows of one request (row j after output + drafts[:j])."""
    n, vocab = x.shape
    sp = s.params
    drafts = s.drafts[: n - 1]
    _ban(x, s, drafts, eos, vocab)
    if sp.logit_bias:
        ids = torch.tensor([t for t, _ in sp.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in sp.logit_bias if t < vocab], dtype=x.dtype)
        x[:, ids] += bias
    if sp.repetition_penalty == 1.0 and not (sp.presence_penalty or sp.frequency_penalty):
        return x
    counts = _output_counts(s.output, drafts, n, vocab)  # [n, vocab]
    if sp.repetition_penalty != 1.0:
        seen = counts > 0
        if s.prompt:
            seen[:, torch.tensor(s.prompt, dtype=torch.long).clamp(0, vocab - 1)] = True
        p = sp.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    if sp.frequency_penalty:
        x = x - sp.frequency_penalty * counts
    if sp.presence_penalty:
        x = x - sp.presence_penalty * (counts > 0).to(x.dtype)
    # Large logits over a small penalty can overflow; +inf would turn the softmax into NaN.
    return x.clamp_(max=torch.finfo(x.dtype).max)


def _output_counts(output: list[int], drafts: list[int], n: int, vocab: int) -> torch.Tensor:
    """[n, vocab]: row j counts output + drafts[:j]."""
    base = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab] \
        if output else torch.zeros(vocab, dtype=torch.long)
    counts = base.to(torch.float32).repeat(n, 1)
    for j, t in enumerate(drafts[: n - 1]):
        if 0 <= t < vocab:
            counts[j + 1:, t] += 1
    return counts


def _ban(x: torch.Tensor, s: RowSpan, drafts: list[int], eos: tuple[int, ...],
         vocab: int) -> None:
    sp = s.params
    if sp.min_tokens:
        stops = [t for t in (*(() if sp.ignore_eos else eos), *sp.stop_token_ids)
                 if 0 <= t < vocab]
        for j in range(x.shape[0]):
            if len(s.output) + j < sp.min_tokens and stops:
                x[j, stops] = float("-inf")
    for word in sp.bad_words_ids:
        *prefix, last = word
        if last >= vocab:
            continue
        for j in range(x.shape[0]):
            if not prefix or _ends_with(s.output, drafts[:j], prefix):
                x[j, last] = float("-inf")


def _ends_with(output: list[int], drafts: list[int], prefix: list[int]) -> bool:
    k = len(prefix)
    if len(drafts) >= k:
        return drafts[-k:] == prefix
    need = k - len(drafts)
    return len(output) >= need and output[len(output) - need:] + drafts == prefix
