"""The data-parallel front end: starts (or awaits) the ranks, routes requests, streams outputs.

``DPEngine`` has the surface of ``LLMEngine`` that ``LLM`` and the server's ``AsyncEngine`` use
(add/abort/step/generate_sync, counters, the KV and scheduler facts /health and the log line
read), so neither knows how many ranks serve it. Inside:

- routing: each request goes to the least-loaded rank (its running + waiting requests, counted
  here as routed and not yet finished, so a burst of adds spreads before any rank reports);
  ties go to the lowest rank. Outputs come back as deltas and are assembled per request.
- aborts go to the owning rank, which frees the request's blocks at once.
- a pump thread reads every rank's reports and watches the processes, so a rank that dies is
  seen even while the engine is idle (/health then fails).
- failure: a rank that exits, closes its channel, or leaves its peers waiting past the step
  timeout is named. Peers that hit the failed exchange report it; after a short settle the
  culprits are the ranks that died, else the ones that never reported (stuck). Every in-flight
  request then finishes with ``finish_reason "error"`` and a message naming the rank, every
  rank process is stopped (killed if it does not leave), and new requests get a clear error:
  the front end shuts the engine down rather than re-forming the process group.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait

from dynaspec.config import EngineConfig
from dynaspec.dp.failure import FailureWatch, reap
from dynaspec.dp.messages import (
    AbortRequest,
    AddRequest,
    Hello,
    Query,
    RankFailed,
    RankReady,
    RankSpec,
    Reply,
    Stop,
    TickReport,
    Wake,
)
from dynaspec.dp.metrics import DPMetrics, sum_snapshots
from dynaspec.dp.process import RankProcess
from dynaspec.dp.rank import spawn_spec
from dynaspec.dp.rendezvous import resolve, threads_per_rank
from dynaspec.engine.client import EngineState, EngineUnavailable, ModelCard, PoolReport
from dynaspec.engine.llm_engine import check_request
from dynaspec.metrics.stats import (
    EngineSnapshot,
    FinishedRequestTimes,
    SpecCounters,
    StepStats,
    fold_step,
)
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


class DPEngine:
    def __init__(self, config: EngineConfig, metrics_labels: dict[str, str] | None = None,
                 metrics_prefix: str | None = None) -> None:
        pc = config.parallel
        self.config, self.world_size = config, pc.data_parallel_size
        self.rdv = resolve(pc)
        self.metrics = (DPMetrics(self.world_size, metrics_labels, metrics_prefix)
                        if metrics_labels is not None else None)
        self.procs: dict[int, RankProcess] = {}
        self.conns: dict[int, Connection] = {}
        self.ready: dict[int, RankReady] = {}
        self.records: dict[str, _Record] = {}
        self.load = [0] * self.world_size
        self.snapshots: dict[int, EngineSnapshot] = {}
        self.free_blocks: dict[int, int] = {}
        self.counters = SpecCounters()
        self.num_rank_steps = 0  # rank steps reported
        self.num_rank_waits = 0  # step() calls that waited on ranks with requests in flight
        self.failure_reason: str | None = None  # set by the failure watch
        self._culprits: dict[int, str] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._backlog: list[RequestOutput] = []
        self._replies: dict[int, dict[int, object]] = {}
        self._qids = itertools.count()
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._closing = False
        self._watch = FailureWatch(self)
        try:
            self._start()
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

    # ---- start-up ----------------------------------------------------------------------------
    def _start(self) -> None:
        import torch.distributed as dist

        r, pc = self.rdv, self.config.parallel
        bind = r.master_addr if r.multi_machine else "127.0.0.1"
        self._store = dist.TCPStore(bind, r.store_port, is_master=True, wait_for_workers=False)
        self._listener = Listener((bind, r.control_port), authkey=r.authkey)
        control_port = self._listener.address[1]
        threading.Thread(target=self._accept, name="dynaspec-dp-accept", daemon=True).start()
        threading.Thread(target=self._pump, name="dynaspec-dp-pump", daemon=True).start()
        threads = threads_per_rank(pc, len(r.local_ranks))
        for rank in r.local_ranks:
            spec = RankSpec(self.config, rank, self.world_size, bind, self._store.port, bind,
                            control_port, r.authkey)
            self.procs[rank] = RankProcess(spawn_spec(spec, threads))
        if r.multi_machine:
            log.info("waiting for ranks %s to join at %s:%d (store) / %d (control)",
                     sorted(set(range(self.world_size)) - set(r.local_ranks)), r.master_addr,
                     self._store.port, control_port)
        self._await_ready(time.monotonic() + RankSpec.start_timeout_s)

    def _accept(self) -> None:
        while not self._closing and len(self.conns) < self.world_size:
            try:
                conn = self._listener.accept()
                hello = conn.recv()
            except (OSError, EOFError, ValueError):
                if self._closing:
                    return
                continue  # a bad handshake (wrong secret, stray connection): keep listening
            if not isinstance(hello, Hello) or not 0 <= hello.rank < self.world_size \
                    or hello.rank in self.conns:
                conn.close()
                continue
            self.conns[hello.rank] = conn

    def _await_ready(self, deadline: float) -> None:
        while len(self.ready) < self.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(self.ready))
                raise RuntimeError(f"data-parallel ranks {missing} were not ready in time")
            try:
                kind, rank, msg = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "msg" and isinstance(msg, RankReady):
                self.ready[rank] = msg
                self.free_blocks[rank] = msg.pool.num_blocks
            elif kind == "msg" and isinstance(msg, TickReport):
                self._handle(kind, rank, msg)  # a rank already stepping while others get ready
            elif kind == "msg" and isinstance(msg, RankFailed):
                raise RuntimeError(f"data-parallel rank {rank} failed to start: {msg.reason}")
            elif kind in ("exit", "eof"):
                raise RuntimeError(
                    f"data-parallel rank {rank} exited during start-up "
                    f"({'exit code ' + str(msg) if kind == 'exit' else 'channel closed'})"
                )

    # ---- the pump thread: reads every rank, watches the processes ------------------------------
    def _pump(self) -> None:
        while not self._closing:
            conns = {c: rank for rank, c in list(self.conns.items())}
            sentinels = {p.sentinel: rank for rank, p in list(self.procs.items())
                         if rank not in self._watch.exited and p.sentinel is not None}
            try:
                ready = wait([*conns, *sentinels], timeout=0.2) if conns or sentinels else []
            except OSError:
                ready = []
            if not conns and not sentinels:
                time.sleep(0.05)
            # Channels first: a peer's "failed" report must be read before its exit is seen.
            for obj in sorted(ready, key=lambda o: o in sentinels):
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank in self.conns:
                        self._read(self.conns[rank], rank)
                    code = self.procs[rank].exitcode
                    self._watch.exited.add(rank)
                    self._watch.on_exit(rank, code)
                    self._inbox.put(("exit", rank, code))
                else:
                    self._read(obj, conns[obj])
            self._watch.check()

    def _read(self, conn: Connection, rank: int) -> None:
        try:
            for _ in range(64):  # bounded, so one chatty rank cannot starve the others
                if not conn.poll():
                    return
                msg = conn.recv()
                self._watch.heard(rank, msg)
                self._inbox.put(("msg", rank, msg))
        except (EOFError, OSError):
            self.conns.pop(rank, None)
            self._watch.on_eof(rank)
            self._inbox.put(("eof", rank, None))

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, dp_rank: int | None = None) -> str:
        """Validate here (clear errors before anything is routed), then route to a rank."""
        if self.failure_reason is not None or self._closing:
            raise EngineUnavailable(self.failure_reason or "the data-parallel engine is shut down")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(ids, params, self.vocab_size, self.max_model_len, self.lossless,
                      self.structured)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.records:
            raise ValueError(f"duplicate request id {request_id!r}")
        if dp_rank is not None and not 0 <= dp_rank < self.world_size:
            raise ValueError(f"dp_rank must be in [0, {self.world_size}), got {dp_rank}")
        rank = dp_rank if dp_rank is not None else min(range(self.world_size),
                                                         key=lambda r: (self.load[r], r))
        lp = [] if params.logprobs is not None else None
        self.records[request_id] = _Record(rank, ids, [], lp)
        self.load[rank] += 1
        self._send(rank, AddRequest(request_id, ids, params))
        for other in range(self.world_size):
            if other != rank:
                self._send(other, Wake())
        return request_id

    def abort_request(self, request_id: str) -> bool:
        rec = self.records.pop(request_id, None)
        if rec is None:
            return False
        self.load[rec.rank] -= 1
        self._backlog = [o for o in self._backlog if o.request_id != request_id]
        self._send(rec.rank, AbortRequest(request_id))
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
        return self.failure_reason is None and not self._closing

    def step(self, wait_s: float = 0.05) -> list[RequestOutput]:
        """Outputs that arrived from the ranks (waits up to wait_s for the first report)."""
        try:
            self._handle(*self._inbox.get(timeout=wait_s))
            while True:
                self._handle(*self._inbox.get_nowait())
        except queue.Empty:
            pass
        if self.failure_reason is not None and self.records:
            self._fail_all()
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
        if kind != "msg":
            return  # exits and closed channels are the failure watch's business
        if isinstance(msg, TickReport):
            self._on_report(msg)
        elif isinstance(msg, Reply):
            self._replies.setdefault(msg.qid, {})[msg.rank] = msg.value

    def _on_report(self, rep: TickReport) -> None:
        for o in rep.outputs:
            rec = self.records.get(o.request_id)
            if rec is None:
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

    def _fail_all(self) -> None:
        for rid, rec in list(self.records.items()):
            why = self._culprits.get(rec.rank)
            msg = (f"data-parallel rank {rec.rank} {why}" if why is not None else
                   f"the data-parallel engine shut down: {self.failure_reason}")
            self._backlog.append(
                RequestOutput(
                    rid,
                    rec.prompt_ids,
                    rec.token_ids,
                    [],
                    finished=True,
                    finish_reason="error",
                    error=msg,
                )
            )
        self.records.clear()
        self.load = [0] * self.world_size

    def _send(self, rank: int, msg: object) -> None:
        conn = self.conns.get(rank)
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send(msg)
        except OSError:
            pass  # the pump sees the closed channel and the failure watch names the rank

    # ---- facts and queries -------------------------------------------------------------------
    def query(self, name: str, timeout_s: float = 60.0) -> list:
        """Ask every rank (``decisions``, ``counters``, ``kv``, ``integrity``, ``pid``); the
        answers in rank order. Outputs that arrive meanwhile are kept for the next ``step``."""
        qid = next(self._qids)
        for rank in range(self.world_size):
            self._send(rank, Query(qid, name))
        deadline = time.monotonic() + timeout_s
        while len(self._replies.get(qid, {})) < self.world_size:
            if self.failure_reason is not None or time.monotonic() > deadline:
                raise EngineUnavailable(
                    self.failure_reason or f"ranks did not answer {name!r} in time"
                )
            try:
                self._handle(*self._inbox.get(timeout=0.1))
            except queue.Empty:
                pass
        answers = self._replies.pop(qid)
        for r in range(self.world_size):
            if isinstance(answers[r], Exception):
                raise answers[r]
        return [answers[r] for r in range(self.world_size)]

    def pool_report(self) -> PoolReport:
        pools = [r.pool for r in self.ready.values()]
        return PoolReport(sum(p.num_blocks for p in pools), pools[0].block_size if pools else 0,
                          sum(p.num_tokens for p in pools),
                          sum(p.drafter_num_tokens for p in pools))

    def snapshot(self) -> EngineSnapshot:
        return sum_snapshots(list(self.snapshots.values()))

    # ---- the engine client protocol (engine/client.py) ---------------------------------------
    @property
    def log_stats_interval_s(self) -> float:
        return self.config.observability.log_stats_interval_s

    def model_card(self) -> ModelCard:
        cc = self.config.cache  # the K policies run on the ranks: their cards are per rank
        return ModelCard(self.max_model_len, self.vocab_size, self.plan.to_json(), None,
                         self.lossless, self.exec_plan.to_json(), cc.block_size,
                         cc.enable_prefix_caching)

    def compile_grammar(self, spec) -> None:  # type: ignore[no-untyped-def]
        self.structured.compile(spec)

    def progress(self) -> int:
        return self.num_rank_steps + self.num_rank_waits

    def failure(self) -> str | None:
        return self.failure_reason

    def state(self) -> EngineState:
        blocks = sum(r.pool.num_blocks for r in self.ready.values())
        free = sum(self.free_blocks.values())
        return EngineState(self.num_running, self.num_waiting, blocks, free,
                           1.0 - free / blocks if blocks else 0.0)

    def take_finished_times(self) -> list[FinishedRequestTimes]:
        return []  # fed to the per-rank metrics as reports arrive (_on_report)

    def take_step(self) -> StepStats | None:
        return None  # likewise

    def check_integrity(self) -> None:
        self.query("integrity")

    def rank_pids(self) -> dict[int, int]:
        return {r: i.pid for r, i in self.ready.items()}

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (they leave together on one tick), reap local processes, close."""
        if self._closing and not self.procs:
            return
        self._closing = True
        for rank in list(self.conns):
            self._send(rank, Stop())
        reap(self.procs, timeout_s)
        for conn in list(self.conns.values()):
            conn.close()
        self.conns.clear()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            listener.close()
        self._store = None
        try:
            atexit.unregister(self.shutdown)
        except Exception:  # noqa: BLE001
            pass
