"""Failure verdicts for the data-parallel front end, and reaping rank processes.

Runs on the front end's pump thread. Signs of failure: a local rank process exits (its exit
code tells a victim, ``EXIT_COLLECTIVE``, from a culprit), a remote rank's channel closes, a rank
reports that it raised (a culprit), a rank reports that its step exchange failed (a victim:
it is alive and a peer is not), or a rank goes quiet for far longer than any step took. After a
short settle (``SETTLE_S``) to collect the peers' reports, the culprits are the ranks that died
or raised, else the ones that never reported (stuck). Then every rank is stopped.
"""

from __future__ import annotations

import logging
import time

from dynaspec.dp.messages import RankFailed, Stop
from dynaspec.dp.rank import EXIT_COLLECTIVE, IDLE_POLL_S

log = logging.getLogger("dynaspec.dp")

SETTLE_S = 1.0  # after a first sign of failure, how long to gather the peers' reports


def reap(procs: dict, timeout_s: float) -> None:
    """Join, then SIGTERM, then SIGKILL (a stopped process only dies by SIGKILL)."""
    deadline = time.monotonic() + timeout_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for sig in ("terminate", "kill"):
        alive = [p for p in procs.values() if p.is_alive()]
        for p in alive:
            getattr(p, sig)()
        for p in alive:
            p.join(3.0)
    procs.clear()


class FailureWatch:
    """Runs on the pump thread: turns exits, closed channels, peer reports and silence into one
    verdict naming the failed rank(s), then stops the engine (module docstring)."""

    def __init__(self, eng) -> None:  # type: ignore[no-untyped-def]
        self.eng = eng
        self.exited: set[int] = set()
        self.dead: dict[int, str] = {}
        self.reported: set[int] = set()  # ranks that saw the exchange fail (alive, victims)
        self.first: float | None = None
        self.last_heard: dict[int, float] = {}
        self.longest_gap = 0.0

    def heard(self, rank: int, msg: object) -> None:
        now = time.monotonic()
        if rank in self.last_heard:
            self.longest_gap = max(self.longest_gap, now - self.last_heard[rank])
        self.last_heard[rank] = now
        if isinstance(msg, RankFailed) and len(self.eng.ready) == self.eng.world_size:
            if msg.victim:  # its step exchange failed: a peer is the culprit
                self.reported.add(rank)
            else:
                self.dead[rank] = f"failed: {msg.reason}"
            self._problem()

    def on_exit(self, rank: int, code: int | None) -> None:
        if code == EXIT_COLLECTIVE:
            self.reported.add(rank)  # it left because a peer failed: a victim, not the culprit
        if rank not in self.reported and rank not in self.dead and not self.eng._closing:
            self.dead[rank] = f"died (exit code {code})"
            self._problem()

    def on_eof(self, rank: int) -> None:
        if rank not in self.reported and not self.eng._closing and rank not in self.procs_local():
            self.dead[rank] = "closed its control channel (process or machine gone)"
            self._problem()

    def procs_local(self) -> set[int]:
        return set(self.eng.procs)  # local ranks are judged by their exit, not their channel

    def _problem(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def check(self) -> None:
        eng = self.eng
        if eng.failure_reason is not None or eng._closing or len(eng.ready) < eng.world_size:
            return
        now = time.monotonic()
        pc = eng.config.parallel
        silence = 2 * (pc.dp_rank_timeout_s + IDLE_POLL_S) + 2 * self.longest_gap
        for rank, t in self.last_heard.items():
            if now - t > silence and rank not in self.dead and rank not in self.reported:
                self._problem()  # nobody reported yet, but this rank went quiet
        if self.first is None or now - self.first < SETTLE_S:
            return
        culprits = dict(self.dead)
        if not culprits:
            quiet = sorted(set(range(eng.world_size)) - self.reported)
            culprits = {r: f"stopped answering (no step within {pc.dp_rank_timeout_s:.1f} s past "
                           "the longest step)" for r in quiet}
        if not culprits:
            culprits = {r: "lost its peers" for r in range(eng.world_size)}
        eng._culprits = culprits
        eng.failure_reason = "; ".join(
            f"data-parallel rank {r} {why}" for r, why in sorted(culprits.items())
        )
        log.error(
            "%s: failing its requests and shutting the data-parallel engine down",
            eng.failure_reason,
        )
        eng._inbox.put(("failure", -1, None))  # wake step() so in-flight requests fail now
        for rank in list(eng.conns):
            eng._send(rank, Stop())
        reap(eng.procs, 2.0)
