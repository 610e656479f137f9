"""Lossless speculative verification (Leviathan et al. / Chen et al. rejection sampling).

Layout: request i owns num_draft[i] + 1 contiguous rows of `target_logits`, requests in step
order. Row j < num_draft[i] verifies draft j; the last row gives the bonus token.

Greedy requests (temperature 0) accept drafts while they equal the argmax of the raw logits and
then emit that argmax, so greedy output is token-exact with non-speculative greedy decoding.
Random requests accept draft x with probability min(1, p(x)/q(x)), where p is
`processed_probs` of the row and q the draft distribution (one-hot at x for a deterministic
drafter); on rejection they sample normalize(max(p - q, 0)) (p itself if that is all zero), and
if every draft is accepted they sample the bonus token from p.

Random draws, per random request and in request order, from that request's generator only:
  1. u = rand(num_draft[i])        acceptance uniforms, one per draft;
  2. v = one float64 uniform      inverts the CDF of the single sampled token.
A request emits exactly one sampled token (recovered at its first rejection, or the bonus), and
which position that is depends only on u and the drafts, never on v; so one uniform per
request is enough and keeps the output a function of the request's seed alone.
Draft ids outside [0, vocab) (e.g. the -1 pad) are never accepted; every id in range, 0
included, is a real token.
"""

from __future__ import annotations

import torch

from dynaspec.sample.greedy import argmax_rows
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.sampler import inverse_cdf_sample, processed_probs, sample_uniform


def validate_inputs(
    target_logits: torch.Tensor,
    num_draft: list[int],
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None,
    md: SamplingMetadata,
) -> None:
    if len(num_draft) != md.num_reqs or len(draft_token_ids) != md.num_reqs:
        raise ValueError(
            f"{md.num_reqs} requests but {len(num_draft)} num_draft and "
            f"{len(draft_token_ids)} draft lists"
        )
    for i, (n, ids) in enumerate(zip(num_draft, draft_token_ids)):
        if n < 0 or len(ids) != n:
            raise ValueError(f"request {i}: num_draft={n} but {len(ids)} draft ids")
    rows = sum(num_draft) + len(num_draft)
    if target_logits.dim() != 2 or target_logits.shape[0] != rows:
        raise ValueError(f"target_logits {tuple(target_logits.shape)}: expected [{rows}, vocab]")
    if draft_probs is None:
        return
    if len(draft_probs) != md.num_reqs:
        raise ValueError(f"draft_probs has {len(draft_probs)} entries for {md.num_reqs} requests")
    vocab = target_logits.shape[1]
    for i, q in enumerate(draft_probs):
        if q is not None and tuple(q.shape) != (num_draft[i], vocab):
            raise ValueError(
                f"request {i}: draft_probs {tuple(q.shape)}, expected ({num_draft[i]}, {vocab})"
            )


