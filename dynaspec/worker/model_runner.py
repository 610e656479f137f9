"""Turns a StepPlan into one target forward: drafts, flat inputs, logits, verification.

Drafters that need nothing from the target (n-gram, a draft model) run here, after the batch is
formed and before the forward, so the K chosen for a batch is the K that batch verifies.
A request with d drafts gets d+1 logits rows in the same forward as everyone else's prefill
chunks and decodes; the rejection sampler returns accepted drafts plus one token per request.

The step's shape and path come from the plan's `BatchDescriptor`, never from the inputs: on a
fixed-shape path every request's drafts (after the grammar's cut) are padded to width-1 with -1
(`step_width.pad_row`) and the rows to `num_reqs_padded`, and the fixed-shape executor
(torch.compile / CUDA graphs) runs it over the persistent input buffers; otherwise the eager
attention backend runs the ragged batch. The runner never changes a width: it reports per
request what was drafted, verified and accepted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dynaspec.attention.backend import AttentionBatch
from dynaspec.draft_tree import DraftTree, tree_walk
from dynaspec.models.llama import LlamaModel
from dynaspec.outputs import RequestResult, RunnerOutput
from dynaspec.request import Request
from dynaspec.sample.logits_processor import LogitsProcessing
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.rejection_sampler import greedy_from_argmax, rejection_sample
from dynaspec.sample.sampler import Sampler
from dynaspec.sample.synthetic import SyntheticVerifier
from dynaspec.spec_decode import step_width as width
from dynaspec.spec_decode.base import Drafts, Proposer
from dynaspec.spec_decode.eagle import HiddenStates
from dynaspec.step_plan import BatchDescriptor, StepPlan
from dynaspec.structured.manager import StructuredOutputManager
from dynaspec.worker import tree_step
from dynaspec.worker.compiled import FixedShapeExecutor
from dynaspec.worker.input_buffers import InputBuffers
from dynaspec.worker.tree_step import TreeRows

log = logging.getLogger("dynaspec")

@dataclass
class StepInputs:
    """One step's flat inputs, real requests only (padded rows are added by the fixed path)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    sampling: list[tuple[int, int]] = field(default_factory=list)  # (scheduled index, num drafts)
    argmax_rows: torch.Tensor | None = None  # [R] bool: logit rows read only for their argmax
    tree_masks: list[torch.Tensor | None] | None = None  # per request: its rows' tree visibility


def argmax_only_rows(reqs: list, sampling: list[tuple[int, int]]) -> torch.Tensor | None:
    """[R] bool over the step's logit rows (request after request, drafts + 1 each): True where
    only the row's argmax is read (greedy, no logprobs, no logits processing, no grammar), so the
    model may leave its logits away from the maximum approximate (`LlamaModel.head`). None when
    no row qualifies."""
    flags: list[bool] = []
    for req, (_, n) in zip(reqs, sampling):
        sp = req.sampling_params
        only = (sp.greedy and sp.logprobs is None and not sp.processes_logits
                and sp.structured_output is None)
        flags.extend([only] * (n + 1))
    return torch.tensor(flags, dtype=torch.bool) if any(flags) else None


@dataclass
class PreparedStep:
    """A step ready for the forward: built from the requests on the engine thread."""

    out: StepPlan
    batch: BatchDescriptor
    inputs: StepInputs
    drafts: dict[str, list[int]]  # request id -> the row's draft ids (-1 pads included)
    draft_probs: dict[str, torch.Tensor | None]
    draft_skips: dict[str, str]
    num_valid: dict[str, int]  # request id -> real drafts in its row (after the grammar's cut)
    num_cut: dict[str, int]  # request id -> drafts the grammar cut
    grammar: Any  # structured output's per-step state, or None
    sampling_md: SamplingMetadata | None  # None when no request samples this step
    logits_proc: LogitsProcessing | None = None  # penalties, logit_bias, min_tokens, bans
    draft_seconds: float = 0.0
    prepare_seconds: float = 0.0
    draft_setup_seconds: float = 0.0  # of draft_seconds, the drafter's once-per-request work
    # A drafter with a fallback: the requests the fallback drafted, and its seconds.
    draft_fallback: frozenset[str] = frozenset()
    draft_fallback_seconds: float = 0.0
    trees: dict[str, TreeRows] = field(default_factory=dict)  # requests verifying a tree


