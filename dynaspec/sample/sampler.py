"""Batched token sampler (one token per request) and the shared target-distribution transform.

`processed_probs` is the single definition of "the distribution a random request samples
from". The plain sampler and the rejection sampler (verification rows and the bonus row) both
use it, so speculation never changes which distribution a request's tokens come from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.sample.greedy import argmax_rows
from dynaspec.sample.metadata import SamplingMetadata

# Per request: (logprob of the chosen token, top-n [(token id, logprob)]).
LogprobEntry = tuple[float, list[tuple[int, float]]]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: list[LogprobEntry | None]  # None where the request did not ask for logprobs


def processed_probs(
    logits: torch.Tensor,  # [rows, vocab]
    md: SamplingMetadata,
    row_to_req: torch.Tensor,  # [rows] int64, index into md's requests
) -> torch.Tensor:  # [rows, vocab] float32
    """Target probabilities of random sampling: temperature, then min-p, top-k, top-p.

    The order follows vLLM V1 (temperature, argmax-invariant processors such as min-p, then
    top-k/top-p). Greedy rows (temperature 0) are processed at temperature 1; callers take
    greedy tokens from the raw logits and do not use these rows.
    """
    temp = md.temperature.to(logits.device)[row_to_req]  # [rows]
    temp = torch.where(temp > 0, temp, torch.ones_like(temp))
    logits = logits.float() / temp.unsqueeze(1)  # [rows, vocab], a fresh tensor we may mutate
    # A huge logit over a small temperature must not become +inf (softmax would give NaN).
    logits.clamp_(max=torch.finfo(torch.float32).max)
    min_p = md.min_p.to(logits.device)[row_to_req]  # [rows]
    if bool((min_p > 0).any()):
        logits = _apply_min_p(logits, min_p)
    top_k = md.top_k.to(logits.device)[row_to_req]  # [rows]
    top_p = md.top_p.to(logits.device)[row_to_req]  # [rows]
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1).any())
    if use_k or use_p:
        logits = _apply_top_k_top_p(logits, top_k if use_k else None, top_p if use_p else None)
    return torch.softmax(logits, dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)  # [rows, vocab]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [rows, 1]
    # The top token always survives (its prob >= threshold since min_p <= 1).
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [rows, vocab]
    top_k: torch.Tensor | None,  # [rows] int64, 0 = off
    top_p: torch.Tensor | None,  # [rows] float32, 1 = off
) -> torch.Tensor:
    vocab = logits.shape[-1]
    # Stable sort so that ties are cut the same way on every call (batched or reference).
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = top_k.clamp(max=vocab)  # [rows]
        kth = sorted_logits.gather(1, (k - 1).clamp(min=0).unsqueeze(1))  # [rows, 1]
        # Threshold by value: tokens tied with the k-th are all kept, independent of sort order.
        drop = (sorted_logits < kth) & (k > 0).unsqueeze(1)  # [rows, vocab]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [rows, vocab]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [rows, vocab]
        # Keep the smallest prefix whose mass reaches top_p. The first token has mass_before 0
        # and is always kept. Rows with top_p == 1 are exempt: rounding can push the cumsum
        # past 1.0 and would wrongly cut their tail.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        # A top_p below float32's smallest normal (1e-117 from a fuzzer) rounds to 0, and
        # "mass_before >= 0" would drop every token: the top one is kept explicitly.
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def sample_uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The one uniform in [0, 1) that picks a sampled token; float64 so the CDF can resolve it."""
    return torch.rand(1, generator=generator, dtype=torch.float64, device=device)  # [1]


def inverse_cdf_sample(
    weights: torch.Tensor,  # [rows, vocab] non-negative, unnormalised, a positive entry per row
    u: torch.Tensor,  # [rows] float64 in [0, 1)
) -> torch.Tensor:  # [rows] int64
    """Sample each row of normalize(weights) by inverting its CDF at one uniform.

    One uniform per token, not an Exp(1) noise vector over the vocabulary: drawing 49k
    exponentials per random row was 40% of a step with many sampled requests. Each row's CDF is
    a sequential float64 sum of that row alone, so a row draws the same token in any batch.
    """
    cdf = weights.double().cumsum(dim=-1)  # [rows, vocab]
    total = cdf[:, -1:]  # [rows, 1]
    # u * total can round up to total; the largest double below it keeps the target inside.
    below = torch.nextafter(total, torch.zeros_like(total))  # [rows, 1]
    target = torch.minimum(u.to(cdf.device).unsqueeze(1) * total, below)  # [rows, 1]
    # First index whose cdf exceeds the target: a zero-weight token repeats its predecessor's
    # cdf and so is never the first to exceed it.
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # [rows]


