"""Draft-model proposer: a smaller model sharing the target's vocabulary, with its own paged KV.

Per request the drafter remembers how many positions of its KV hold verified tokens. Each
propose call first catches up on tokens verified since the last call (in the same batched
forward as the first draft), then drafts k tokens autoregressively. The KV of drafts the target
accepted is kept (they are the same tokens); slots of rejected drafts are simply rewritten.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dynaspec.attention.paged import build_metadata
from dynaspec.config import EngineConfig
from dynaspec.kv.kv_cache_manager import KVCacheManager
from dynaspec.kv.sizing import num_kv_blocks
from dynaspec.models.llama import LlamaModel
from dynaspec.request import Request
from dynaspec.sample.greedy import argmax_rows
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.sampler import processed_probs
from dynaspec.spec_decode.drafters.base import FRESH_TOKENS, Drafts, Proposer
from dynaspec.structured.manager import StructuredOutputManager


@dataclass
class _DraftSeq:
    """The drafter's view of one request (what its KV manager needs)."""

    request_id: str
    num_computed_tokens: int = 0  # positions of the drafter's KV holding verified tokens
    fed: list[int] = field(default_factory=list)  # drafts fed at positions [base, base+len)
    base: int = 0
    generator: torch.Generator = field(kw_only=True)  # the request's draft sampling stream


def draft_k_limit(path: str) -> int:
    """A draft model's K limit (see `DraftModelProposer.k_limit`), read without its weights when
    it is an HF folder."""
    import os

    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        from dynaspec.models.hf_loader import _read_json, arch_from_hf_config
        arch = arch_from_hf_config(_read_json(os.path.join(path, "config.json"), True), path)
    else:
        from dynaspec.models.loader import load_model_files
        arch = load_model_files(path).arch
    return max(0, arch.max_position_embeddings - 1)