@dataclass
class _StepDrafts:
    """What the drafter gave a step, per request id (real drafts only, before any padding)."""

    tokens: dict[str, list[int]]
    probs: dict[str, torch.Tensor | None]
    skips: dict[str, str]
    setup_seconds: float = 0.0  # Drafts.setup_seconds
    fallback: frozenset[str] = frozenset()  # requests the fallback drafted
    fallback_seconds: float = 0.0
    trees: dict[str, DraftTree] = field(default_factory=dict)  # drafts that are a real tree


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                 proposer: Proposer | None, seed: int, buffers: InputBuffers | None = None,
                 executor: FixedShapeExecutor | None = None,
                 synthetic: SyntheticVerifier | None = None,
                 structured: StructuredOutputManager | None = None,
                 eos_token_ids: tuple[int, ...] = (), hidden_sink: Proposer | None = None) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        # An EAGLE-style proposer: gets the hidden states of each step's verified tokens.
        self.hidden_sink = hidden_sink
        self.device = model.device
        self.proposer = proposer
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self._seed_source = torch.Generator().manual_seed(seed)
        self.synthetic = synthetic  # --rejection-mode synthetic: NOT lossless
        self.structured = structured
        self.buffers = buffers
        self.executor = executor
        self.eos_token_ids = eos_token_ids  # min_tokens bans them
        self._graph_top: torch.Tensor | None = None

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.synthetic is not None:
            self.synthetic.forget(request_id)
        if self.structured is not None:
            self.structured.forget(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def _generator(self, req: Request) -> torch.Generator:
        g = self.generators.get(req.request_id)
        if g is None:
            seed = req.sampling_params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[req.request_id] = g
        return g

    def _draft(self, out: StepPlan) -> _StepDrafts:
        """Real drafts only, at most each request's cap; padding comes after the grammar."""
        got = _StepDrafts({}, {}, {})
        idx = [i for i, s in enumerate(out.scheduled) if s.draft_budget > 0]
        if not idx or self.proposer is None:
            return got
        sched = [out.scheduled[i] for i in idx]
        reqs = [s.request for s in sched]
        ks = [s.draft_budget for s in sched]
        if self.proposer.has_fallback:
            fks = [s.draft_budget if s.fallback_budget is None else s.fallback_budget
                   for s in sched]
            drafts: Drafts = self.proposer.propose(reqs, ks, fallback_k=fks)
        elif self.proposer.drafts_trees:  # the K policy chose each request's shape
            drafts = self.proposer.propose(reqs, ks, trees=[s.draft_tree for s in sched])
        else:
            drafts = self.proposer.propose(reqs, ks)
        got.setup_seconds, got.fallback_seconds = drafts.setup_seconds, drafts.fallback_seconds
        fallback = set()
        for j, req in enumerate(reqs):
            d = list(drafts.token_ids[j][: ks[j]])
            tree = drafts.trees[j] if drafts.trees is not None else None
            if tree is not None and len(tree):
                tree = tree.cut(ks[j])  # a node budget, like a chain's cap
                d = list(tree.tokens)
                if not tree.is_chain:
                    got.trees[req.request_id] = tree
            if self.synthetic is not None:
                d = self.synthetic.cut(d)  # no coin-flip EOS (see SyntheticVerifier)
            if d:
                got.tokens[req.request_id] = d
                got.probs[req.request_id] = drafts.probs[j] if drafts.probs is not None else None
                if drafts.from_fallback is not None and drafts.from_fallback[j]:
                    fallback.add(req.request_id)
            else:
                got.skips[req.request_id] = drafts.skip_reasons[j] or "no_match"
        got.fallback = frozenset(fallback)
        return got

    @staticmethod
    def _pad(out: StepPlan, tokens: dict[str, list[int]], probs: dict) -> None:
        """On a fixed-shape step every sampling row verifies exactly the planned width."""
        if out.batch.fixed_shape:
            for s in out.scheduled:
                if s.sampling:
                    rid = s.request.request_id
                    tokens[rid] = width.pad_row(tokens.get(rid, []), out.batch.width)
        for rid, p in probs.items():
            if p is not None:
                probs[rid] = width.pad_probs(p, len(tokens[rid]))

    def execute(self, out: StepPlan) -> RunnerOutput:
        return self.run(self.prepare(out))

    def prepare(self, out: StepPlan) -> PreparedStep:
        """Drafts, grammar cuts, padding, flat inputs and sampling state: everything read from
        requests. Runs on the engine thread; `run` then reads only the PreparedStep (async
        scheduling runs it on a worker thread while the engine mutates requests)."""
        t0 = time.perf_counter()
        if self.proposer is not None:
            for rid in out.preempted_ids:
                self.proposer.preempt(rid)  # a preempted request must not keep drafter KV blocks
        got = self._draft(out)
        drafts, draft_probs, draft_skips = got.tokens, got.probs, got.skips
        trees = self._admit_trees(out, got, drafts)
        t1 = time.perf_counter()
        num_real = {rid: len(d) for rid, d in drafts.items()}
        # Structured output: cut grammar-invalid drafts before they are verified (docs/design.md
        # §7c);
        # the row is padded back to the planned width after the cut.
        grammar = self.structured.begin_step(out.scheduled, drafts, draft_probs) \
            if self.structured is not None else None
        num_valid = {rid: len(d) for rid, d in drafts.items()}
        num_cut = {rid: n - num_valid.get(rid, 0) for rid, n in num_real.items()}
        self._pad(out, drafts, draft_probs)
        inputs = self._flatten(out, drafts, trees)
        reqs = [out.scheduled[i].request for i, _ in inputs.sampling]
        inputs.argmax_rows = argmax_only_rows(reqs, inputs.sampling)
        md = SamplingMetadata.from_params([r.sampling_params for r in reqs],
                                          [self._generator(r) for r in reqs], self.device) \
            if reqs else None
        # After the grammar cut: rows are processed with the drafts they actually verify.
        proc = LogitsProcessing.build(reqs, inputs.sampling, drafts, self.eos_token_ids)
        return PreparedStep(out, out.batch, inputs, drafts, draft_probs, draft_skips, num_valid,
                            num_cut, grammar, md, proc, t1 - t0, time.perf_counter() - t1,
                            got.setup_seconds, got.fallback, got.fallback_seconds, trees)

    def _admit_trees(self, out: StepPlan, got: _StepDrafts, drafts: dict[str, list[int]]
                     ) -> dict[str, TreeRows]:
        """The step's trees that run as trees (worker/tree_step.py); the rest become chains."""
        if not got.trees:
            return {}
        return tree_step.admit(out, got.trees, got.probs, drafts,
                               plain=self.synthetic is None and self.hidden_sink is None)

    def run(self, p: PreparedStep) -> RunnerOutput:
        """The target forward and verification of a prepared step."""
        t_run = time.perf_counter()
        self._graph_top = None  # set by a CUDA-graph step: each row's argmax, on the device
        if self.hidden_sink is not None:
            self.model.aux_hidden = None  # a path that captures nothing leaves it None
        logits, batch, t2 = self._forward(p.inputs, p.batch)  # [R, vocab]
        t3 = time.perf_counter()
        if p.grammar is not None:
            p.grammar.mask(logits, p.inputs.sampling)
        if p.logits_proc is not None:
            p.logits_proc.apply(logits)
        results = self._sample(p, logits)
        if p.trees:
            tree_step.move_accepted(self.kv_caches, self.block_size, [
                (p.trees[r.request_id], r.tree_path) for r in results
                if r.request_id in p.trees and r.tree_path])
        if self.hidden_sink is not None:
            self._observe(p, results)
        if p.grammar is not None:
            p.grammar.commit(results)
        t4 = time.perf_counter()
        res = RunnerOutput(results, prepare_seconds=p.prepare_seconds + (t2 - t_run),
                           draft_seconds=p.draft_seconds,
                           draft_setup_seconds=p.draft_setup_seconds,
                           draft_fallback_seconds=p.draft_fallback_seconds,
                           forward_seconds=t3 - t2,
                           sample_seconds=t4 - t3, batch=batch,
                           verified_width=1 + max((n for _, n in p.inputs.sampling), default=0))
        if p.grammar is not None:
            res.grammar_seconds, res.grammar_rows = p.grammar.seconds, p.grammar.num_rows
        return res

    def _observe(self, p: PreparedStep, results: list[RequestResult]) -> None:
        """Hand the drafter the hidden states of each request's verified tokens: its new tokens
        and the drafts it accepted (rows of rejected drafts and pads are left out)."""
        hidden = self.model.aux_hidden  # [T, features], or None where the path captured nothing
        if hidden is None or hidden.shape[0] != len(p.inputs.ids):
            return
        drafted = dict(p.inputs.sampling)  # scheduled index -> drafts verified
        ids, starts, positions, valid = [], [], [], []
        o = 0
        for i, (s, q) in enumerate(zip(p.out.scheduled, p.inputs.query_lens)):
            if q > 0:
                n = drafted.get(i)
                ids.append(s.request.request_id)
                starts.append(o)
                positions.append(p.inputs.positions[o])
                valid.append(q if n is None else q - n + results[i].num_accepted_tokens)
            o += q
        self.hidden_sink.observe_hidden(HiddenStates(ids, starts, positions, valid, hidden))

    def _flatten(self, out: StepPlan, drafts: dict[str, list[int]],
                 trees: dict[str, TreeRows] | None = None) -> StepInputs:
        x = StepInputs()
        if trees:
            x.tree_masks = []
        for i, s in enumerate(out.scheduled):
            req, c = s.request, s.request.num_computed_tokens
            d = drafts.get(req.request_id, [])
            toks = req.token_slice(c, c + s.num_new_tokens) + d
            start = len(x.ids)
            x.ids.extend(toks)
            tree = trees.get(req.request_id) if trees else None
            if tree is None:
                x.positions.extend(range(c, c + len(toks)))
            else:  # a tree's nodes sit at their depth past the root (docs/design.md §4c)
                x.positions.extend(tree_step.positions(c, s.num_new_tokens, tree.tree))
            if x.tree_masks is not None:
                x.tree_masks.append(None if tree is None else
                                    tree_step.visibility(s.num_new_tokens, tree.tree))
            x.query_lens.append(len(toks))
            x.context_lens.append(c + len(toks))
            x.block_tables.append(s.block_table)
            if s.sampling:
                x.logit_rows.extend(range(start + len(toks) - len(d) - 1, start + len(toks)))
                x.sampling.append((i, len(d)))
        return x

    def _forward(self, x: StepInputs, batch: BatchDescriptor
                 ) -> tuple[torch.Tensor, BatchDescriptor, float]:
        """Runs the step on the descriptor's path; a fixed-shape step whose executor cannot run it
        (budget spent, build failed) runs eager and reports the eager descriptor."""
        if batch.fixed_shape:
            ex = self.executor
            if (
                ex is not None
                and ex.path == batch.path
                and ex.ready(batch.num_reqs_padded, batch.width)
            ):
                try:
                    return self._forward_fixed(x, batch, ex)
                except Exception as exc:  # noqa: BLE001 - eager is always correct
                    ex.fail((batch.num_reqs_padded, batch.width), exc)
            batch = replace(batch, path="eager", num_tokens_padded=len(x.ids))
        return self._run_eager(x, batch)

    def _run_eager(self, x: StepInputs, batch: BatchDescriptor):
        attn = self.model.attn
        md = attn.build_metadata(AttentionBatch(x.query_lens, x.context_lens, x.block_tables,
                                                self.block_size, self.device,
                                                tree_masks=x.tree_masks))
        ids, pos, rows = self._load(x.ids, x.positions, x.logit_rows)
        t2 = time.perf_counter()
        logits = self.model.forward(ids, pos, self.kv_caches, md, rows, attn,
                                    argmax_rows=x.argmax_rows)
        return logits, batch, t2

    def _forward_fixed(self, x: StepInputs, batch: BatchDescriptor, ex: FixedShapeExecutor):
        W, B, n = batch.width, batch.num_reqs_padded, len(x.query_lens)
        if any(q != W for q in x.query_lens) or n > B:
            raise RuntimeError(f"fixed-shape step ({B} x {W}) got query lengths {x.query_lens}")
        if ex.path == "cuda_graph":  # the whole step in one graph (worker/compiled.py)
            return self._forward_graph(x, batch, ex)
        pad_rows = B - n
        ids = x.ids + [0] * (pad_rows * W)
        positions = x.positions + list(range(W)) * pad_rows
        ab = AttentionBatch(x.query_lens, x.context_lens, x.block_tables, self.block_size,
                            self.device, B, W, self.buffers.attn)
        md = ex.backend.build_metadata(ab)
        ids_v, pos_v, _ = self._load(ids, positions, None)
        t2 = time.perf_counter()
        h = ex.run(ids_v, pos_v, md)  # [B*W, hidden]: every row, real and padded
        rows = torch.tensor(x.logit_rows, dtype=torch.long, device=h.device)
        return self.model.head(h[rows], x.argmax_rows), batch, t2

    def _forward_graph(self, x: StepInputs, batch: BatchDescriptor, ex: FixedShapeExecutor):
        """CUDA: every real row is a logit row (W per request), so the logits are the first
        n*W rows of the graph's output; its argmax is kept for a greedy `_sample`."""
        B, W, n = batch.num_reqs_padded, batch.width, len(x.query_lens)
        ab = AttentionBatch(x.query_lens, x.context_lens, x.block_tables, self.block_size,
                            self.device, B, W, self.buffers.attn)
        md = ex.backend.build_metadata(ab)
        ids = self.buffers.input_ids[: B * W]  # pad rows keep earlier ids: never sampled
        host = torch.tensor(x.ids, dtype=torch.long).clamp_(min=0).pin_memory()
        ids[: n * W].copy_(host, non_blocking=True)
        t2 = time.perf_counter()
        logits, top = ex.run(ids, None, md)
        self._graph_top = top[: n * W]
        return logits[: n * W], batch, t2

    def precompile(self, shapes) -> float:
        """Build the fixed-shape executor for each (padded requests, width) now, with steps made
        only of padded rows (they write only the scratch block). Returns the seconds spent."""
        ex, t0 = self.executor, time.perf_counter()
        for b, w in shapes:
            if ex is None or not ex.ready(b, w):
                continue
            ab = AttentionBatch([], [], [], self.block_size, self.device, b, w, self.buffers.attn)
            md = ex.backend.build_metadata(ab)
            ids, pos, _ = self._load([0] * (b * w), list(range(w)) * b, None)
            try:
                ex.run(ids, pos, md)
            except Exception as exc:  # noqa: BLE001 - that shape runs eager
                ex.fail((b, w), exc)
        return time.perf_counter() - t0

    def _load(self, ids: list[int], positions: list[int], rows: list[int] | None):
        if self.buffers is None or len(ids) > self.buffers.max_tokens:
            t = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
            return t(ids).clamp_(min=0), t(positions), None if rows is None else t(rows)
        return self.buffers.load(ids, positions, rows)

    def _sample(self, p: PreparedStep, logits: torch.Tensor) -> list[RequestResult]:
        out, sampling, md = p.out, p.inputs.sampling, p.sampling_md
        results = [
            RequestResult(s.request.request_id, [], 0, 0, s.skip_reason) for s in out.scheduled
        ]
        if not sampling:
            return results
        reqs = [out.scheduled[i].request for i, _ in sampling]
        paths: dict[str, list[int]] = {}
        if self._graph_top is not None and md.all_greedy and self.synthetic is None \
                and p.logits_proc is None and p.grammar is None and not p.trees:
            # Greedy on the CUDA-graph path: the argmax came out of the graph; one copy.
            tokens = greedy_from_argmax(self._graph_top.tolist(),
                                        [p.drafts.get(r.request_id, []) for r in reqs])
        elif p.trees:
            tokens = tree_step.verify_step(
                logits, [r.request_id for r in reqs], sampling, md,
                {rid: t.tree for rid, t in p.trees.items()}, paths,
                lambda sub, idx, k: self._verify_chains(p, sub, [reqs[i] for i in idx], k,
                                                        tree_step.subset(md, idx)))
        elif any(n for _, n in sampling):
            tokens = self._verify_chains(p, logits, reqs, [n for _, n in sampling], md)
        else:
            tokens = [[t] for t in self.sampler(logits, md).token_ids.tolist()]
        row = 0
        for (i, n), req, toks in zip(sampling, reqs, tokens):
            r = results[i]
            r.token_ids = toks
            rid = req.request_id
            valid = p.num_valid.get(rid, 0)
            r.num_draft_tokens, r.num_accepted_tokens = valid, len(toks) - 1
            r.drafts_from_fallback = valid > 0 and rid in p.draft_fallback
            if rid in p.trees:
                r.tree_path = paths[rid]
                r.num_tree_nodes, r.tree_depth = len(p.trees[rid].tree), p.trees[rid].tree.depth
                r.tree_walk = tree_walk(p.trees[rid].tree, paths[rid])
            # Slots cut (by the grammar, or found invalid under async scheduling) are pads on a
            # fixed-shape row and not in the row at all on eager; each counts under its reason.
            r.num_async_invalid_tokens = out.scheduled[i].num_async_invalid
            r.num_padding_tokens = width.num_padding(n, valid, p.num_cut.get(rid, 0)
                                                     + r.num_async_invalid_tokens)
            if valid == 0 and r.skip_reason is None and n == 0:
                r.skip_reason = p.draft_skips.get(req.request_id)
            if req.sampling_params.logprobs is not None:
                r.logprobs = _logprobs(
                    logits[row : row + len(toks)], toks, req.sampling_params.logprobs
                )
            row += n + 1
        return results


    def _verify_chains(self, p: PreparedStep, logits: torch.Tensor, reqs: list,
                       num_draft: list[int], md: SamplingMetadata) -> list[list[int]]:
        dt = [p.drafts.get(r.request_id, []) for r in reqs]
        if self.synthetic is not None:
            return self.synthetic(logits, num_draft, dt, md, [r.request_id for r in reqs])
        dp = [p.draft_probs.get(r.request_id) for r in reqs]
        return rejection_sample(logits, num_draft, dt,
                                dp if any(q is not None for q in dp) else None, md)


def _logprobs(rows: torch.Tensor, tokens: list[int], top_n: int) -> list:
    # Clamped: a grammar-masked token has logprob -inf, which JSON cannot carry.
    lp = torch.log_softmax(rows.float(), dim=-1).clamp_(min=-9999.0)  # [len(tokens), vocab]
    out = []
    for j, t in enumerate(tokens):
        top = torch.topk(lp[j], top_n) if top_n > 0 else None
        tops = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        out.append((float(lp[j, t]), tops))
    return out
