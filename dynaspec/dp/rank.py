"""One data-parallel rank: a process with its own model, KV pool and scheduler (an LLMEngine).

Start-up: connect to the front end's control listener and its TCPStore, build the engine,
start the heartbeat thread (dp/heartbeat.py: liveness outside the step loop), report ready.
The loop then forms group 0 (all ranks; a replacement waits for the front end's Regroup
instead): a gloo group on CPU tensors for the step exchange (dp/group.py), whose handshake
starts every rank from rank 0's step cost table (dp/regroup.py).

The loop, once per engine step on every rank (lockstep):
  1. run the front end's commands (add, abort, query, stop, regroup); when every rank was idle
     at the last exchange, wait for one (up to ``IDLE_POLL_S``, then tick anyway: liveness);
     move to a new group when one is due (dp/regroup.py);
  2. the step exchange (dp/agreement.py): the scheduler's step view goes out, the global view
     and the gathered observations come back (``LockstepPolicy.apply_tick``);
  3. the engine's phases: ``schedule(global view) -> launch -> land -> emit``. A rank with no
     work exchanged and runs nothing (the dummy step);
  4. send the front end a ``TickReport`` (new tokens, the step's stats, a snapshot).
When any rank set the stop flag, every rank leaves after the same exchange. When the exchange
fails (a peer died or stopped answering), the rank keeps its requests (their KV is intact),
tells the front end (``GroupLost``) and waits for the group of survivors it names (§7d).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import replace
from multiprocessing.connection import Client, Connection

from dynaspec.dp.agreement import AgreedK, CollectiveError, StepAgreement
from dynaspec.dp.group import GroupAbandoned
from dynaspec.dp.heartbeat import HeartbeatSender, LockedChannel, beat_interval_s
from dynaspec.dp.lockstep_policy import LockstepPolicy
from dynaspec.dp.messages import (
    AbortRequest,
    AddRequest,
    GroupLost,
    Hello,
    Joined,
    Query,
    RankFailed,
    RankOutput,
    RankReady,
    RankSpec,
    Regroup,
    Reply,
    Stop,
    TickReport,
)
from dynaspec.dp.process import die_with_parent
from dynaspec.dp.rank_state import RankState
from dynaspec.dp.regroup import GroupSwitch
from dynaspec.dp.roster import rejoin_key
from dynaspec.engine.async_loop import AsyncStepLoop
from dynaspec.metrics.records import EngineSnapshot

log = logging.getLogger("dynaspec.dp")

IDLE_POLL_S = 1.0
EXIT_ERROR = 4
HEARTBEAT_TICKS = 5  # an idle rank reports at least every this many ticks (liveness)


def rank_main(spec: RankSpec) -> None:
    """Entry point of a rank process (spawned locally or by ``dynaspec dp-worker``)."""
    die_with_parent()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(levelname)s dynaspec.dp rank {spec.rank}: %(message)s")
    conn = LockedChannel(_connect(spec))
    conn.send(Hello(spec.rank))
    code = 0
    try:
        engine, agreement, store = _start(spec)
        if not spec.joining and store.check([rejoin_key(spec.rank)]):
            spec = replace(spec, joining=True)  # its machine restarted it after a loss
        hb_timeout = spec.config.parallel.dp_heartbeat_timeout_s
        if hb_timeout:  # from before ready: a replacement is judged while it joins, too
            HeartbeatSender(conn, spec.rank, beat_interval_s(hb_timeout)).start()
        conn.send(_ready(spec, engine))
        loop = RankLoop(engine, agreement, conn, spec.rank, GroupSwitch(store, spec))
        code = loop.run()
    except Exception as exc:  # noqa: BLE001 - this rank failed: the front end names it
        log.exception("rank failed")
        _send(conn, RankFailed(spec.rank, f"{type(exc).__name__}: {exc}", victim=False))
        code = EXIT_ERROR
    finally:
        conn.close()
    # Leave without tearing the process group down: a peer may be gone, and destroying a gloo
    # group with a dead peer can block. The OS closes the sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _connect(spec: RankSpec) -> Connection:
    """The front end may still be starting (another machine): retry until the start timeout."""
    deadline = time.monotonic() + spec.start_timeout_s
    while True:
        try:
            return Client((spec.control_addr, spec.control_port), authkey=spec.authkey)
        except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _send(conn: LockedChannel, msg: object) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass  # the front end is gone: nothing to tell


def _start(spec: RankSpec):
    """The store client, the engine and its step agreement; the group is formed by the loop."""
    import datetime

    import torch
    import torch.distributed as dist

    from dynaspec.engine.builder import build_engine_parts, resolve_device
    from dynaspec.engine.llm_engine import LLMEngine

    timeout = datetime.timedelta(seconds=spec.start_timeout_s)
    store = dist.TCPStore(spec.store_addr, spec.store_port, is_master=False, timeout=timeout)
    if resolve_device(spec.config.model.device).type == "cuda":
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    pc = spec.config.parallel
    made: list[StepAgreement] = []

    def agreement_for(max_k: int) -> StepAgreement:
        if not made:  # the gather is the group's, set when the loop forms one
            made.append(StepAgreement(_no_group, spec.rank, spec.world_size, max_k,
                                      pc.dp_rank_timeout_s, IDLE_POLL_S))
        return made[0]

    def lockstep(policy):
        return LockstepPolicy(policy, agreement_for(policy.plan.max_k))

    engine = _build_engine(spec, store,
                           lambda cfg: LLMEngine(cfg, build_engine_parts(cfg, lockstep)))
    return engine, agreement_for(engine.plan.max_k), store


def _no_group(row: list[float], timeout_s: float) -> list[list[float]]:
    raise CollectiveError("no group formed yet")


def _build_engine(spec: RankSpec, store, make_engine):
    """Rank 0 builds first when the goodput policy profiles step costs: the other ranks then
    read its cached table (same machine) instead of profiling all at once, contending for the
    cores and measuring each other; only rank 0's table is used anyway (share_cost_model)."""
    from dynaspec.spec_decode.policy.policies import resolve_policy_name

    sc = spec.config.spec
    profiles = (sc.speculator != "none" and sc.cost_table is None
                and resolve_policy_name(sc.k_policy, True, sc.k_schedule is not None) == "goodput")
    key = "dynaspec/rank0-built"
    if profiles and spec.rank != 0:
        store.wait([key])
    engine = make_engine(spec.config)
    if profiles and spec.rank == 0:
        store.set(key, "1")
    return engine


