"""The data-parallel front end: starts (or awaits) the ranks, routes requests, streams outputs.

``DPEngine`` has the surface of ``LLMEngine`` that ``LLM`` and the server's ``AsyncEngine`` use
(add/abort/step/generate_sync, counters, the KV and scheduler facts /health and the log line
read), so neither knows how many ranks serve it. Inside:

- routing: each request goes to the least-loaded rank (its running + waiting requests, counted
  here as routed and not yet finished, so a burst of adds spreads before any rank reports);
  ties go to the lowest rank. Outputs come back as deltas and are assembled per request.
- aborts go to the owning rank, which frees the request's blocks at once.
- the rank processes are the supervisor's (dp/supervisor.py): it reads their reports into this
  engine's inbox, judges failures (dp/failure.py) and replaces lost ranks (dp/roster.py).
- a lost rank (§7d): the survivors keep stepping their own requests in a new group; what
  becomes of the lost rank's requests is dp/lost_requests.py.
- requests go only to serving ranks; with none, new requests get a clear error (503).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import time
from dataclasses import dataclass

from dynaspec.config import EngineConfig
from dynaspec.dp.health import failure, health_detail
from dynaspec.dp.lost_requests import PARKED, LostRequests
from dynaspec.dp.messages import (
    AbortRequest,
    AddRequest,
    Query,
    RankReady,
    RankSpec,
    Reply,
    TickReport,
    Wake,
)
from dynaspec.dp.metrics import DPMetrics, sum_snapshots
from dynaspec.dp.rendezvous import resolve
from dynaspec.dp.supervisor import RankSupervisor
from dynaspec.engine.client import EngineState, EngineUnavailable, ModelCard, PoolReport
from dynaspec.engine.request_check import check_request
from dynaspec.metrics.records import EngineSnapshot, FinishedRequestTimes, StepStats
from dynaspec.metrics.stats import SpecCounters, fold_step
from dynaspec.outputs import RequestOutput
from dynaspec.sampling_params import SamplingParams
from dynaspec.structured.manager import StructuredOutputManager

log = logging.getLogger("dynaspec.dp")


@dataclass
class _Record:
    rank: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list | None
    params: SamplingParams


class DPEngine:
    def __init__(self, config: EngineConfig, metrics_labels: dict[str, str] | None = None,
                 metrics_prefix: str | None = None) -> None:
        pc = config.parallel
        self.config, self.world_size = config, pc.data_parallel_size
        self.rdv = resolve(pc)
        self.records: dict[str, _Record] = {}
        self.load = [0] * self.world_size
        self.snapshots: dict[int, EngineSnapshot] = {}
        self.free_blocks: dict[int, int] = {}
        self.counters = SpecCounters()
        self.num_rank_steps = 0  # rank steps reported
        self.num_rank_waits = 0  # step() calls that waited on ranks with requests in flight
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._backlog: list[RequestOutput] = []
        self._replies: dict[int, dict[int, object]] = {}
        self._qids = itertools.count()
        self._ids = itertools.count()
        self._closing = False
        self.sup = RankSupervisor(config, self.rdv, self._inbox)
        self.roster = self.sup.roster
        self.resilience = self.roster.counts
        self.lost = LostRequests(self)
        self.metrics = (DPMetrics(self.world_size, metrics_labels, metrics_prefix, self.roster)
                        if metrics_labels is not None else None)
        try:
            self.sup.start()
            self._await_ready(time.monotonic() + RankSpec.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        r0 = self.ready[0]
        self.tokenizer, self.max_model_len, self.vocab_size = (
            r0.tokenizer,
            r0.max_model_len,
            r0.vocab_size,
        )
        self.plan, self.model_name = r0.plan, r0.model_name
        self.exec_plan, self.lossless = r0.exec_plan, r0.lossless
        so = config.structured  # grammars are checked here too, so a bad one is a clear 400
        self.structured = StructuredOutputManager(so.structured_output_backend, self.tokenizer,
                                                  self.vocab_size, r0.eos_token_ids,
                                                  so.structured_any_whitespace)
        atexit.register(self.shutdown)
        log.info(
            "data parallel: %d ranks ready (%s)",
            self.world_size,
            ", ".join(f"rank {r}: pid {i.pid} on {i.host}" for r, i in sorted(self.ready.items())),
        )

    @property
    def procs(self) -> dict:
        return self.sup.procs

    @property
    def ready(self) -> dict[int, RankReady]:
        return self.sup.ready

    # ---- start-up ----------------------------------------------------------------------------
    def _await_ready(self, deadline: float) -> None:
        """Every rank ready (rank 0's tokenizer is needed here) and stepping in group 0."""
        while not self.sup._started:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(self.roster.serving))
                raise RuntimeError(f"data-parallel ranks {missing} were not ready in time")
            try:
                kind, rank, msg = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "msg" and isinstance(msg, RankReady):
                self.free_blocks[rank] = msg.pool.num_blocks
            elif kind == "msg":
                self._handle(kind, rank, msg)  # a rank already stepping while others get ready
            elif kind == "start-failed":
                raise RuntimeError(f"data-parallel rank {rank} failed to start: {msg}")
            elif kind in ("exit", "eof"):
                raise RuntimeError(
                    f"data-parallel rank {rank} exited during start-up "
                    f"({'exit code ' + str(msg) if kind == 'exit' else 'channel closed'})"
                )

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, dp_rank: int | None = None) -> str:
        """Validate here (clear errors before anything is routed), then route to a rank."""
        if self._closing:
            raise EngineUnavailable("the data-parallel engine is shut down")
        serving = self.roster.serving
        if not serving:
            raise EngineUnavailable(self.failure() or "no data-parallel rank is serving")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(ids, params, self.vocab_size, self.max_model_len, self.lossless,
                      self.structured)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.records:
            raise ValueError(f"duplicate request id {request_id!r}")
        if dp_rank is not None and not 0 <= dp_rank < self.world_size:
            raise ValueError(f"dp_rank must be in [0, {self.world_size}), got {dp_rank}")
        if dp_rank is not None and dp_rank not in serving:
            raise EngineUnavailable(f"data-parallel rank {dp_rank} is not serving")
        rank = dp_rank if dp_rank is not None else self._least_loaded(serving)
        lp: list | None = [] if params.logprobs is not None else None
        self.records[request_id] = _Record(rank, ids, [], lp, params)
        self._route(request_id, rank)
        return request_id

    def _least_loaded(self, serving) -> int:
        return min(sorted(serving), key=lambda r: (self.load[r], r))

    def _route(self, request_id: str, rank: int) -> None:
        rec = self.records[request_id]
        rec.rank = rank
        self.load[rank] += 1
        self.sup.send(rank, AddRequest(request_id, rec.prompt_ids, rec.params))
        for other in self.roster.serving - {rank}:
            self.sup.send(other, Wake())

    def abort_request(self, request_id: str) -> bool:
        rec = self.records.pop(request_id, None)
        if rec is None:
            return False
        self._backlog = [o for o in self._backlog if o.request_id != request_id]
        if rec.rank != PARKED:  # a parked one is only here
            self.load[rec.rank] -= 1
            self.sup.send(rec.rank, AbortRequest(request_id))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.records or self._backlog)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.snapshots.values())

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.snapshots.values())

    @property
    def healthy(self) -> bool:
        return bool(self.roster.serving) and not self._closing

    def step(self, wait_s: float = 0.05) -> list[RequestOutput]:
        """Outputs that arrived from the ranks (waits up to wait_s for the first report)."""
        try:
            self._handle(*self._inbox.get(timeout=wait_s))
            while True:
                self._handle(*self._inbox.get_nowait())
        except queue.Empty:
            pass
        if self.lost.parked:
            self.lost.unpark()
        outs, self._backlog = self._backlog, []
        if not outs and self.records:
            # The ranks are mid-step: waiting on them is progress, not a stall. Counted, so a
            # driver keeps calling step() (each waits wait_s on the inbox) instead of parking
            # until the next command, which delayed every token by its idle wait.
            self.num_rank_waits += 1
        return outs

    def generate_sync(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def _handle(self, kind: str, rank: int, msg: object) -> None:
        if kind == "lost":
            self.lost.settle(rank, str(msg))
        elif kind != "msg":
            return  # start-up events (_await_ready)
        elif isinstance(msg, TickReport):
            self._on_report(msg)
        elif isinstance(msg, Reply):
            self._replies.setdefault(msg.qid, {})[msg.rank] = msg.value
        elif isinstance(msg, RankReady):
            self.free_blocks[rank] = msg.pool.num_blocks

    def _on_report(self, rep: TickReport) -> None:
        for o in rep.outputs:
            rec = self.records.get(o.request_id)
            if rec is None or rec.rank != rep.rank:
                continue  # aborted meanwhile
            rec.token_ids.extend(o.new_token_ids)
            if rec.logprobs is not None and o.new_logprobs:
                rec.logprobs.extend(o.new_logprobs)
            if o.finished:
                del self.records[o.request_id]
                self.load[rec.rank] -= 1
            self._backlog.append(RequestOutput(
                o.request_id, rec.prompt_ids, rec.token_ids, o.new_token_ids, o.text, o.finished,
                o.finish_reason, o.error, o.num_cached_tokens, rec.logprobs, o.spec, o.timings))
        self.snapshots[rep.rank], self.free_blocks[rep.rank] = rep.snapshot, rep.kv_free_blocks
        if rep.step is not None:
            self.counters = fold_step(self.counters, rep.step)
            self.num_rank_steps += 1
        if self.metrics is not None:
            if rep.step is not None:
                self.metrics.rank_step(rep.rank, rep.step)
            self.metrics.rank_snapshot(rep.rank, rep.snapshot)
            for t in rep.finished_times:
                self.metrics.rank_finished(rep.rank, t)

    # ---- facts and queries -------------------------------------------------------------------
    def query(self, name: str, timeout_s: float = 60.0) -> list:
        """Ask every serving rank (``decisions``, ``counters``, ``kv``, ``integrity``, ``pid``,
        ``group``); the answers in rank order, None for a rank not serving. Outputs that arrive
        meanwhile are kept for the next ``step``."""
        qid = next(self._qids)
        asked = set(self.roster.serving)
        if not asked:
            raise EngineUnavailable(self.failure() or "no data-parallel rank is serving")
        for rank in asked:
            self.sup.send(rank, Query(qid, name))
        deadline = time.monotonic() + timeout_s
        while not asked <= set(self._replies.get(qid, {})):
            asked &= self.roster.serving | set(self._replies.get(qid, {}))  # a rank lost meanwhile
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"ranks did not answer {name!r} in time")
            try:
                self._handle(*self._inbox.get(timeout=0.1))
            except queue.Empty:
                pass
        answers = self._replies.pop(qid, {})
        for value in answers.values():
            if isinstance(value, Exception):
                raise value
        return [answers.get(r) if r in asked else None for r in range(self.world_size)]

    def pool_report(self) -> PoolReport:
        pools = [r.pool for r in self.ready.values()]
        return PoolReport(
            num_blocks=sum(p.num_blocks for p in pools),
            block_size=pools[0].block_size if pools else 0,
            num_tokens=sum(p.num_tokens for p in pools),
            drafter_num_tokens=sum(p.drafter_num_tokens for p in pools),
        )

    def snapshot(self) -> EngineSnapshot:
        return sum_snapshots(list(self.snapshots.values()))

    # ---- the engine client protocol (engine/client.py) ---------------------------------------
    @property
    def log_stats_interval_s(self) -> float:
        return self.config.observability.log_stats_interval_s

    def model_card(self) -> ModelCard:
        cc = self.config.cache  # the K policies run on the ranks: their cards are per rank
        return ModelCard(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            spec_plan=self.plan.to_json(),
            k_policy=None,
            lossless=self.lossless,
            execution_plan=self.exec_plan.to_json(),
            block_size=cc.block_size,
            prefix_caching=cc.enable_prefix_caching,
        )

    def compile_grammar(self, spec) -> None:
        self.structured.compile(spec)

    def progress(self) -> int:
        return self.num_rank_steps + self.num_rank_waits

    @property
    def last_loss(self) -> str | None:
        return self.roster.last_loss

    def failure(self) -> str | None:
        """Why nothing serves (/health: 503), None while any rank does."""
        return failure(self.roster, self._closing)

    def health(self) -> dict:
        """/health's detail (dp/health.py)."""
        return health_detail(self.roster)

    def state(self) -> EngineState:
        blocks = sum(r.pool.num_blocks for r in self.ready.values())
        free = sum(self.free_blocks.values())
        return EngineState(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_num_blocks=blocks,
            kv_free_blocks=free,
            kv_usage=1.0 - free / blocks if blocks else 0.0,
        )

    def take_finished_times(self) -> list[FinishedRequestTimes]:
        return []  # fed to the per-rank metrics as reports arrive (_on_report)

    def take_step(self) -> StepStats | None:
        return None  # likewise

    def check_integrity(self) -> None:
        self.query("integrity")

    def rank_pids(self) -> dict[int, int]:
        return {r: i.pid for r, i in self.ready.items()}

    def wait_serving(self, ranks: int, timeout_s: float) -> bool:
        """Step (outputs kept for the next ``step``) until ``ranks`` ranks serve."""
        deadline = time.monotonic() + timeout_s
        while len(self.roster.serving) < ranks:
            if time.monotonic() > deadline:
                return False
            self._backlog = self.step(0.05) + self._backlog
        return True

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (they leave together on one tick), SIGKILL what has not left after a
        short grace (a rank hung in a step), close. Bounded well under ``timeout_s``."""
        if self._closing and not self.procs:
            return
        self._closing = True
        self.sup.shutdown(min(timeout_s / 4, 2.0))
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # noqa: BLE001
            pass