class Sampler:
    """Samples one token per request: greedy rows by argmax, random rows from processed_probs."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [num_reqs, vocab]
        if logits.shape[0] != md.num_reqs:
            raise ValueError(f"logits have {logits.shape[0]} rows for {md.num_reqs} requests")
        if md.all_greedy:
            token_ids = argmax_rows(logits)  # [num_reqs]
        else:
            token_ids = self._sample_mixed(logits, md)
        return SamplerOutput(token_ids, compute_logprobs(logits, token_ids, md.num_logprobs))

    @staticmethod
    def _sample_mixed(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        num_reqs = logits.shape[0]
        greedy = md.temperature.to(logits.device) == 0  # [num_reqs]
        token_ids = torch.empty(num_reqs, dtype=torch.int64, device=logits.device)
        greedy_rows = greedy.nonzero().squeeze(1)  # [num_greedy]
        if greedy_rows.numel():
            token_ids[greedy_rows] = argmax_rows(logits[greedy_rows])
        rand_rows = (~greedy).nonzero().squeeze(1)  # [num_random]
        if rand_rows.numel() == 0:  # a hand-built md whose all_greedy flag was left False
            return token_ids
        probs = processed_probs(logits[rand_rows], md, rand_rows)  # [num_random, vocab]
        # One uniform per random request, from that request's own generator.
        u = torch.cat(
            [sample_uniform(md.generators[r], logits.device) for r in rand_rows.tolist()]
        )  # [num_random] float64
        token_ids[rand_rows] = inverse_cdf_sample(probs, u)
        return token_ids


def compute_logprobs(
    logits: torch.Tensor,  # [num_reqs, vocab], raw (unprocessed)
    token_ids: torch.Tensor,  # [num_reqs]
    num_logprobs: list[int | None],
) -> list[LogprobEntry | None]:
    """Logprobs of the raw logits (vLLM's default mode), only for requests that asked."""
    out: list[LogprobEntry | None] = [None] * len(num_logprobs)
    want = [i for i, n in enumerate(num_logprobs) if n is not None]
    if not want:
        return out
    want_t = torch.tensor(want, dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits[want_t].float(), dim=-1)  # [num_want, vocab]
    chosen = lp.gather(1, token_ids[want_t].unsqueeze(1)).squeeze(1).tolist()  # [num_want]
    asked = [n for i in want if (n := num_logprobs[i]) is not None]  # every wanted row's n
    max_n = min(max(asked), lp.shape[-1])
    top_vals: list[list[float]] = [[] for _ in want]
    top_ids: list[list[int]] = [[] for _ in want]
    if max_n > 0:
        # One topk for the whole batch at the largest n; each request takes its prefix.
        vals, ids = lp.topk(max_n, dim=-1)  # [num_want, max_n]
        top_vals, top_ids = vals.tolist(), ids.tolist()
    for j, i in enumerate(want):
        n = num_logprobs[i]
        assert n is not None
        out[i] = (chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n])))
    return out


def row_logprobs(rows: torch.Tensor, tokens: list[int], top_n: int) -> list[LogprobEntry]:
    """rows: [len(tokens), vocab] the logits (as verified) that emitted `tokens`, one each."""
    # Clamped: a grammar-masked token has logprob -inf, which JSON cannot carry.
    lp = torch.log_softmax(rows.float(), dim=-1).clamp_(min=-9999.0)  # [len(tokens), vocab]
    out: list[LogprobEntry] = []
    for j, t in enumerate(tokens):
        top = torch.topk(lp[j], top_n) if top_n > 0 else None
        tops = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        out.append((float(lp[j, t]), tops))
    return out
