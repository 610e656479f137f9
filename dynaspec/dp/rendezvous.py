"""Where the ranks meet: addresses, ports, rank numbering, the shared secret, threads per rank.

The front end (``dynaspec serve`` / ``LLM(...)``) hosts two endpoints on the master machine:
the torch.distributed TCPStore at ``master_port`` (the standard rendezvous every rank joins) and
a control listener at ``master_port + 1`` through which each rank receives its requests and
sends its outputs. Flags win over the environment: ``--dp-master-addr/--dp-master-port``, else
``MASTER_ADDR``/``MASTER_PORT`` (as torchrun sets them), else 127.0.0.1 and a free port (one
machine). Ranks on other machines start with ``dynaspec dp-worker``; there ``WORLD_SIZE`` and
``RANK`` may stand in for ``--data-parallel-size`` and ``--dp-rank-start`` (one rank).

The control channel carries pickles, so it is authenticated: on one machine with a random key
handed to the spawned ranks, across machines with ``DYNASPEC_DP_SECRET``, which must be set to
the same value on every machine (a multi-machine launch without it is refused).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

from dynaspec.config import ParallelConfig, default_num_threads

SECRET_ENV = "DYNASPEC_DP_SECRET"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    store_port: int  # 0: the front end picks a free one (single machine)
    world_size: int
    local_ranks: tuple[int, ...]  # ranks this process starts
    authkey: bytes

    @property
    def control_port(self) -> int:
        return self.store_port + 1 if self.store_port else 0

    @property
    def multi_machine(self) -> bool:
        return len(self.local_ranks) < self.world_size


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve(pc: ParallelConfig, worker: bool = False) -> Rendezvous:
    """The rendezvous for a front end (``worker=False``) or a ``dp-worker`` machine."""
    world = pc.data_parallel_size
    start, local = pc.dp_rank_start, pc.dp_local_size
    if worker and world == 1 and (env_world := _env_int("WORLD_SIZE")):
        world, start, local = env_world, _env_int("RANK") or 0, 1
    if local is None:
        local = world if not worker else 1
    addr = pc.dp_master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = pc.dp_master_port or _env_int("MASTER_PORT") or 0
    ranks = tuple(range(start, start + local))
    if not (0 <= start and start + local <= world):
        raise ValueError(
            f"ranks {start}..{start + local - 1} do not fit data_parallel_size {world}"
        )
    multi = local < world
    if multi and port == 0:
        raise ValueError("ranks on several machines need a rendezvous port: set --dp-master-port "
                         "(or MASTER_PORT) to the same value on every machine")
    secret = os.environ.get(SECRET_ENV)
    if multi and not secret:
        raise ValueError(f"ranks on several machines need a shared secret: set {SECRET_ENV} to the "
                         "same value on every machine (the control channel carries pickles)")
    key = secret.encode() if secret else secrets.token_bytes(32)
    return Rendezvous(addr, port, world, ranks, key)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def threads_per_rank(pc: ParallelConfig, num_local_ranks: int) -> int:
    """Cores this process may use, split evenly between the ranks it starts (at least 1)."""
    if pc.num_threads is not None:
        return pc.num_threads
    return max(1, default_num_threads() // max(1, num_local_ranks))