def _ready(spec: RankSpec, engine) -> RankReady:
    return RankReady(spec.rank, engine.tokenizer if spec.rank == 0 else None, engine.max_model_len,
                     engine.parts.vocab_size, engine.plan, engine.parts.model_name,
                     engine.pool_report(), os.getpid(), socket.gethostname(), engine.exec_plan,
                     engine.lossless, engine.parts.eos_token_ids)


class RankLoop:
    def __init__(self, engine, agreement: StepAgreement, conn: LockedChannel, rank: int,
                 groups: GroupSwitch) -> None:
        self.engine, self.agreement, self.conn, self.rank = engine, agreement, conn, rank
        self.groups = groups
        self.stop_requested = False
        self.logprobs_sent: dict[str, int] = {}
        self.errors: list[RankOutput] = []  # adds the engine refused, reported with the next tick
        self.last_snapshot: EngineSnapshot | None = None
        self.quiet_ticks = 0
        self.last_step = (0.0, False)  # (seconds, whether a step ran) since the last exchange

    def run(self) -> int:
        a, eng, groups = self.agreement, self.engine, self.groups
        idle = False
        while True:
            self._commands(block=idle or (groups.group is None and not groups.due()))
            if self.stop_requested and groups.group is None:
                return 0  # no group to leave with: nobody waits on this rank
            if groups.due():
                self._switch()
                continue
            if groups.group is None:
                continue  # lost: waiting for the front end's Regroup, requests kept
            a.begin_step()
            steps, t0 = self._steps_done(), time.perf_counter()
            try:
                outs = self._step()
            except CollectiveError as exc:  # a peer died or went silent: keep our requests
                self._lost(str(exc))
                continue
            ran = self._steps_done() > steps
            self.last_step = (time.perf_counter() - t0 if ran else 0.0, ran)
            self._report(outs, ran)
            tick = a.last
            assert tick is not None  # set by the step's agreement
            if tick.stopping:
                return 0
            groups.after_tick(tick)
            idle = tick.num_unfinished == 0 and not eng.has_unfinished_requests()

    def _steps_done(self) -> int:
        """Steps whose observation this rank holds for the next exchange: landed ones (async
        scheduling lands a step one call before it emits it), else emitted ones."""
        driver = self.engine.driver
        return driver.num_landed if isinstance(driver, AsyncStepLoop) else self.engine.times.steps

    def _switch(self) -> None:
        def stop() -> bool:
            self._commands(block=False)
            return self.stop_requested

        target = self.groups.pending
        assert target is not None  # called when a switch is due(), which needs one
        try:
            self.groups.switch(self.agreement, self._policy(), stop)
        except GroupAbandoned:
            return  # a newer membership (the loop forms it) or stopping
        except CollectiveError as exc:  # a member never came: the front end names it
            if self.groups.pending is target:
                self.groups.pending = None
            self._lost(str(exc), target.epoch)
            return
        self.conn.send(Joined(self.rank, self.groups.epoch))
        group = self.groups.group
        assert group is not None  # switch() formed it
        log.info("stepping in group %d: ranks %s", self.groups.epoch,
                 list(group.membership.members))

    def _lost(self, reason: str, epoch: int | None = None) -> None:
        """The group failed: keep the requests, tell the front end, wait for (or move to
        at once, when one is pending) the next group."""
        epoch = self.groups.epoch if epoch is None else epoch
        self.groups.lose()
        log.warning("group %d lost: %s; keeping %d request(s), waiting for a new group", epoch,
                    reason, self.engine.num_running + self.engine.num_waiting)
        _send(self.conn, GroupLost(self.rank, epoch, reason))

    def _step(self) -> list:
        """One lockstep step: the exchange, then the engine's phases on the agreed view (under
        --async-scheduling pipelined by the engine's driver: the step scheduled on this tick's
        view is launched after the previous one lands, engine/async_loop.py)."""
        a, eng = self.agreement, self.engine
        view = eng.step_view()
        tick = a.exchange(self._rank_state([r.context_len for r in view.requests],
                                           view.num_reqs))
        policy = self._policy()
        if policy is not None:
            policy.apply_tick(tick)

        def schedule():
            plan = eng.schedule(tick.view)
            if plan.step_k is not None:
                a.decisions.append(AgreedK(tick.index, plan.step_k, tick.view.num_reqs,
                                           tick.view.ctx_stat, view.num_reqs))
            return plan

        if isinstance(eng.driver, AsyncStepLoop):
            return eng.driver.step(schedule)
        plan = schedule()
        if not plan.scheduled:
            return []
        launched = eng.launch(plan)
        return eng.emit(eng.land(launched)) if launched is not None else []

    def _policy(self) -> LockstepPolicy | None:
        policy = self.engine.scheduler.policy
        assert policy is None or isinstance(policy, LockstepPolicy)  # built by _start's lockstep
        return policy

    def _rank_state(self, decoding_ctxs: list[int], num_reqs: int) -> RankState:
        """What this rank says at the exchange: its expected step, its control, and its K
        policy's report of the previous step."""
        eng, policy = self.engine, self._policy()
        obs, acceptance = policy.report() if policy is not None else (None, ())
        seconds, ran = self.last_step
        # a step in flight or outputs not yet emitted (async) keep every rank stepping
        unfinished = eng.num_running + eng.num_waiting + int(eng.driver.busy)
        return RankState.of_step(num_reqs, decoding_ctxs, unfinished, self.stop_requested,
                                 self.groups.join_epoch, seconds, ran, obs, acceptance)

    # ---- commands ----------------------------------------------------------------------------
    def _commands(self, block: bool) -> None:
        if block and not self.conn.poll(IDLE_POLL_S):
            return
        while self.conn.poll():
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.stop_requested = True  # the front end is gone: leave with the others
                return
            self._command(msg)

    def _command(self, msg: object) -> None:
        if isinstance(msg, AddRequest):
            try:
                self.engine.add_request(msg.prompt_ids, msg.params, msg.request_id)
            except ValueError as exc:
                self.errors.append(RankOutput(msg.request_id, [], "", True, "error", str(exc),
                                              None, 0, None))
        elif isinstance(msg, AbortRequest):
            self.engine.abort_request(msg.request_id)
            self.logprobs_sent.pop(msg.request_id, None)
        elif isinstance(msg, Query):
            try:
                value = self._query(msg.name)
            except Exception as exc:  # noqa: BLE001 - a failed check is the asker's answer
                value = exc
            self.conn.send(Reply(msg.qid, self.rank, value))
        elif isinstance(msg, Stop):
            self.stop_requested = True
        elif isinstance(msg, Regroup):
            self.groups.offer(msg)

    def _query(self, name: str):
        eng = self.engine
        if name == "decisions":
            return list(self.agreement.decisions)
        if name == "counters":
            return eng.counters
        if name == "kv":
            return {"num_blocks": eng.kv.num_blocks, "num_free_blocks": eng.kv.num_free_blocks(),
                    "num_unfinished": eng.num_running + eng.num_waiting}
        if name == "integrity":
            eng.check_integrity()
            return True
        if name == "pid":
            return os.getpid()
        if name == "group":
            g = self.groups.group
            return None if g is None else (g.membership.epoch, g.membership.members)
        raise ValueError(f"unknown query {name!r}")

    # ---- reports -----------------------------------------------------------------------------
    def _report(self, outs: list, ran: bool) -> None:
        eng = self.engine
        outputs, self.errors = self.errors, []
        outputs += [self._output(o) for o in outs]
        times = eng.take_finished_times()
        step = eng.take_step()
        snap = eng.snapshot()
        self.quiet_ticks += 1
        if not outputs and step is None and not times and snap == self.last_snapshot \
                and self.quiet_ticks < HEARTBEAT_TICKS:
            return  # nothing new on an idle tick: only every few ticks a heartbeat
        self.quiet_ticks, self.last_snapshot = 0, snap
        tick = self.agreement.last
        assert tick is not None  # reported after an agreed tick
        self.conn.send(TickReport(self.rank, tick.index, outputs, step, snap,
                                  times, eng.kv.num_free_blocks(), eng.kv.num_blocks))

    def _output(self, out) -> RankOutput:
        new_lp = None
        if out.logprobs is not None:
            sent = self.logprobs_sent.get(out.request_id, 0)
            new_lp = list(out.logprobs[sent:])
            self.logprobs_sent[out.request_id] = len(out.logprobs)
        if out.finished:
            self.logprobs_sent.pop(out.request_id, None)
        return RankOutput(out.request_id, list(out.new_token_ids), out.text, out.finished,
                          out.finish_reason, out.error, new_lp, out.num_cached_tokens, out.spec,
                          out.timings)


def spawn_spec(spec: RankSpec, num_threads: int) -> RankSpec:
    """The spec with this rank's thread count written into its config."""
    pc = replace(spec.config.parallel, num_threads=num_threads)
    return replace(spec, config=replace(spec.config, parallel=pc))


if __name__ == "__main__":  # python -m dynaspec.dp.rank < pickled RankSpec (dp/process.py)
    import pickle

    rank_main(pickle.load(sys.stdin.buffer))