class DraftModelProposer(Proposer):
    uses_grammar = True

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, max_len: int,
                 seed: int = 0, grammar: StructuredOutputManager | None = None) -> None:
        self.model, self.block_size, self.max_len = model, block_size, max_len
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_caches = model.allocate_kv(num_blocks * block_size)
        self.num_kv_tokens = num_blocks * block_size
        self.seqs: dict[str, _DraftSeq] = {}
        self.seed = seed
        # Structured output (the StructuredOutputManager): masks drafts like the target's
        # (mask_draft_logits, accept_draft, end_drafts), so a grammar request's drafts follow it.
        self.grammar = grammar

    @property
    def k_limit(self) -> int:
        """Most drafts one step can ever ask of this drafter: its positions minus the one
        token of context every request has. The plan is clamped to it (docs/design.md §2)."""
        return max(0, self.max_len - 1)

    @staticmethod
    def load(
        path: str,
        config: EngineConfig,
        target_vocab: int,
        device: torch.device,
        dtype: torch.dtype,
        grammar: StructuredOutputManager | None = None,
    ) -> DraftModelProposer:
        from dynaspec.models.loader import load_model_files

        loaded = load_model_files(path)
        arch = loaded.arch
        if arch.vocab_size != target_vocab:
            raise ValueError(
                f"draft model {path!r} has vocabulary size {arch.vocab_size}, the target "
                f"has {target_vocab}: a draft model must share the target's vocabulary"
            )
        max_len = arch.max_position_embeddings
        model = LlamaModel(arch, loaded.state_dict, dtype, device, max_len + 1)
        cc = config.cache
        blocks = num_kv_blocks(cc.kv_cache_memory_gb, cc.num_kv_blocks, model.kv_bytes_per_token(),
                               cc.block_size)
        return DraftModelProposer(model, blocks, cc.block_size, max_len, config.model.seed, grammar)

    def forget(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def preempt(self, request_id: str) -> None:
        self.forget(request_id)  # nothing outlives a request here: preemption is an end

    def num_cached(self) -> int:
        return len(self.seqs)

    def _catch_up_start(self, seq: _DraftSeq, req: Request) -> int:
        """First position whose drafter KV is not known to hold the request's verified token."""
        n = seq.num_computed_tokens
        for j, d in enumerate(seq.fed):
            pos = seq.base + j
            if pos >= req.num_tokens or req.token_at(pos) != d:
                break
            n = pos + 1
        return min(n, req.num_tokens - 1)  # always feed >= 1 token to get the next logits

    def propose(self, requests: Sequence[Request], k_per_request: Sequence[int], *,
                fallback_k: Sequence[int] | None = None,
                trees: Sequence[bool] | None = None) -> Drafts:
        try:
            return self._propose(requests, k_per_request)
        finally:
            if self.grammar is not None:
                self.grammar.end_drafts()

    @torch.inference_mode()
    def _propose(self, requests: Sequence[Request], k_per_request: Sequence[int]) -> Drafts:
        active = [(r, k) for r, k in zip(requests, k_per_request) if k > 0]
        out_tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        out_probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in active}
        seqs, feeds = [], []
        for r, _k in active:
            seq = self.seqs.get(r.request_id)
            if seq is None:
                gen = torch.Generator(device=self.model.device).manual_seed(
                    (r.sampling_params.seed or self.seed) * 7919 + 1)
                seq = self.seqs[r.request_id] = _DraftSeq(r.request_id, generator=gen)
            seq.num_computed_tokens = self._catch_up_start(seq, r)
            seq.base, seq.fed = r.num_tokens, []
            feeds.append(r.token_slice(seq.num_computed_tokens, r.num_tokens))
            seqs.append(seq)
        setup = self._prefill(seqs, feeds)
        max_k = max((k for _, k in active), default=0)
        live = list(range(len(active)))
        for step in range(max_k):
            grown = [i for i in live if self._grow(seqs[i], len(feeds[i]))]
            for i in set(live) - set(grown):
                if step > 0:
                    seqs[i].fed.pop()  # its KV was never written
            live = grown
            if not live:
                break
            toks, probs = self._forward([seqs[i] for i in live], [feeds[i] for i in live],
                                        [active[i][0] for i in live])
            nxt = []
            for j, i in enumerate(live):
                r, k = active[i]
                seqs[i].num_computed_tokens += len(feeds[i])
                out_tokens[r.request_id].append(toks[j])
                if self.grammar is not None:
                    self.grammar.accept_draft(r, toks[j])
                if (q := probs[j]) is not None:
                    out_probs[r.request_id].append(q)
                if len(out_tokens[r.request_id]) < k:
                    seqs[i].fed.append(toks[j])
                    feeds[i] = [toks[j]]
                    nxt.append(i)
            live = nxt
        for seq, (r, _) in zip(seqs, active):
            seq.num_computed_tokens = r.num_tokens  # drafts' KV is re-validated next call
        d = self._pack(requests, k_per_request, out_tokens, out_probs)
        d.setup_seconds = setup
        return d

    def _prefill(self, seqs: list[_DraftSeq], feeds: list[list[int]]) -> float:
        """Feed the tokens of each request older than its newest FRESH_TOKENS (a prompt, on its
        first drafts) in a forward of their own, trimming `feeds` to the rest; returns the
        seconds it took (Drafts.setup_seconds). In the first draft's forward, a prompt's prefill
        made that request's first drafts cost tens of ms a token, and the goodput policy, which
        learns the cost from drafting steps only, then stopped drafting for good."""
        old = [i for i, f in enumerate(feeds) if len(f) > FRESH_TOKENS
               and self._grow(seqs[i], len(f) - FRESH_TOKENS)]
        if not old:
            return 0.0
        t0 = time.perf_counter()
        pre = [feeds[i][:-FRESH_TOKENS] for i in old]
        qlens = [len(f) for f in pre]
        self._logits([seqs[i] for i in old], pre)  # the KV is what counts; the logits are unused
        for i, q in zip(old, qlens):
            seqs[i].num_computed_tokens += q
            feeds[i] = feeds[i][q:]
        return time.perf_counter() - t0

    def _grow(self, seq: _DraftSeq, n: int) -> bool:
        return seq.num_computed_tokens + n <= self.max_len and self.kv.allocate_slots(seq, n)

    def _logits(self, seqs: list[_DraftSeq], feeds: list[list[int]]) -> torch.Tensor:
        """One forward of each sequence's fed tokens into its KV: the logits at each one's last
        token [len(seqs), vocab]."""
        qlens = [len(f) for f in feeds]
        clens = [s.num_computed_tokens + q for s, q in zip(seqs, qlens)]
        md = build_metadata(qlens, clens, [self.kv.block_table(s.request_id) for s in seqs],
                            self.block_size, self.model.device)
        ids = torch.tensor(
            [t for f in feeds for t in f], dtype=torch.long, device=self.model.device
        )
        pos = torch.tensor([p for s, q in zip(seqs, qlens) for p in range(s.num_computed_tokens,
                            s.num_computed_tokens + q)], dtype=torch.long, device=self.model.device)
        last = torch.tensor(qlens, device=self.model.device).cumsum(0) - 1
        return self.model.forward(ids, pos, self.kv_caches, md, last)

    def _forward(self, seqs: list[_DraftSeq], feeds: list[list[int]], reqs: list[Request]
                 ) -> tuple[list[int], list[torch.Tensor | None]]:
        logits = self._logits(seqs, feeds)  # [num_reqs, vocab]
        if self.grammar is not None:
            self.grammar.mask_draft_logits(reqs, logits)
        greedy = [r.sampling_params.greedy for r in reqs]
        if all(greedy):
            return argmax_rows(logits).tolist(), [None] * len(reqs)
        md_s = SamplingMetadata.from_params([r.sampling_params for r in reqs],
                                            [s.generator for s in seqs], self.model.device)
        q = processed_probs(logits, md_s, torch.arange(len(reqs), device=self.model.device))
        toks: list[int] = []
        probs: list[torch.Tensor | None] = []
        for j, (s, g) in enumerate(zip(seqs, greedy)):
            if g:
                toks.append(int(logits[j].argmax()))
                probs.append(None)
            else:
                toks.append(int(torch.multinomial(q[j], 1, generator=s.generator)))
                probs.append(q[j])
        return toks, probs

    @staticmethod
    def _pack(requests: Sequence[Request], k_per_request: Sequence[int],
              out_tokens: dict[str, list[int]], out_probs: dict[str, list[torch.Tensor]]
              ) -> Drafts:
        tokens, probs, skips = [], [], []
        for r, k in zip(requests, k_per_request):
            t = out_tokens.get(r.request_id, [])
            tokens.append(t)
            p = out_probs.get(r.request_id)
            probs.append(torch.stack(p) if p and len(p) == len(t) else None)
            skips.append("drafter_kv" if k > 0 and not t else None)
        return Drafts(tokens, probs, skips)
