"""One generation of the ranks' process group, formed at start and re-formed at run time (§7d).

A group is a membership (an epoch number and the rank slots in it) plus a gloo process group
among those ranks, created directly (``ProcessGroupGloo``) rather than as torch.distributed's
default group: the default world cannot lose a member or take a new one, while a group of our
own is just an object a rank can drop and replace. Every epoch has its own key prefix on the
front end's TCPStore (``dynaspec/group/<epoch>/``), so a new rendezvous never reads an old one.

Forming is two parts. First an arrival barrier on the store that can be abandoned: each member
sets its key and polls for the others', and gives up when the front end sent a newer membership
(a member of this one was lost meanwhile), when the rank is told to stop, or at the timeout.
Then the gloo group itself, which only connects members already known to be there.

An old group is retired, never destroyed: destroying a gloo group whose peer died blocks for
seconds (measured 1-2 s), on the path that should be stepping the survivors' requests.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

from dynaspec.dp.agreement import CollectiveError

ARRIVAL_POLL_S = 0.02
_RETIRED: list = []  # groups left behind by a re-formation (see the module docstring)


class GroupAbandoned(Exception):
    """Forming stopped because a newer membership arrived or the rank is stopping."""


@dataclass(frozen=True)
class Membership:
    epoch: int
    members: tuple[int, ...]  # rank slots, ascending: a slot's index here is its group rank

    def index(self, rank: int) -> int:
        return self.members.index(rank)

    @property
    def prefix(self) -> str:
        return f"dynaspec/group/{self.epoch}/"


class RankGroup:
    """The formed group of one epoch: gather rows, broadcast bytes, in member order."""

    def __init__(self, pg, membership: Membership, rank: int) -> None:
        self.pg, self.membership, self.rank = pg, membership, rank
        self.index = membership.index(rank)
        self.size = len(membership.members)

    @classmethod
    def form(cls, store, membership: Membership, rank: int, timeout_s: float,
             abandon: Callable[[], bool]) -> RankGroup:
        import torch.distributed as dist

        prefix = membership.prefix
        store.set(f"{prefix}arrived/{rank}", "1")
        keys = [f"{prefix}arrived/{r}" for r in membership.members]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if abandon():
                raise GroupAbandoned(f"group {membership.epoch} abandoned")
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(membership.members, keys) if not store.check([k])]
                raise CollectiveError(f"group {membership.epoch}: ranks {missing} did not arrive "
                                      f"within {timeout_s:.1f} s")
            time.sleep(ARRIVAL_POLL_S)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo/", store),
                                       membership.index(rank), len(membership.members), timeout)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses
            raise CollectiveError(f"group {membership.epoch} did not connect: {exc}") from exc
        return cls(pg, membership, rank)

    def gather(self, row: list[float], timeout_s: float) -> list[list[float]]:
        """All-gather of one float64 row per member (every member holds the same rows)."""
        import torch

        t = torch.tensor(row, dtype=torch.float64)  # [n]
        out = [torch.empty_like(t) for _ in range(self.size)]  # size x [n]
        try:
            work = self.pg.allgather([out], [t])
            work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses
            raise CollectiveError(f"step exchange failed after waiting up to {timeout_s:.1f} s: "
                                  f"{type(exc).__name__}: {exc}") from exc
        return [o.tolist() for o in out]

    def broadcast_object(self, obj: object, root_index: int, timeout_s: float) -> object:
        """``obj`` as the member at ``root_index`` has it (pickled, length first)."""
        import torch

        data = pickle.dumps(obj) if self.index == root_index else b""
        size = torch.tensor([len(data)], dtype=torch.int64)  # [1]
        self._broadcast(size, root_index, timeout_s)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
               else torch.empty(int(size.item()), dtype=torch.uint8))  # [bytes]
        if buf.numel():
            self._broadcast(buf, root_index, timeout_s)
        return pickle.loads(buf.numpy().tobytes()) if self.index != root_index else obj

    def _broadcast(self, t, root_index: int, timeout_s: float) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = root_index
        try:
            self.pg.broadcast([t], opts).wait(datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001
            raise CollectiveError(f"group {self.membership.epoch} broadcast failed: {exc}") from exc

    def retire(self) -> None:
        _RETIRED.append(self.pg)
        self.pg = None
