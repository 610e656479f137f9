"""The rank processes behind the data-parallel front end: start, watch, replace, stop (§7, §7d).

Hosts the rendezvous (the TCPStore every group forms on, dp/group.py) and the control listener
(one authenticated channel per rank), starts the local ranks, and runs two threads:
- accept: takes each rank's channel, for the ranks of the first start and every replacement;
- pump: reads every channel and process exit into the front end's inbox (heartbeats only
  into the failure watch), feeds the failure watch (dp/failure.py) and the roster
  (dp/roster.py), kills the ranks a verdict names and starts their replacements.
The front end's engine thread sees ("msg", rank, message) and ("lost", rank, why) events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from multiprocessing.connection import Connection, Listener, wait

from dynaspec.config import EngineConfig
from dynaspec.dp.failure import FailureWatch, reap
from dynaspec.dp.messages import (
    GroupLost,
    Heartbeat,
    Hello,
    Joined,
    RankFailed,
    RankReady,
    RankSpec,
    Stop,
)
from dynaspec.dp.process import RankProcess
from dynaspec.dp.rank import spawn_spec
from dynaspec.dp.rendezvous import Rendezvous, threads_per_rank
from dynaspec.dp.roster import Roster, rejoin_key

log = logging.getLogger("dynaspec.dp")

STOP_GRACE_S = 2.0  # ranks told to stop get this long to leave before SIGKILL


class RankSupervisor:
    def __init__(self, config: EngineConfig, rdv: Rendezvous, inbox: queue.SimpleQueue) -> None:
        self.config, self.rdv, self.inbox = config, rdv, inbox
        self.world_size = rdv.world_size
        self.procs: dict[int, RankProcess] = {}
        self.conns: dict[int, Connection] = {}
        self.ready: dict[int, RankReady] = {}
        self._send_lock = threading.Lock()
        self._closing = False
        self._started = False  # every rank joined group 0: verdicts and replacements from now
        self.roster = Roster(self.world_size, set(rdv.local_ranks), self.send, self._spawn,
                             RankSpec.start_timeout_s)
        self.watch = FailureWatch(self)
        self._listener: Listener | None = None  # the control listener, from start()

    # ---- start-up ----------------------------------------------------------------------------
    def start(self) -> None:
        import torch.distributed as dist

        r = self.rdv
        self.bind = r.master_addr if r.multi_machine else "127.0.0.1"
        store = dist.TCPStore(self.bind, r.store_port, is_master=True, wait_for_workers=False)
        self._store: dist.TCPStore | None = store  # None once closed
        self._listener = listener = Listener((self.bind, r.control_port), authkey=r.authkey)
        self.control_port = listener.address[1]
        self.threads = threads_per_rank(self.config.parallel, len(r.local_ranks))
        threading.Thread(target=self._accept, args=(listener,), name="dynaspec-dp-accept",
                         daemon=True).start()
        threading.Thread(target=self._pump, name="dynaspec-dp-pump", daemon=True).start()
        for rank in r.local_ranks:
            self._spawn(rank, joining=False)
        if r.multi_machine:
            log.info("waiting for ranks %s to join at %s:%d (store) / %d (control)",
                     sorted(set(range(self.world_size)) - set(r.local_ranks)), r.master_addr,
                     store.port, self.control_port)

    def _spawn(self, rank: int, joining: bool = True) -> None:
        assert self._store is not None  # a closed supervisor spawns nothing
        spec = RankSpec(self.config, rank, self.world_size, self.bind, self._store.port,
                        self.bind, self.control_port, self.rdv.authkey, joining=joining)
        self.procs[rank] = RankProcess(spawn_spec(spec, self.threads))

    def _accept(self, listener: Listener) -> None:
        while not self._closing:
            try:
                conn = listener.accept()
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

    # ---- the pump thread -----------------------------------------------------------------------
    def _pump(self) -> None:
        while not self._closing:
            conns = {c: rank for rank, c in list(self.conns.items())}
            sentinels = {p.sentinel: (rank, p) for rank, p in list(self.procs.items())
                         if p.sentinel is not None}
            try:
                ready = wait([*conns, *sentinels], timeout=0.2) if conns or sentinels else []
            except OSError:
                ready = []
            if not conns and not sentinels:
                time.sleep(0.05)
            # Channels first: a rank's last words must be read before its exit is seen.
            for obj in sorted(ready, key=lambda o: o in sentinels):
                if obj in sentinels:
                    self._exited(*sentinels[obj])
                elif obj in conns:
                    self._read(obj, conns[obj])
            if self._closing:
                return
            self.watch.check()
            for rank in self.roster.tick(time.monotonic()):
                self._declare_lost({rank: "was not ready in time"})

    def _exited(self, rank: int, proc: RankProcess) -> None:
        if self.procs.get(rank) is not proc:
            return  # already declared lost and replaced
        if rank in self.conns:
            self._read(self.conns[rank], rank)
        code = proc.exitcode
        proc.join(0)
        self.watch.on_exit(rank, code)
        if not self._started:
            self.inbox.put(("exit", rank, code))

    def _read(self, conn: Connection, rank: int) -> None:
        try:
            for _ in range(64):  # bounded, so one chatty rank cannot starve the others
                if not conn.poll():
                    return
                msg = conn.recv()
                if isinstance(msg, Heartbeat):
                    self.watch.beats.beat(rank)  # liveness only: not news for the engine
                    continue
                self.watch.heard(rank, msg)
                self._lifecycle(rank, msg)
                self.inbox.put(("msg", rank, msg))
        except (EOFError, OSError):
            if self.conns.get(rank) is conn:
                self.conns.pop(rank, None)
            self.watch.on_eof(rank)
            if not self._started:
                self.inbox.put(("eof", rank, None))

    def _lifecycle(self, rank: int, msg: object) -> None:
        if isinstance(msg, Joined):
            self.roster.joined(rank, msg.epoch)
            if not self._started and len(self.roster.serving) == self.world_size:
                self._started = True
        elif isinstance(msg, RankReady):
            self.ready[rank] = msg
            if self._started:
                self.roster.ready(rank)
                self.watch.restart_clock(self.roster.members)
        elif isinstance(msg, RankFailed) and not self._started:
            self.inbox.put(("start-failed", rank, msg.reason))
        elif isinstance(msg, GroupLost):
            log.warning("data-parallel rank %d lost its step exchange in group %d: %s", rank,
                        msg.epoch, msg.reason)

    def _declare_lost(self, culprits: dict[int, str]) -> None:
        """Kill the named ranks, move the survivors on, tell the engine thread."""
        culprits = {r: why for r, why in culprits.items()
                    if r in self.procs or r in self.conns or r in self.roster.members}
        if not culprits or self._closing:
            return
        for rank in culprits:
            proc = self.procs.pop(rank, None)
            if proc is not None:
                proc.kill()  # a stopped (SIGSTOP) rank dies only by SIGKILL
                proc.join(5.0)
            conn = self.conns.pop(rank, None)
            if conn is not None:
                conn.close()
            self.ready.pop(rank, None)
            self.watch.beats.forget(rank)
        self.roster.lost(culprits)
        for rank in culprits.keys() & self.roster.awaiting_remote:
            if self._store is not None:  # its machine's next start of it is a replacement
                self._store.set(rejoin_key(rank), "1")
        self.watch.restart_clock(self.roster.members)
        for rank, why in culprits.items():
            self.inbox.put(("lost", rank, f"data-parallel rank {rank} {why}"))

    # ---- sending and stopping ------------------------------------------------------------------
    def send(self, rank: int, msg: object) -> None:
        conn = self.conns.get(rank)
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send(msg)
        except OSError:
            pass  # the pump sees the closed channel and the failure watch names the rank

    def shutdown(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every rank (they leave together on one tick), SIGKILL what is left after the
        grace (a rank hung in a step or stopped), close the channels and the rendezvous."""
        self._closing = self.roster.closing = True
        for rank in list(self.conns):
            self.send(rank, Stop())
        t0, procs = time.monotonic(), dict(self.procs)
        for rank in self.roster.starting.keys() & procs.keys():
            procs[rank].kill()  # still loading its model: it holds no request, nothing to wait for
        reap(self.procs, grace_s)
        log.info("data parallel: %d local rank(s) stopped in %.1f s (%s)", len(procs),
                 time.monotonic() - t0, ", ".join(f"rank {r}: exit code {p.exitcode}"
                                                   for r, p in sorted(procs.items())))
        for conn in list(self.conns.values()):
            conn.close()
        self.conns.clear()
        if self._listener is not None:
            self._listener.close()
        self._store = None
