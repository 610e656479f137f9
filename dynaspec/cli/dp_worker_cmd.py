"""`dynaspec dp-worker`: start this machine's data-parallel ranks and join a front end elsewhere.

The front end (`dynaspec serve --data-parallel-size N --dp-local-size L ...` on the master
machine) hosts the rendezvous; each other machine runs `dp-worker` with the same engine flags
and its share of the ranks (`--dp-rank-start R --dp-local-size L`), or with the torchrun-style
environment `MASTER_ADDR MASTER_PORT WORLD_SIZE RANK` for one rank. `DYNASPEC_DP_SECRET` must
be the same on every machine. The command exits when its ranks do (the front end stops them).
A rank of this machine that is lost is not restarted by the front end (it can only start its
own machine's ranks): the other ranks keep serving without it (§7d).
"""

from __future__ import annotations

import argparse
import logging

from dynaspec.engine_flags import add_engine_args, engine_kwargs

log = logging.getLogger("dynaspec.dp")


def register(sub) -> None:
    p = sub.add_parser(
        "dp-worker", help="start this machine's data-parallel ranks for a remote front end"
    )
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynaspec.config import EngineConfig
    from dynaspec.dp.messages import RankSpec
    from dynaspec.dp.process import RankProcess, wait_all
    from dynaspec.dp.rank import spawn_spec
    from dynaspec.dp.rendezvous import resolve, threads_per_rank

    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    rdv = resolve(config.parallel, worker=True)
    if rdv.store_port == 0:
        raise ValueError("dp-worker needs the front end's rendezvous port: --dp-master-port "
                         "or MASTER_PORT")
    threads = threads_per_rank(config.parallel, len(rdv.local_ranks))
    procs = [RankProcess(spawn_spec(RankSpec(config, rank, rdv.world_size, rdv.master_addr,
                                             rdv.store_port, rdv.master_addr, rdv.control_port,
                                             rdv.authkey), threads))
             for rank in rdv.local_ranks]
    log.info("ranks %s of %d started, joining %s:%d", list(rdv.local_ranks), rdv.world_size,
             rdv.master_addr, rdv.store_port)
    return wait_all(procs)
