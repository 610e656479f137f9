"""AsyncEngine: runs the single-threaded LLMEngine on one background thread for an asyncio front.

The engine is not thread-safe, so exactly one thread ("dynaspec-engine") ever touches it. The
front talks to it only through a command queue of callables (add, abort, integrity checks, stop);
the thread runs them between steps, steps while work exists (and waits on the queue, never
sleeps, when there is none or when a step could schedule nothing: only a command can change
that), and hands each step's outputs to the per-request asyncio queues with one
`loop.call_soon_threadsafe` per step, so the event loop never
waits on a step. Prometheus metrics are fed from the same thread (under `metrics_lock`, which the
/metrics handler also takes to render).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from dynaspec.engine.client import EngineClient, EngineUnavailable
from dynaspec.metrics.log_line import PeriodicLogger
from dynaspec.metrics.stats import RequestSpecSummary
from dynaspec.outputs import RequestTimings
from dynaspec.sampling_params import SamplingParams
from dynaspec.server.request_outcomes import RequestOutcomes
from dynaspec.server.request_timeline import RequestTimeline

log = logging.getLogger("dynaspec.server")

T = TypeVar("T")

_IDLE_WAIT_S = 0.5  # how long the idle thread waits on the command queue before re-checking


@dataclass(frozen=True)
class OutputDelta:
    """One request's progress after one step, copied on the engine thread (nothing shared)."""

    request_id: str
    text: str  # full text so far (stop strings already cut)
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: list | None = None  # entries for new_token_ids: (logprob, [(id, logprob)])
    spec: RequestSpecSummary | None = None  # the final delta's
    timings: RequestTimings | None = None  # the final delta's
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    step: dict | None = None  # the step's K and this request's drafts (want_steps streams only)


