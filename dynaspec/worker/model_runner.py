"""Turns a StepPlan into one target forward: drafts, flat inputs, logits, verification.

Drafters that need nothing from the target (n-gram, a draft model) run here, after the batch is
formed and before the forward, so the K chosen for a batch is the K that batch verifies.
A request with d drafts gets d+1 logits rows in the same forward as everyone else's prefill
chunks and decodes. `worker/draft_rows.py` lays the drafts out as frozen rows and
`worker/verify.py` verifies them: accepted drafts plus one token per request.

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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from dynaspec.attention.backend import AttentionBatch
from dynaspec.models.llama import LlamaModel
from dynaspec.outputs import RequestResult, RunnerOutput
from dynaspec.request import Request
from dynaspec.sample.logits_processor import LogitsProcessing
from dynaspec.sample.metadata import SamplingMetadata
from dynaspec.sample.synthetic import SyntheticVerifier
from dynaspec.spec_decode.drafters.base import HiddenStates, Proposer
from dynaspec.spec_decode.drafters.grammar_draft import GrammarDrafter
from dynaspec.step_plan import BatchDescriptor, StepPlan
from dynaspec.structured.manager import StructuredOutputManager
from dynaspec.structured.step import GrammarStep
from dynaspec.worker import draft_rows, tree_step
from dynaspec.worker.compiled import FixedShapeExecutor
from dynaspec.worker.draft_rows import DraftRows
from dynaspec.worker.input_buffers import InputBuffers
from dynaspec.worker.tree_step import TreeRows
from dynaspec.worker.verify import verify

log = logging.getLogger("dynaspec")


@dataclass(frozen=True)
class StepInputs:
    """One step's flat inputs, real requests only (padded rows are added by the fixed path);
    `_flatten` fills the lists, nothing changes them after."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    sampling: list[tuple[int, int]] = field(default_factory=list)  # (scheduled index, num drafts)
    argmax_rows: torch.Tensor | None = None  # [R] bool: logit rows read only for their argmax
    tree_masks: list[torch.Tensor | None] | None = None  # per request: its rows' tree visibility


def argmax_only_rows(reqs: list[Request], sampling: list[tuple[int, int]]) -> torch.Tensor | None:
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


@dataclass(frozen=True, kw_only=True)
class PreparedStep:
    """A step ready for the forward: built from the requests on the engine thread."""

    out: StepPlan
    inputs: StepInputs
    rows: DraftRows  # every scheduled request's drafts, as verified
    trees: dict[str, TreeRows]  # requests verifying a tree: where its nodes' K/V sit
    grammar: GrammarStep | None  # structured output's per-step state
    logits_proc: LogitsProcessing | None = None  # penalties, logit_bias, min_tokens, bans
    draft_seconds: float = 0.0
    prepare_seconds: float = 0.0
    draft_setup_seconds: float = 0.0  # of draft_seconds, the drafter's once-per-request work
    draft_fallback_seconds: float = 0.0  # of draft_seconds, a fallback drafter's

    @property
    def drafts(self) -> dict[str, list[int]]:
        """Request id -> the drafts its row verifies (-1 pads included)."""
        return self.rows.drafts()