def _draw(
    md: SamplingMetadata, i: int, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's random draws, in the order both implementations consume them."""
    g = md.generators[i]
    u = torch.rand(n, generator=g, device=device)  # [n]
    return u, sample_uniform(g, device)  # [n], [1] float64


def rejection_sample(
    target_logits: torch.Tensor,  # [num_rows, vocab]
    num_draft: list[int],
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None,
    md: SamplingMetadata,
) -> list[list[int]]:
    """Batched verification; per request: accepted drafts + one recovered or bonus token."""
    validate_inputs(target_logits, num_draft, draft_token_ids, draft_probs, md)
    device = target_logits.device
    num_reqs, vocab = len(num_draft), target_logits.shape[1]
    if num_reqs == 0:
        return []
    if md.all_greedy:
        return _greedy(target_logits, draft_token_ids)
    max_n = max(num_draft)
    n = torch.tensor(num_draft, dtype=torch.int64, device=device)  # [R]
    row_start = torch.cumsum(n + 1, 0) - (n + 1)  # [R] first row of each request
    pos = torch.arange(max_n, device=device)  # [max_n]
    valid = pos.unsqueeze(0) < n.unsqueeze(1)  # [R, max_n] real draft slots
    drafts = torch.full((num_reqs, max_n), -1, dtype=torch.int64, device=device)  # [R, max_n]
    drafts[valid] = torch.tensor(
        [t for ids in draft_token_ids for t in ids], dtype=torch.int64, device=device
    )  # row-major mask order == request order, position order
    in_vocab = valid & (drafts >= 0) & (drafts < vocab)  # [R, max_n]
    safe_drafts = drafts.clamp(0, vocab - 1)  # [R, max_n] gatherable; masked by in_vocab
    draft_rows = torch.where(valid, row_start.unsqueeze(1) + pos, 0)  # [R, max_n]

    target_argmax = target_logits.argmax(dim=-1)  # [num_rows], raw logits: greedy-exact
    accept = in_vocab & (safe_drafts == target_argmax[draft_rows])  # [R, max_n] greedy rule
    greedy = md.temperature.to(device) == 0  # [R]
    rand_reqs = [] if md.all_greedy else (~greedy).nonzero().squeeze(1).tolist()
    if rand_reqs:
        rand = _RandomPart(target_logits, num_draft, draft_probs, md, rand_reqs, greedy, valid)
        accept_rand = in_vocab & rand.accepts(draft_rows, safe_drafts)  # [R, max_n]
        accept = torch.where(greedy.unsqueeze(1), accept, accept_rand)

    # Accepted prefix: drafts up to (not including) the first rejection.
    num_acc = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # [R]
    emitted = target_argmax[row_start + num_acc]  # [R] greedy recovered/bonus token
    if rand_reqs:
        emitted[rand.req_idx] = rand.final_tokens(num_acc, n, row_start, safe_drafts, in_vocab)
    return [
        ids[:a] + [t]
        for ids, a, t in zip(draft_token_ids, num_acc.tolist(), emitted.tolist())
    ]


def _greedy(target_logits: torch.Tensor, draft_token_ids: list[list[int]]) -> list[list[int]]:
    """Every request greedy: one argmax over all rows, then the rule in Python. The batched
    path's ~20 tensor ops cost ~0.4 ms a step at batch 1, a tenth of a plain decode step, and
    priced every verify width above plain. An id outside [0, vocab) never equals an argmax."""
    return greedy_from_argmax(argmax_rows(target_logits).tolist(), draft_token_ids)


def greedy_from_argmax(argmax: list[int], draft_token_ids: list[list[int]]) -> list[list[int]]:
    """The greedy rule from each row's argmax, rows laid out request after request (drafts + 1
    each): accept drafts while they equal the argmax, then emit the argmax. The CUDA-graph step
    calls it with the argmax its graph computed. A -1 pad never equals one."""
    out, row = [], 0
    for ids in draft_token_ids:
        a = 0
        while a < len(ids) and ids[a] == argmax[row + a]:
            a += 1
        out.append(ids[:a] + [argmax[row + a]])
        row += len(ids) + 1
    return out


class _RandomPart:
    """The random requests' target probabilities, draft probabilities and draws."""

    def __init__(
        self,
        target_logits: torch.Tensor,  # [num_rows, vocab]
        num_draft: list[int],
        draft_probs: list[torch.Tensor | None] | None,
        md: SamplingMetadata,
        rand_reqs: list[int],
        greedy: torch.Tensor,  # [R] bool
        valid: torch.Tensor,  # [R, max_n] bool, real draft slots
    ) -> None:
        device = target_logits.device
        self.req_idx = torch.tensor(rand_reqs, dtype=torch.int64, device=device)  # [Nr]
        row_to_req = torch.repeat_interleave(
            torch.arange(len(num_draft), device=device),
            torch.tensor(num_draft, device=device) + 1,
        )  # [num_rows]
        # Process only random requests' rows; row_map sends a global row to its probs row.
        is_rand_row = ~greedy[row_to_req]  # [num_rows]
        rand_rows = is_rand_row.nonzero().squeeze(1)  # [num_rand_rows]
        self.probs = processed_probs(target_logits[rand_rows], md, row_to_req[rand_rows])
        self.row_map = (torch.cumsum(is_rand_row.to(torch.int64), 0) - 1).clamp(min=0)
        u_parts = self._draw_all(md, num_draft, rand_reqs, device)
        # Greedy requests keep u = 0; their acceptance comes from the argmax rule.
        self.u = torch.zeros(valid.shape, device=device)  # [R, max_n]
        self.u[valid & ~greedy.unsqueeze(1)] = torch.cat(u_parts)  # row-major == request order
        self._gather_draft_probs(draft_probs, num_draft, rand_reqs, valid.shape, device)

    def _draw_all(
        self, md: SamplingMetadata, num_draft: list[int], rand_reqs: list[int],
        device: torch.device,
    ) -> list[torch.Tensor]:
        """Sets the token uniforms v [Nr]; returns the acceptance uniforms, [num_draft[i]] each."""
        # Request order, and per request u before v: the reference consumes the same way.
        draws = [_draw(md, i, num_draft[i], device) for i in rand_reqs]
        self.v = torch.cat([v for _, v in draws])  # [Nr] float64
        return [u for u, _ in draws]

    def _gather_draft_probs(
        self,
        draft_probs: list[torch.Tensor | None] | None,
        num_draft: list[int],
        rand_reqs: list[int],
        shape: torch.Size,
        device: torch.device,
    ) -> None:
        """q_cat stacks the given draft rows; src[i, j] is draft j's row there, -1 = one-hot."""
        src = [[-1] * shape[1] for _ in range(shape[0])]
        parts: list[torch.Tensor] = []
        offset = 0
        for i in rand_reqs if draft_probs is not None else []:
            q, n = draft_probs[i], num_draft[i]  # type: ignore[index]
            if q is None or n == 0:
                continue
            parts.append(q.to(device=device, dtype=torch.float32))
            src[i][:n] = range(offset, offset + n)
            offset += n
        self.src = torch.tensor(src, dtype=torch.int64, device=device).view(shape)  # [R, max_n]
        self.q_cat = torch.cat(parts) if parts else None  # [num_q_rows, vocab]

    def accepts(
        self,
        draft_rows: torch.Tensor,  # [R, max_n]
        safe_drafts: torch.Tensor,  # [R, max_n]
    ) -> torch.Tensor:  # [R, max_n] bool; caller masks out-of-vocab and padding slots
        p_x = self.probs[self.row_map[draft_rows], safe_drafts]  # [R, max_n]
        q_x = torch.ones_like(p_x)  # one-hot q: q(x) = 1
        if self.q_cat is not None:
            has_q = self.src >= 0
            q_x = torch.where(has_q, self.q_cat[self.src.clamp(min=0), safe_drafts], q_x)
        # u < p/q written without the division: q = 0 < p accepts (ratio inf), p = 0 rejects.
        return self.u * q_x < p_x

    def final_tokens(
        self,
        num_acc: torch.Tensor,  # [R]
        num_draft: torch.Tensor,  # [R]
        row_start: torch.Tensor,  # [R]
        safe_drafts: torch.Tensor,  # [R, max_n] clamped into the vocab
        in_vocab: torch.Tensor,  # [R, max_n]
    ) -> torch.Tensor:  # [Nr] recovered or bonus token per random request
        idx = self.req_idx
        acc = num_acc[idx]  # [Nr]
        p = self.probs[self.row_map[row_start[idx] + acc]]  # [Nr, vocab]
        q = torch.zeros_like(p)  # [Nr, vocab]; stays 0 for the bonus row
        max_n = safe_drafts.shape[1]
        if max_n > 0:
            at = acc.clamp(max=max_n - 1)  # [Nr]
            rejected = acc < num_draft[idx]  # [Nr] else all accepted: bonus
            src = torch.where(rejected, self.src[idx, at], -1)  # [Nr]
            if self.q_cat is not None:
                q = torch.where((src >= 0).unsqueeze(1), self.q_cat[src.clamp(min=0)], q)
            one_hot = rejected & (src < 0) & in_vocab[idx, at]  # [Nr]
            q.scatter_add_(1, safe_drafts[idx, at].unsqueeze(1), one_hot.to(q.dtype).unsqueeze(1))
        residual = (p - q).clamp_min(0)  # [Nr, vocab] unnormalized max(p - q, 0)
        # Rounding can empty the residual of a rejected draft; p is then the right fallback.
        residual = torch.where(residual.gt(0).any(dim=1, keepdim=True), residual, p)
        return inverse_cdf_sample(residual, self.v)  # samples normalize(residual)


def rejection_sample_reference(
    target_logits: torch.Tensor,  # [num_rows, vocab]
    num_draft: list[int],
    draft_token_ids: list[list[int]],
    draft_probs: list[torch.Tensor | None] | None,
    md: SamplingMetadata,
) -> list[list[int]]:
    """Test oracle: one request and one position at a time, same draws as the batched path."""
    validate_inputs(target_logits, num_draft, draft_token_ids, draft_probs, md)
    device = target_logits.device
    out: list[list[int]] = []
    start = 0
    for i, n in enumerate(num_draft):
        rows = target_logits[start : start + n + 1]  # [n + 1, vocab]
        start += n + 1
        if float(md.temperature[i]) == 0.0:
            out.append(_greedy_one(rows, draft_token_ids[i]))
            continue
        p = processed_probs(rows, md, torch.full((n + 1,), i, device=device))  # [n + 1, vocab]
        q = None if draft_probs is None else draft_probs[i]
        q = None if q is None else q.to(device=device, dtype=torch.float32)  # [n, vocab]
        u, v = _draw(md, i, n, device)
        out.append(_random_one(p, q, draft_token_ids[i], u, v))
    return out


def _greedy_one(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    tokens: list[int] = []
    for j, x in enumerate(drafts):
        best = int(rows[j].argmax())
        if x != best:
            return tokens + [best]
        tokens.append(x)
    return tokens + [int(rows[len(drafts)].argmax())]


def _random_one(
    p: torch.Tensor,  # [n + 1, vocab]
    q: torch.Tensor | None,  # [n, vocab], None = one-hot at the draft
    drafts: list[int],
    u: torch.Tensor,  # [n]
    v: torch.Tensor,  # [1] float64, the sampled token's uniform
) -> list[int]:
    vocab = p.shape[1]
    tokens: list[int] = []
    for j, x in enumerate(drafts):
        real = 0 <= x < vocab
        if real:
            q_x = q[j, x] if q is not None else torch.tensor(1.0, device=p.device)
            if bool(u[j] * q_x < p[j, x]):
                tokens.append(x)
                continue
        if q is not None:
            q_row = q[j]
        else:
            q_row = torch.zeros_like(p[j])
            if real:
                q_row[x] = 1.0
        residual = (p[j] - q_row).clamp_min(0)
        if not bool((residual > 0).any()):
            residual = p[j]
        return tokens + [int(inverse_cdf_sample(residual.unsqueeze(0), v))]
    return tokens + [int(inverse_cdf_sample(p[len(drafts)].unsqueeze(0), v))]


# ---- synthetic acceptance (NOT lossless) ------------------------------------------------------
