"""Rank liveness outside the step exchange (§7d): a heartbeat thread on each rank, and the
front end's clock of how long each rank has been silent.

Why a thread of its own: the step exchange only notices a stopped peer (SIGSTOP, a machine that
froze) when its wait times out, and that timeout must cover the longest step any rank runs, so
it is seconds. A rank's heartbeat thread needs the GIL only for a moment every
``beat_interval_s``: it keeps beating while the rank's main thread is inside a long step (torch
ops and our kernels release the GIL) or blocked in the exchange, and it stops exactly when the
whole process stops. So the front end can name a stopped rank after about a second, while a
merely slow one is never named by this rule (the exchange timeout remains the backstop for a
rank alive but stuck).

The front end counts silence in its own running time (``HeartbeatClock``): an interval between
two of its checks counts at most ``MAX_CREDIT_S``, so a stall of the front end itself (a loaded
machine, a paused VM: every process stopped alike) cannot make every rank look dead at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

from dynaspec.dp.messages import Heartbeat

MAX_INTERVAL_S = 0.2
MAX_CREDIT_S = 0.5  # the most one interval between two checks of the front end counts


def beat_interval_s(timeout_s: float) -> float:
    """Five beats or more within the timeout, at most every 0.2 s."""
    return min(MAX_INTERVAL_S, timeout_s / 5)


class LockedChannel:
    """A rank's control channel shared by its main thread and its heartbeat thread: sends are
    serialised (a Connection is not safe for two concurrent senders); the main thread alone
    receives."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: object) -> None:
        with self._lock:
            self.conn.send(msg)

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def recv(self) -> object:
        return self.conn.recv()

    def close(self) -> None:
        with self._lock:
            self.conn.close()


class HeartbeatSender:
    """A daemon thread sending ``Heartbeat(rank)`` every ``interval_s`` until stopped or the
    channel closes."""

    def __init__(self, channel: LockedChannel, rank: int, interval_s: float) -> None:
        self.channel, self.rank, self.interval_s = channel, rank, interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dynaspec-dp-heartbeat",
                                       daemon=True)
        self.sent_at: deque[float] = deque(maxlen=100)  # monotonic times of the last beats

    def start(self) -> HeartbeatSender:
        """The first beat goes from the caller's thread: started before the rank reports ready,
        it reaches the front end ahead of RankReady (one ordered channel), so every ready rank
        has been heard beating and is judged from its first step on."""
        self._beat()
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except (OSError, ValueError):
                return  # the channel is closed: the rank is leaving, or the front end is gone

    def _beat(self) -> None:
        self.channel.send(Heartbeat(self.rank))
        self.sent_at.append(time.monotonic())


class HeartbeatClock:
    """How long each rank's heartbeat has been silent, in the front end's running time (module
    docstring). Only ranks heard beating at least once are judged (a rank from before the
    heartbeat, or still loading, is left to the other rules). ``timeout_s`` 0: never judged."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        self._base = 0.0  # running time at the last check
        self._last_check = clock()
        self.last_beat: dict[int, float] = {}  # rank -> running time of its last beat
        self.longest_gap_s = 0.0  # the longest gap between two beats of one rank seen

    def running_time(self, now: float) -> float:
        return self._base + min(max(0.0, now - self._last_check), MAX_CREDIT_S)

    def beat(self, rank: int) -> None:
        t = self.running_time(self.clock())
        if rank in self.last_beat:
            self.longest_gap_s = max(self.longest_gap_s, t - self.last_beat[rank])
        self.last_beat[rank] = t

    def forget(self, rank: int) -> None:
        """The rank was declared lost: its replacement starts a fresh record."""
        self.last_beat.pop(rank, None)

    def silent(self, ranks, now: float) -> dict[int, float]:
        """Advance the running time to ``now``; the ranks among ``ranks`` whose heartbeat has
        been silent for more than the timeout, with how long."""
        self._base, self._last_check = self.running_time(now), now
        if not self.timeout_s:
            return {}
        return {r: self._base - self.last_beat[r] for r in ranks
                if r in self.last_beat and self._base - self.last_beat[r] > self.timeout_s}