@dataclass(frozen=True)
class Forward:
    """What one target forward returns: the logits rows, the path it ran, when the model started
    (after the inputs were loaded) and what it captured on the way."""

    logits: torch.Tensor  # [R, vocab], the step's logit rows
    batch: BatchDescriptor  # the path it ran (eager when a fixed-shape step could not)
    started: float  # perf_counter when the model call began
    hidden: torch.Tensor | None = None  # [T, features] for a hidden-state drafter, else None
    argmax: torch.Tensor | None = None  # [R] each row's argmax, on the device (a CUDA graph's)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                 proposer: Proposer | None, seed: int, buffers: InputBuffers | None = None,
                 executor: FixedShapeExecutor | None = None,
                 synthetic: SyntheticVerifier | None = None,
                 structured: StructuredOutputManager | None = None,
                 eos_token_ids: tuple[int, ...] = (), hidden_sink: Proposer | None = None,
                 grammar_drafter: GrammarDrafter | None = None) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        # An EAGLE-style proposer: gets the hidden states of each step's verified tokens.
        self.hidden_sink = hidden_sink
        self.device = model.device
        self.proposer = proposer
        self.generators: dict[str, torch.Generator] = {}
        self._seed_source = torch.Generator().manual_seed(seed)
        self.synthetic = synthetic  # --rejection-mode synthetic: NOT lossless
        self.structured = structured
        self.grammar_drafter = grammar_drafter  # forced drafts first (docs/design.md §4d)
        self.buffers = buffers
        self.executor = executor
        self.eos_token_ids = eos_token_ids  # min_tokens bans them

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

    def execute(self, out: StepPlan) -> RunnerOutput:
        return self.run(self.prepare(out))

    def prepare(self, out: StepPlan) -> PreparedStep:
        """Drafts, tree admission, grammar cuts, padding, flat inputs and sampling state:
        everything read from requests. Runs on the engine thread; `run` then reads only the
        PreparedStep (async scheduling runs it on a worker thread while the engine mutates
        requests)."""
        t0 = time.perf_counter()
        if self.proposer is not None:
            for rid in out.preempted_ids:
                self.proposer.preempt(rid)  # a preempted request must not keep drafter KV blocks
        got = draft_rows.propose(self.proposer, out, self.synthetic, self.grammar_drafter)
        # The step's trees that run as trees (worker/tree_step.py); the rest become chains.
        admitted = tree_step.admit(out, got.trees, got.probs, plain=self.synthetic is None)
        drafts = {**got.tokens, **admitted.chains}
        t1 = time.perf_counter()
        # Structured output: the grammar checks the drafts before they are verified
        # (docs/design.md §7c); the rows keep them up to its cuts, padded to the planned width.
        grammar = self.structured.begin_step(out.scheduled, drafts) \
            if self.structured is not None else None
        reqs = [s.request for s in out.scheduled if s.sampling]
        md = SamplingMetadata.from_params([r.sampling_params for r in reqs],
                                          [self._generator(r) for r in reqs], self.device) \
            if reqs else None
        rows = draft_rows.build(out, got, drafts, {r: t.tree for r, t in admitted.trees.items()},
                                grammar.cuts if grammar is not None else {}, md)
        inputs = self._flatten(out, rows, admitted.trees)
        # After the grammar cut: rows are processed with the drafts they actually verify.
        proc = LogitsProcessing.build(reqs, inputs.sampling, rows.drafts(), self.eos_token_ids)
        return PreparedStep(out=out, inputs=inputs, rows=rows, trees=admitted.trees,
                            grammar=grammar, logits_proc=proc, draft_seconds=t1 - t0,
                            prepare_seconds=time.perf_counter() - t1,
                            draft_setup_seconds=got.setup_seconds,
                            draft_fallback_seconds=got.fallback_seconds)

    def run(self, p: PreparedStep) -> RunnerOutput:
        """The target forward and verification of a prepared step."""
        t_run = time.perf_counter()
        fwd = self._forward(p.inputs, p.out.batch)
        t2, t3 = fwd.started, time.perf_counter()
        results = verify(fwd.logits, p.rows, grammar=p.grammar, processing=p.logits_proc,
                         synthetic=self.synthetic, graph_argmax=fwd.argmax)
        if p.trees:
            tree_step.move_accepted(self.kv_caches, self.block_size, [
                (p.trees[r.request_id], r.tree_path) for r in results
                if r.request_id in p.trees and r.tree_path])
        if self.hidden_sink is not None and fwd.hidden is not None:
            self._observe(self.hidden_sink, p, results, fwd.hidden)
        t4 = time.perf_counter()
        g = p.grammar
        return RunnerOutput(results=results, prepare_seconds=p.prepare_seconds + (t2 - t_run),
                            draft_seconds=p.draft_seconds,
                            draft_setup_seconds=p.draft_setup_seconds,
                            draft_fallback_seconds=p.draft_fallback_seconds,
                            forward_seconds=t3 - t2, sample_seconds=t4 - t3,
                            grammar_seconds=g.seconds if g is not None else 0.0,
                            grammar_rows=g.num_rows if g is not None else 0, batch=fwd.batch,
                            verified_width=1 + max((n for _, n in p.inputs.sampling), default=0))

    @staticmethod
    def _observe(sink: Proposer, p: PreparedStep, results: tuple[RequestResult, ...],
                 hidden: torch.Tensor) -> None:
        """Hand the drafter the hidden states [T, features] of each request's verified tokens:
        its new tokens and the drafts it accepted (rows of rejected drafts and pads are left
        out)."""
        if hidden.shape[0] != len(p.inputs.ids):
            return
        drafted = dict(p.inputs.sampling)  # scheduled index -> drafts verified
        ids, starts, positions, valid = [], [], [], []
        rows: list[int] = []  # the verified rows; a tree's path is not its first rows
        o = 0
        for i, (s, q) in enumerate(zip(p.out.scheduled, p.inputs.query_lens)):
            if q > 0:
                rid = s.request.request_id
                keep = tree_step.verified_rows(q, drafted.get(i), results[i].num_accepted_tokens,
                                               results[i].tree_path if rid in p.trees else None)
                ids.append(rid)
                starts.append(len(rows) if p.trees else o)
                positions.append(p.inputs.positions[o])
                valid.append(len(keep))
                rows.extend(o + r for r in keep)
            o += q
        if p.trees:  # gathered, so each request's verified rows lie together from its start
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        sink.observe_hidden(HiddenStates(ids, starts, positions, valid, hidden))

    def _flatten(self, out: StepPlan, rows: DraftRows,
                 trees: dict[str, TreeRows] | None = None) -> StepInputs:
        x = StepInputs(tree_masks=[] if trees else None)
        for i, s in enumerate(out.scheduled):
            req, c = s.request, s.request.num_computed_tokens
            d = rows.rows[i].tokens
            toks = req.token_slice(c, c + s.num_new_tokens) + list(d)
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
        return replace(x, argmax_rows=argmax_only_rows(
            [out.scheduled[i].request for i, _ in x.sampling], x.sampling))

    def _forward(self, x: StepInputs, batch: BatchDescriptor) -> Forward:
        """The step's forward, with the hidden states a hidden-state drafter reads (the model
        keeps its last capture; a path that captures nothing leaves None)."""
        if self.hidden_sink is None:
            return self._run_path(x, batch)
        self.model.aux_hidden = None
        fwd = self._run_path(x, batch)
        return replace(fwd, hidden=self.model.aux_hidden)

    def _run_path(self, x: StepInputs, batch: BatchDescriptor) -> Forward:
        """Runs the step on the descriptor's path; a fixed-shape step whose executor cannot run it
        (budget spent, build failed) runs eager and reports the eager descriptor."""
        if batch.fixed_shape:
            ex = self.executor
            if (
                ex is not None
                and ex.path == batch.path
                and batch.width is not None  # a fixed-shape batch has one
                and ex.ready(batch.num_reqs_padded, batch.width)
            ):
                try:
                    return self._forward_fixed(x, batch, ex)
                except Exception as exc:  # noqa: BLE001 - eager is always correct
                    ex.fail((batch.num_reqs_padded, batch.width), exc)
            batch = replace(batch, path="eager", num_tokens_padded=len(x.ids))
        return self._run_eager(x, batch)

    def _run_eager(self, x: StepInputs, batch: BatchDescriptor) -> Forward:
        attn = self.model.attn
        md = attn.build_metadata(AttentionBatch(x.query_lens, x.context_lens, x.block_tables,
                                                self.block_size, self.device,
                                                tree_masks=x.tree_masks))
        ids, pos, rows = self._load(x.ids, x.positions, x.logit_rows)
        assert rows is not None  # the logit rows were given
        t2 = time.perf_counter()
        logits = self.model.forward(ids, pos, self.kv_caches, md, rows, attn,
                                    argmax_rows=x.argmax_rows)
        return Forward(logits, batch, t2)

    def _forward_fixed(self, x: StepInputs, batch: BatchDescriptor,
                       ex: FixedShapeExecutor) -> Forward:
        W, B, n = batch.width, batch.num_reqs_padded, len(x.query_lens)
        assert W is not None and self.buffers is not None  # fixed shape; the builder gives both
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
        return Forward(self.model.head(h[rows], x.argmax_rows), batch, t2)

    def _forward_graph(self, x: StepInputs, batch: BatchDescriptor,
                       ex: FixedShapeExecutor) -> Forward:
        """CUDA: every real row is a logit row (W per request), so the logits are the first
        n*W rows of the graph's output; its argmax is kept for a greedy `_sample`."""
        B, W, n = batch.num_reqs_padded, batch.width, len(x.query_lens)
        assert W is not None and self.buffers is not None  # fixed shape; the builder gives both
        ab = AttentionBatch(x.query_lens, x.context_lens, x.block_tables, self.block_size,
                            self.device, B, W, self.buffers.attn)
        md = ex.backend.build_metadata(ab)
        ids = self.buffers.input_ids[: B * W]  # pad rows keep earlier ids: never sampled
        host = torch.tensor(x.ids, dtype=torch.long).clamp_(min=0).pin_memory()
        ids[: n * W].copy_(host, non_blocking=True)
        t2 = time.perf_counter()
        logits, top = ex.run(ids, None, md)
        return Forward(logits[: n * W], batch, t2, argmax=top[: n * W])

    def precompile(self, shapes: Sequence[tuple[int, int]]) -> float:
        """Build the fixed-shape executor for each (padded requests, width) now, with steps made
        only of padded rows (they write only the scratch block). Returns the seconds spent."""
        ex, t0 = self.executor, time.perf_counter()
        for b, w in shapes:
            if ex is None or not ex.ready(b, w):
                continue
            assert self.buffers is not None  # an executor comes with the buffers (builder)
            ab = AttentionBatch([], [], [], self.block_size, self.device, b, w, self.buffers.attn)
            md = ex.backend.build_metadata(ab)
            ids, pos, _ = self._load([0] * (b * w), list(range(w)) * b, None)
            try:
                ex.run(ids, pos, md)
            except Exception as exc:  # noqa: BLE001 - that shape runs eager
                ex.fail((b, w), exc)
        return time.perf_counter() - t0

    def _load(self, ids: list[int], positions: list[int], rows: list[int] | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.buffers is None or len(ids) > self.buffers.max_tokens:
            t = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
            return t(ids).clamp_(min=0), t(positions), None if rows is None else t(rows)
        return self.buffers.load(ids, positions, rows)
