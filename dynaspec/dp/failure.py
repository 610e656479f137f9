"""Failure verdicts for the data-parallel front end, and stopping rank processes (§7d).

Runs on the front end's pump thread. Signs of failure: a local rank process exits, a remote
rank's channel closes, a rank reports that it raised (``RankFailed``), a rank reports that its
step exchange failed in the group the front end last formed (``GroupLost``: it is alive and a
peer is not), a rank's heartbeat goes silent for ``dp_heartbeat_timeout_s`` (dp/heartbeat.py:
the whole process stopped, as with SIGSTOP; a rank busy in a long step keeps beating), or a
serving rank goes quiet for far longer than any step took. A death is certain at once (a victim
no longer exits), as is a silent heartbeat and the one member that did not report when all
the others did; otherwise, after a short settle (``SETTLE_S``) to
collect the peers' reports, the culprits are the ranks gone quiet, else the members that did
not report a failed exchange (stuck inside a step: alive to the OS, silent to their peers).
The front end then kills the culprits and moves the survivors to a new group (dp/roster.py);
when every member reported a failed exchange and none is dead (a long stall on a loaded
machine), they re-form as they are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dynaspec.dp.heartbeat import HeartbeatClock
from dynaspec.dp.messages import GroupLost, RankFailed
from dynaspec.dp.rank import IDLE_POLL_S

log = logging.getLogger("dynaspec.dp")

SETTLE_S = 1.0  # after a first sign of failure, how long to gather the peers' reports
EXIT_GRACE_S = 0.5  # how long a rank its peers lost may take to become waitable after a kill


def reap(procs: dict, grace_s: float) -> None:
    """Wait up to ``grace_s`` for the processes to leave, then SIGKILL their process groups
    (a stopped or hung process only dies by SIGKILL; the group takes any child with it)."""
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        p.kill()
    for p in procs.values():
        p.join(5.0)
    procs.clear()


class FailureWatch:
    """Turns exits, closed channels, peer reports and silence into one verdict naming the
    failed rank(s) (module docstring); ``declare`` is the front end's action on it."""

    def __init__(self, eng, clock: Callable[[], float] = time.monotonic) -> None:
        self.eng, self.clock = eng, clock
        self.beats = HeartbeatClock(eng.config.parallel.dp_heartbeat_timeout_s, clock)
        self.dead: dict[int, str] = {}
        self.reported: set[int] = set()  # members whose exchange failed (alive, victims)
        self.first: float | None = None
        self.last_heard: dict[int, float] = {}
        self.longest_gap = 0.0

    def heard(self, rank: int, msg: object) -> None:
        now = self.clock()
        if rank in self.last_heard and rank in self.eng.roster.serving:
            self.longest_gap = max(self.longest_gap, now - self.last_heard[rank])
        self.last_heard[rank] = now
        if isinstance(msg, RankFailed) and not msg.victim:
            self.dead[rank] = f"failed: {msg.reason}"
            self._problem()
        elif isinstance(msg, GroupLost) and msg.epoch == self.eng.roster.epoch:
            self.reported.add(rank)  # a stale report (a newer group is on its way) is no sign
            self._problem()

    def on_exit(self, rank: int, code: int | None) -> None:
        if not self.eng._closing:
            self.dead[rank] = f"died (exit code {code})"
            self._problem()

    def on_eof(self, rank: int) -> None:
        if not self.eng._closing and rank not in self.eng.procs:
            self.dead[rank] = "closed its control channel (process or machine gone)"
            self._problem()

    def restart_clock(self, ranks) -> None:
        """A new group is forming: its members are silent meanwhile, by design."""
        now = self.clock()
        for r in ranks:
            self.last_heard[r] = now

    def _exits_not_yet_seen(self, wait_for: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """A peer's report can be read before the process exit that caused it can be: a killed
        process closes its sockets before it can be waited for. Ask the processes (giving the
        ranks in ``wait_for`` a moment), so a death is named as one, not as silence."""
        for rank, proc in list(self.eng.procs.items()):
            if rank in wait_for:
                proc.join(EXIT_GRACE_S)
            code = proc.exitcode
            if code is not None and rank not in self.dead:
                self.dead[rank] = f"died (exit code {code})"

    def _problem(self) -> None:
        if self.first is None:
            self.first = self.clock()

    def silence_s(self) -> float:
        pc = self.eng.config.parallel
        return 2 * (pc.dp_rank_timeout_s + IDLE_POLL_S) + 2 * self.longest_gap

    def check(self) -> None:
        eng = self.eng
        if eng._closing or not eng._started:
            return
        now = self.clock()
        serving = eng.roster.serving
        silent = {r for r in serving if now - self.last_heard.get(r, now) > self.silence_s()
                  and r not in self.dead and r not in self.reported}
        unbeating = self.beats.silent((serving | set(eng.roster.members)) - set(self.dead), now)
        if silent or unbeating:
            self._problem()
        if self.first is not None:
            self._exits_not_yet_seen()
        # A death is certain at once (a victim no longer exits), and so is the one member left
        # quiet when every other has reported; else the settle lets the reports come in.
        unreported = set(eng.roster.members) - self.reported
        if self.reported and len(unreported) == 1 and not self.dead:
            self._exits_not_yet_seen(wait_for=unreported)
        certain = bool(self.dead) or bool(unbeating) or (bool(self.reported)
                                                         and len(unreported) <= 1)
        if self.first is None or (not certain and now - self.first < SETTLE_S):
            return
        timeout = eng.config.parallel.dp_rank_timeout_s
        culprits = {r: f"stopped answering (no heartbeat for {s:.1f} s)"
                    for r, s in unbeating.items()}
        culprits.update(self.dead)  # exited after all: named as a death
        if not culprits:
            culprits = {r: f"stopped answering (silent for more than {self.silence_s():.1f} s)"
                        for r in silent}
        if not culprits and self.reported:
            culprits = {r: f"stopped answering (no step within {timeout:.1f} s past the longest "
                           "step)" for r in eng.roster.members if r not in self.reported}
        self.dead, self.first = {}, None
        reported, self.reported = self.reported, set()
        if culprits:
            eng._declare_lost(culprits)
        elif reported:
            log.warning("data-parallel ranks %s all lost their step exchange, none is dead: "
                        "re-forming their group", sorted(reported))
            eng.roster.regroup_all()
        self.restart_clock(eng.roster.members)
