"""StructuredOutputManager: compiles grammars (cached, off the engine thread) and owns each
request's grammar state (matcher) for the runner's per-step hooks.

Compilation happens before a request enters the scheduler: `LLMEngine.add_request` compiles
through the cache, and the server compiles in a worker thread before it adds the request, so the
engine thread only ever finds compiled grammars and no step waits on a compile. `compile` is
thread-safe; everything else runs on the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from dynaspec.request import Request
from dynaspec.step_plan import ScheduledRequest
from dynaspec.structured.backend import GrammarBackend, Matcher, allocate_bitmask, load_backend
from dynaspec.structured.step import GrammarStep
from dynaspec.structured_params import StructuredOutputParams

_CACHE_SIZE = 256  # compiled grammars kept (LRU); a compiled JSON schema is a few hundred KB


class StructuredOutputManager:
    def __init__(self, backend_name: str, tokenizer, vocab_size: int,
                 stop_token_ids: Sequence[int], any_whitespace: bool) -> None:
        self._backend_args = (backend_name, tokenizer, vocab_size, tuple(stop_token_ids),
                              any_whitespace)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._new_compile_seconds: list[float] = []  # drained into the next StepStats
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0
        self.matchers: dict[str, Matcher] = {}  # engine thread only
        self._draft_fed: dict[str, int] = {}  # drafts a borrowed matcher advanced over

    # ---- compilation (any thread) ----------------------------------------------------------
    def backend(self) -> GrammarBackend:
        """The grammar library, loaded on first use (raises naming the extra when missing)."""
        with self._lock:
            if self._backend is None:
                self._backend = load_backend(*self._backend_args)
            return self._backend

    def compile(self, spec: StructuredOutputParams) -> object:
        """The compiled grammar of `spec`, from the cache or compiled now; raises ValueError
        (GrammarCompileError / StructuredOutputUnavailable) naming what is wrong."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return self._cache[key]
        backend = self.backend()
        t0 = time.perf_counter()
        compiled = backend.compile(spec)  # outside the lock: other compiles and hits proceed
        dt = time.perf_counter() - t0
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            self.num_compiles += 1
            self.compile_seconds += dt
            self._new_compile_seconds.append(dt)
        return compiled

    def drain_compile_seconds(self) -> tuple[float, ...]:
        with self._lock:
            out = tuple(self._new_compile_seconds)
            self._new_compile_seconds.clear()
        return out

    # ---- per-request state (engine thread) ----------------------------------------------------
    def matcher_for(self, req: Request) -> Matcher | None:
        spec = req.sampling_params.structured_output
        if spec is None:
            return None
        m = self.matchers.get(req.request_id)
        if m is None:
            m = self.matchers[req.request_id] = self.backend().matcher(self.compile(spec))
            # A request preempted before its first token, or one whose output was given, starts
            # from its output so far (the grammar covers the output only, never the prompt).
            for t in req.output_token_ids:
                if not m.accept(t):
                    raise ValueError(f"request {req.request_id!r}: output token {t} does not "
                                     "follow its grammar")
        return m

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self._draft_fed.pop(request_id, None)

    # ---- draft-model hook: a drafter that follows the grammar (engine thread) ----------------
    # Drafts that leave the grammar are cut anyway; a drafter masked like the target proposes
    # only valid ones, so an accurate drafter keeps its acceptance under a grammar. The matcher
    # is borrowed: it advances over the drafts and `end_drafts` rolls it back before begin_step.
    def mask_draft_logits(self, reqs: Sequence[Request], logits: torch.Tensor) -> None:
        """Mask the drafter's next-token logits [len(reqs), vocab] in place, per request, with
        the grammar state after its output plus the drafts it proposed so far this step."""
        rows, masks = [], []
        for j, r in enumerate(reqs):
            m = self.matchers.get(r.request_id) if r.sampling_params.structured_output else None
            if m is None or m.is_terminated():
                continue
            bitmask = allocate_bitmask(1, logits.shape[1])  # [1, words]
            m.fill_bitmask(bitmask, 0)
            rows.append(j)
            masks.append(bitmask)
        if rows:
            full = allocate_bitmask(logits.shape[0], logits.shape[1])  # [len(reqs), words]
            full[rows] = torch.cat(masks)
            self.backend().apply_bitmask(logits, full, rows)

    def accept_draft(self, req: Request, token_id: int) -> None:
        m = self.matchers.get(req.request_id) if req.sampling_params.structured_output else None
        if m is not None and not m.is_terminated() and m.accept(token_id):
            self._draft_fed[req.request_id] = self._draft_fed.get(req.request_id, 0) + 1

    def end_drafts(self) -> None:
        """Roll every borrowed matcher back to the state after its request's output."""
        for rid, n in self._draft_fed.items():
            self.matchers[rid].rollback(n)
        self._draft_fed.clear()

    def begin_step(self, scheduled: Sequence[ScheduledRequest],
                   drafts: Mapping[str, Sequence[int]]) -> GrammarStep | None:
        """Check drafts and build bitmasks for this step's grammar requests; None if it has none.
        The step's `cuts` say where each request's drafts stop being grammatical."""
        if not any(s.request.sampling_params.structured_output is not None and s.sampling
                   for s in scheduled):
            return None
        step = GrammarStep(self.backend())
        for i, s in enumerate(scheduled):
            m = self.matcher_for(s.request) if s.sampling else None
            if m is not None:
                rid = s.request.request_id
                step.add(i, rid, m, drafts.get(rid, ()))
        return step
