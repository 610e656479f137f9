"""Which data-parallel ranks serve, their group epochs, and replacing a lost rank (§7d).

Runs on the front end's pump thread (the engine thread only reads ``serving``). A rank slot is
one of: serving (it joined a group and has not been lost), lost and waiting for a replacement,
starting (a replacement loading its model), joining (ready, told to join the next group), or
given up. After a loss the survivors get ``Regroup(epoch, survivors, agree=False)`` at once; a
replacement that reports ready is added with ``Regroup(epoch, members + it, agree=True)``, so the
serving ranks move at one step boundary (dp/regroup.py).

Replacements are bounded: a slot whose replacement dies (or does not get ready) before it joins
is retried after 1, 2, 4... s, and given up with a log line after ``MAX_START_ATTEMPTS``
failures in a row; a rank that joined resets its count. A rank started on another machine
(``dynaspec dp-worker``) cannot be restarted from here: its slot waits for that machine to start
it again (``awaiting_remote``; the rank learns it is a replacement from the store, see
``rejoin_key``), and its survivors serve without it meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dynaspec.dp.messages import Regroup

log = logging.getLogger("dynaspec.dp")

MAX_START_ATTEMPTS = 3


def rejoin_key(rank: int) -> str:
    """The TCPStore key the front end sets when a rank of another machine is lost: a rank that
    finds it at start is a replacement (it waits for a Regroup instead of forming group 0)."""
    return f"dynaspec/rejoin/{rank}"
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)


@dataclass
class ResilienceCounts:
    """What /metrics and the bench read (dp/metrics.py): counts since start."""

    rank_losses: int = 0
    replacements: int = 0
    requeued: int = 0
    failed: int = 0
    given_up: int = 0
    loss_times: list[float] = field(default_factory=list)  # monotonic, per loss
    join_times: list[float] = field(default_factory=list)  # monotonic, per replacement joined


class Roster:
    def __init__(self, world_size: int, local: set[int], send: Callable[[int, object], None],
                 spawn: Callable[[int], None], start_timeout_s: float) -> None:
        self.world_size, self.local = world_size, set(local)
        self.send, self.spawn, self.start_timeout_s = send, spawn, start_timeout_s
        self.epoch = 0
        self.members: tuple[int, ...] = tuple(range(world_size))
        self.serving: frozenset[int] = frozenset()  # read by the engine thread (routing, health)
        self.starting: dict[int, float] = {}  # slot -> when its replacement was started
        self.joining: set[int] = set()
        self.retry_at: dict[int, float] = {}  # lost slots waiting for a (re)start
        self.attempts: dict[int, int] = {}
        self.given_up: set[int] = set()
        self.awaiting_remote: set[int] = set()  # lost ranks of other machines, not restarted here
        self.counts = ResilienceCounts()
        self.last_loss: str | None = None  # "data-parallel rank R <why>", for /health
        self.closing = False

    # ---- what the pump saw -------------------------------------------------------------------
    def joined(self, rank: int, epoch: int) -> None:
        if rank not in self.members or epoch < 0:
            return
        self.serving = self.serving | {rank}
        if rank in self.joining:
            self.joining.discard(rank)
            self.attempts.pop(rank, None)
            self.counts.replacements += 1
            self.counts.join_times.append(time.monotonic())
            log.warning("data-parallel rank %d replaced: serving again in group %d (%d of %d "
                        "ranks serve)", rank, epoch, len(self.serving), self.world_size)

    def ready(self, rank: int) -> None:
        """A replacement loaded its model (started here, or by its own machine's dp-worker for a
        slot awaiting it): it joins with the next group."""
        started_here = self.starting.pop(rank, None) is not None
        restarted_there = rank in self.awaiting_remote
        self.awaiting_remote.discard(rank)
        if not (started_here or restarted_there) or self.closing:
            return
        self.joining.add(rank)
        self._regroup(tuple(sorted({*self.members, rank})), agree=True)

    def lost(self, culprits: dict[int, str]) -> None:
        """Ranks declared dead (already killed): the rest move to a group without them."""
        now = time.monotonic()
        for rank, why in culprits.items():
            was_starting = self.starting.pop(rank, None) is not None or rank in self.joining
            self.joining.discard(rank)
            if not was_starting:
                self.last_loss = f"data-parallel rank {rank} {why}"
                self.counts.rank_losses += 1
                self.counts.loss_times.append(now)
                log.error("data-parallel rank %d %s: %d rank(s) keep serving", rank, why,
                          len(self.serving - {rank}))
            self.serving = self.serving - {rank}
            self._plan_restart(rank, was_starting, why, now)
        if any(r in self.members for r in culprits):
            survivors = tuple(r for r in self.members if r not in culprits)
            if survivors:
                self._regroup(survivors, agree=False)
            else:
                self.members = ()

    def recovering(self) -> bool:
        """A replacement is starting, joining or due to be retried."""
        return bool(self.starting or self.joining or self.retry_at)

    def regroup_all(self) -> None:
        """Every member lost its exchange but none is dead (a long stall): re-form as is."""
        self._regroup(self.members, agree=False)

    # ---- the pump's clock ----------------------------------------------------------------------
    def tick(self, now: float) -> list[int]:
        """Start due replacements; the slots whose start timed out (the pump kills them)."""
        if self.closing:
            return []
        for rank, at in list(self.retry_at.items()):
            if now >= at:
                del self.retry_at[rank]
                self.attempts[rank] = self.attempts.get(rank, 0) + 1
                self.starting[rank] = now
                log.warning("data-parallel rank %d: starting a replacement (attempt %d of %d)",
                            rank, self.attempts[rank], MAX_START_ATTEMPTS)
                self.spawn(rank)
        return [r for r, t in self.starting.items() if now - t > self.start_timeout_s]

    # ---- helpers -------------------------------------------------------------------------------
    def _plan_restart(self, rank: int, was_starting: bool, why: str, now: float) -> None:
        if self.closing:
            return
        if rank not in self.local:
            self.awaiting_remote.add(rank)
            log.error("data-parallel rank %d ran on another machine: it rejoins when that "
                      "machine starts it again (dynaspec dp-worker with the same ranks)", rank)
            return
        tries = self.attempts.get(rank, 0) if was_starting else 0
        if not was_starting:
            self.attempts[rank] = 0
        if tries >= MAX_START_ATTEMPTS:
            self.given_up.add(rank)
            self.counts.given_up += 1
            log.error("data-parallel rank %d: giving up after %d failed starts (last: %s); "
                      "%d of %d ranks serve", rank, tries, why, len(self.serving),
                      self.world_size)
            return
        self.retry_at[rank] = now + (BACKOFF_S[min(tries - 1, len(BACKOFF_S) - 1)] if tries
                                     else 0.0)

    def _regroup(self, members: tuple[int, ...], agree: bool) -> None:
        self.epoch += 1
        self.members = members
        msg = Regroup(self.epoch, members, agree)
        for rank in members:
            self.send(rank, msg)
