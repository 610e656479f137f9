"""Turns a SchedulerOutput into one target forward: drafts, flat inputs, logits, verification.

Drafters that need nothing from the target (n-gram, a draft model) run here, after the batch is
formed and before the forward, so the K chosen for a batch is the K that batch verifies.
A request with d drafts gets d+1 logits rows in the same forward as everyone else's prefill
chunks and decodes; the rejection sampler returns accepted drafts plus one token per request.
"""

from __future__ import annotations

import time

import torch

from dynaspec.attention.backend import AttentionBatch
from dynaspec.models.llama import LlamaModel
from dynaspec.outputs import BatchDescriptor, RequestResult, RunnerOutput, SchedulerOutput
from dynaspec.request import Request
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.rejection_sampler import rejection_sample
from dynaspec.sample.sampler import Sampler
from dynaspec.spec_decode.base import Drafts, Proposer


PAD = -1  # never a real token id: rejected by the verifier, counted as invalid "padding"


def _pad_probs(p: torch.Tensor, n: int) -> torch.Tensor:
    """Draft probs [d, vocab] -> [n, vocab]; pad rows are uniform (never used: pads reject)."""
    if p.shape[0] >= n:
        return p[:n]
    pad = torch.full((n - p.shape[0], p.shape[1]), 1.0 / p.shape[1], dtype=p.dtype, device=p.device)
    return torch.cat([p, pad])


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                 proposer: Proposer | None, seed: int) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = model.device
        self.proposer = proposer
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self._seed_source = torch.Generator().manual_seed(seed)

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        forget = getattr(self.proposer, "forget", None)
        if forget is not None:
            forget(request_id)

    def _generator(self, req: Request) -> torch.Generator:
        g = self.generators.get(req.request_id)
        if g is None:
            seed = req.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[req.request_id] = g
        return g

    def _draft(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, torch.Tensor | None], dict[str, str]]:
        idx = [i for i, s in enumerate(out.scheduled) if s.draft_budget > 0]
        if not idx or self.proposer is None:
            return {}, {}, {}
        reqs = [out.scheduled[i].request for i in idx]
        drafts: Drafts = self.proposer.propose(reqs, [out.scheduled[i].draft_budget for i in idx])
        tokens, probs, skips = {}, {}, {}
        for j, req in enumerate(reqs):
            s = out.scheduled[idx[j]]
            d = list(drafts.token_ids[j][: s.draft_budget])
            if s.pad_drafts and len(d) < s.draft_budget:
                d += [PAD] * (s.draft_budget - len(d))
            if d:
                tokens[req.request_id] = d
                p = drafts.probs[j] if drafts.probs is not None else None
                probs[req.request_id] = None if p is None else _pad_probs(p, len(d))
            else:
                skips[req.request_id] = drafts.skip_reasons[j] or "no_match"
        return tokens, probs, skips

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        forget = getattr(self.proposer, "forget", None)
        for rid in out.preempted_ids if forget is not None else ():
            forget(rid)  # a preempted request must not keep drafter KV blocks
        drafts, draft_probs, draft_skips = self._draft(out)
        t1 = time.perf_counter()
        ids, positions, qlens, clens, tables, logit_rows = [], [], [], [], [], []
        sampling = []  # (scheduled index, num drafts)
        for i, s in enumerate(out.scheduled):
            req, c = s.request, s.request.num_computed_tokens
            d = drafts.get(req.request_id, [])
            toks = req.token_slice(c, c + s.num_new_tokens) + d
            start = len(ids)
            ids.extend(toks)
            positions.extend(range(c, c + len(toks)))
            qlens.append(len(toks))
            clens.append(c + len(toks))
            tables.append(s.block_table)
            if s.sampling:
                logit_rows.extend(range(start + len(toks) - len(d) - 1, start + len(toks)))
                sampling.append((i, len(d)))
        # The model's backend builds its own metadata (eager gather, or the in-place CPU kernel).
        md = self.model.attn.build_metadata(AttentionBatch(qlens, clens, tables, self.block_size, self.device))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device).clamp_(min=0)  # [T]; pads embed as 0, their rows are ignored
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)  # [R]
        t2 = time.perf_counter()
        logits = self.model.forward(input_ids, pos, self.kv_caches, md, rows)  # [R, vocab]
        t3 = time.perf_counter()
        results = self._sample(out, logits, sampling, drafts, draft_probs, draft_skips)
        t4 = time.perf_counter()
        width = qlens[0] if qlens and all(q == qlens[0] for q in qlens) and \
            len(sampling) == len(qlens) else None
        batch = BatchDescriptor(len(ids), len(qlens), width)
        return RunnerOutput(results, t2 - t1, t1 - t0, t3 - t2, t4 - t3, batch)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, sampling: list[tuple[int, int]],
                drafts: dict, draft_probs: dict, draft_skips: dict) -> list[RequestResult]:
        results = [RequestResult(s.request.request_id, [], 0, 0, s.skip_reason) for s in out.scheduled]
        if not sampling:
            return results
        reqs = [out.scheduled[i].request for i, _ in sampling]
        md = SamplingMetadata.from_params([r.sampling_params for r in reqs],
                                          [self._generator(r) for r in reqs], self.device)
        if any(n for _, n in sampling):
            dt = [drafts.get(r.request_id, []) for r in reqs]
            dp = [draft_probs.get(r.request_id) for r in reqs]
            tokens = rejection_sample(logits, [n for _, n in sampling], dt,
                                      dp if any(p is not None for p in dp) else None, md)
        else:
            tokens = [[t] for t in self.sampler(logits, md).token_ids.tolist()]
        row = 0
        for (i, n), req, toks in zip(sampling, reqs, tokens):
            r = results[i]
            r.token_ids = toks
            pads = sum(1 for t in drafts.get(req.request_id, ()) if t == PAD)
            r.num_draft_tokens, r.num_accepted_tokens = n - pads, len(toks) - 1
            r.num_padding_tokens = pads
            if n - pads == 0 and r.skip_reason is None and not pads:
                r.skip_reason = draft_skips.get(req.request_id)
            if req.sampling_params.logprobs is not None:
                r.logprobs = _logprobs(logits[row: row + len(toks)], toks, req.sampling_params.logprobs)
            row += n + 1
        return results


def _logprobs(rows: torch.Tensor, tokens: list[int], top_n: int) -> list:
    lp = torch.log_softmax(rows.float(), dim=-1)  # [len(tokens), vocab]
    out = []
    for j, t in enumerate(tokens):
        top = torch.topk(lp[j], top_n) if top_n > 0 else None
        tops = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        out.append((float(lp[j, t]), tops))
    return out