class RequestStream:
    """The asyncio side of one request: deltas arrive in order; the last one has finished=True."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[OutputDelta | None] = asyncio.Queue()
        self.finished = False  # set by the consumer once it has read the final delta
        self.want_steps = False  # deltas carry their step's record (stream_options extension)
        self._logprobs_sent = 0  # engine thread only
        self.added_at = 0.0  # when the engine thread ran its add (time.monotonic())

    async def get(self) -> OutputDelta | None:
        """The next delta; None when the client disconnected (put by the SSE response)."""
        delta = await self.queue.get()
        if delta is not None:
            self.finished = delta.finished
        return delta


class AsyncEngine:
    """`build()` returns (engine, metrics or None) and runs on the engine thread itself.

    Why build there: libgomp gives every thread that runs a torch parallel region its own
    worker team, and once the teams' threads outnumber the cores each team only spins briefly
    and then sleeps on a futex at every region. An engine loaded on the main thread and stepped
    on another ran its steps 2-3.5x slower on 2 cores (250k context switches for one request
    that needed 400 on one thread). So one thread does all of the engine's torch work.
    """

    def __init__(self, build: Callable[[], tuple[EngineClient, Any]]) -> None:
        self.metrics_lock = threading.Lock()
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._cmds_lock = threading.Lock()
        self._cmds_closed = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._accepting = True
        self._stop = False
        self.num_aborted = 0  # requests aborted while still in the engine (engine thread writes)
        self.outcomes = RequestOutcomes()  # every request queued ends here once (/metrics)
        self.timeline = RequestTimeline.from_env()  # off unless DYNASPEC_REQUEST_TIMELINE is set
        self.state: dict = {}  # published by the engine thread after each round, read by /health
        ready: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(build, ready),
                                        name="dynaspec-engine", daemon=True)
        self._thread.start()
        ready.result()  # a failed build raises here, in the caller's thread

    def _attach(self, engine: EngineClient, metrics: Any) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        # --log-stats-interval: the periodic metrics line, written from the engine thread.
        self._log_line = PeriodicLogger(engine.log_stats_interval_s)
        self._publish_state()

    def _main(self, build: Callable[[], tuple[EngineClient, Any]], ready: Future) -> None:
        try:
            self._attach(*build())
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            self._cmds_closed = True  # no command can be queued yet: the constructor raises
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self._run()

    # ---- API for any thread --------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[EngineClient], T]) -> Future[T]:
        """Run fn(engine) on the engine thread between steps; the Future holds its result."""
        fut: Future[T] = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

        if not self._put(run):
            raise EngineUnavailable("the engine thread has stopped")
        return fut

    def abort(self, request_id: str) -> None:
        """Abort a request (frees its KV blocks); harmless if it already finished."""
        self._put(lambda: self._abort(request_id, "abort"))

    def _put(self, cmd: Callable[[], None]) -> bool:
        # Under the lock the thread closes the queue and then drains it, so every command that
        # got in runs (its future resolves) and none is left behind by an ending thread.
        with self._cmds_lock:
            if self._cmds_closed:
                return False
            self._cmds.put(cmd)
            return True

    # ---- API for the event loop ----------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        want_steps: bool = False
    ) -> RequestStream:
        """Queue a request; raises ValueError (bad prompt/params) or EngineUnavailable.
        `want_steps`: its deltas carry their step's K and drafts (OutputDelta.step)."""
        if not self._accepting:
            raise EngineUnavailable("the server is shutting down")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        stream.want_steps = want_steps

        def add(engine: EngineClient) -> None:
            engine.add_request(prompt, params, request_id)
            stream.added_at = time.monotonic()
            self._streams[request_id] = stream

        try:
            await asyncio.wrap_future(self.call(add))
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while the add was queued
            raise
        return stream

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to drain_timeout_s, abort the
        rest (their streams get a final 'abort' delta), then stop and join the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self.alive and self.state.get("num_unfinished") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.alive:
            def stop(engine: EngineClient) -> None:
                for rid in list(self._streams):
                    self._abort(rid, "abort", "the server is shutting down")
                self._stop = True

            try:
                await asyncio.wrap_future(self.call(stop))
            except EngineUnavailable:
                pass  # the thread ended meanwhile
        await asyncio.to_thread(self._thread.join, 30.0)
        if self.timeline is not None:
            self.timeline.close()
        # Data-parallel ranks stop here, inside the server's shutdown: uvicorn re-raises the
        # SIGTERM it caught once it returns, so code after `run()` never runs.
        engine = getattr(self, "engine", None)
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stalled = False  # the last step scheduled nothing: wait for a command first
            while not self._stop:
                busy = self.engine.has_unfinished_requests() and not stalled
                ran = self._run_commands(block=not busy)
                if self._stop:
                    break
                if self.engine.has_unfinished_requests():
                    stalled = not self._step()
                elif ran:
                    self._observe()
        except BaseException:  # noqa: BLE001 - never die silently: fail every open stream
            log.exception("engine thread crashed")
            raise
        finally:
            self._accepting = False
            with self._cmds_lock:
                self._cmds_closed = True
            self._run_commands(block=False)  # what got in still runs: no caller waits forever
            for rid in list(self._streams):
                self._deliver_final(rid, "error", "the engine stopped")
            self._publish_state()

    def _run_commands(self, block: bool) -> bool:
        ran = False
        try:
            cmd = self._cmds.get(timeout=_IDLE_WAIT_S) if block else self._cmds.get_nowait()
            while True:
                try:
                    cmd()
                except Exception:  # noqa: BLE001 - one bad command must not stop the engine
                    log.exception("engine command failed")
                ran = True
                cmd = self._cmds.get_nowait()
        except queue.Empty:
            return ran

    def _step(self) -> bool:
        """One engine step and its deliveries; False when it could schedule nothing."""
        before, start = self.engine.progress(), time.monotonic()
        try:
            outs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - step() already isolates runner failures
            log.exception("engine step failed; aborting its requests")
            for rid in list(self._streams):
                self._abort(rid, "error", f"{type(exc).__name__}: {exc}")
            return True
        # A prefill chunk or an async launch returns nothing yet but is progress.
        progressed = bool(outs) or self.engine.progress() != before
        step = self.engine.take_step()  # the step these outputs came from (None under DP)
        if self.timeline is not None:
            self.timeline.step(start, time.monotonic(), step, outs)
        records = _step_records(step, outs, self._streams)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            if out.finished:
                self.outcomes.add(out.finish_reason)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client meanwhile
            if out.finished:
                del self._streams[out.request_id]
            delta = self._delta(out, stream, records.get(out.request_id))
            batches.setdefault(stream.loop, []).append((stream, delta))
        for loop, items in batches.items():
            _post(loop, items)
        self._observe(step)
        return progressed

    @staticmethod
    def _delta(out: Any, stream: RequestStream, step: dict | None = None) -> OutputDelta:
        new_lp = None
        if out.logprobs is not None:  # cumulative list owned by the engine: copy the new part
            new_lp = list(out.logprobs[stream._logprobs_sent:])
            stream._logprobs_sent = len(out.logprobs)
        return OutputDelta(out.request_id, out.text, list(out.new_token_ids),
                           len(out.prompt_token_ids), len(out.token_ids), out.finished,
                           out.finish_reason, out.error, new_lp, out.spec, out.timings,
                           out.num_cached_tokens, step)

    def _abort(self, request_id: str, reason: str, error: str | None = None) -> None:
        if self.engine.abort_request(request_id):
            self.num_aborted += 1
            self.outcomes.add(reason)
        if request_id in self._streams:
            self._deliver_final(request_id, reason, error)
        self._observe()

    def _deliver_final(self, request_id: str, reason: str, error: str | None) -> None:
        stream = self._streams.pop(request_id)
        delta = OutputDelta(request_id, "", [], 0, 0, True, reason, error)
        _post(stream.loop, [(stream, delta)])

    def _observe(self, step: Any = None) -> None:
        """Feed Prometheus and publish the state; a metrics bug must not stop serving.
        `step`: the record `_step` already took from the engine (take_step hands it out once)."""
        eng = self.engine
        times = eng.take_finished_times()  # drained here, on the thread that steps
        self._publish_state()
        if self.metrics is None and not self._log_line.enabled:
            return
        try:
            snap = eng.snapshot()
            self._log_line.maybe_log(eng.counters, snap)
            if self.metrics is None:
                return
            with self.metrics_lock:
                step = step if step is not None else eng.take_step()
                if step is not None:
                    self.metrics.observe_step(step)
                self.metrics.observe_snapshot(snap)
                for t in times:
                    self.metrics.observe_finished(t)
        except Exception:  # noqa: BLE001
            log.exception("metrics update failed")

    def _publish_state(self) -> None:
        self.state = {**self.engine.state().to_json(), "num_streams": len(self._streams)}


def _step_records(step: Any, outs: list, streams: dict[str, RequestStream]) -> dict[str, dict]:
    """request id -> its part of `step` as JSON, for the outputs whose stream asked for it."""
    wanted = {o.request_id for o in outs if (s := streams.get(o.request_id)) and s.want_steps}
    if step is None or not wanted:
        return {}
    return {r.request_id: {"k": step.k, "drafted": r.num_draft_tokens,
                           "accepted": r.num_accepted_tokens, "tokens": r.num_emitted_tokens}
            for r in step.requests if r.request_id in wanted}


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, OutputDelta]]) -> None:
    def deliver() -> None:
        for stream, delta in items:
            stream.queue.put_nowait(delta)

    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
